"""The spillover rule: go standard at once unless a persistent replica frees up sooner than the standard TTFT."""

from __future__ import annotations

import pytest

from policy.spillover import Ewma, SpilloverEstimator


def test_ewma_starts_at_the_first_sample_and_moves_by_its_weight():
    e = Ewma(0.25)
    assert e.value is None
    e.add(4.0)
    assert e.value == 4.0
    e.add(8.0)
    assert e.value == pytest.approx(5.0)
    with pytest.raises(ValueError):
        Ewma(0.0)


def _busy(max_tokens: int, tpot_s: float, streamed: int, now: float) -> SpilloverEstimator:
    """One request in flight that streamed ``streamed`` tokens (1 prefill token + quanta of 8) by ``now``."""
    est = SpilloverEstimator(weight=1.0)
    est.started("a", max_tokens, now - 1.0)
    t = now - 1.0 + 0.01
    est.persistent_chunk("a", 1, t)  # the prefill token: TTFT 10 ms
    sent = 1
    while sent < streamed:
        t += 8 * tpot_s
        est.persistent_chunk("a", 8, t)
        sent += 8
    assert t <= now
    return est


def test_a_free_replica_is_always_tried_within_the_cap():
    est = SpilloverEstimator()
    assert est.wait_budget(free_replicas=1, cap_s=0.5, now=0.0) == 0.5


def test_all_busy_with_nothing_observed_goes_standard_at_once():
    est = SpilloverEstimator()
    est.started("a", 128, 0.0)
    assert est.wait_budget(free_replicas=0, cap_s=0.5, now=1.0) is None  # no TPOT, no standard TTFT yet


def test_a_long_running_request_means_spill_now():
    est = _busy(max_tokens=128, tpot_s=0.02, streamed=17, now=1.0)
    est.standard_first_chunk(0.4)
    # last chunk at 0.33 s (prefill token at 0.01, two quanta of 8 at 20 ms/token): 111 tokens to go
    assert est.time_to_free(1.0) == pytest.approx((128 - 17) * 0.02 - (1.0 - 0.33))
    assert est.wait_budget(0, cap_s=0.5, now=1.0) is None


def test_a_request_about_to_finish_is_waited_for_but_never_past_the_standard_ttft():
    est = _busy(max_tokens=20, tpot_s=0.01, streamed=17, now=1.0)
    est.standard_first_chunk(0.4)
    assert est.time_to_free(1.0) < 0.05
    budget = est.wait_budget(0, cap_s=0.5, now=1.0)
    assert budget == pytest.approx(0.4 - 0.01)  # the standard TTFT less the persistent one
    assert est.wait_budget(0, cap_s=0.1, now=1.0) == 0.1  # and never past the cap


def test_the_soonest_of_several_requests_counts_and_finished_ones_are_forgotten():
    est = _busy(max_tokens=128, tpot_s=0.01, streamed=9, now=1.0)
    est.started("b", 4, 0.9)
    est.persistent_chunk("b", 1, 0.95)
    assert est.time_to_free(0.96) == pytest.approx(3 * 0.01 - 0.01)  # "b": 3 tokens left, 10 ms into them
    assert est.time_to_free(1.0) == 0.0  # overdue: never negative
    est.finished("b")
    est.finished("a")
    assert est.time_to_free(1.0) is None
    assert est.snapshot()["in_flight"] == 0

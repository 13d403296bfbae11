"""The persistent pool's autoscaling policy on Serve's real context and config objects (no cluster)."""

from __future__ import annotations

import pytest

serve_config = pytest.importorskip("ray.serve.config")

from deployments.autoscaling import ELIGIBLE_DEMAND, POLICY_PATH, eligible_demand_policy  # noqa: E402
from deployments.pools import persistent_pool_defaults, standard_pool_defaults  # noqa: E402


def _ctx(replicas: int, demand: dict | None, ongoing: float = 0.0, target: float = 1.0):
    config = serve_config.AutoscalingConfig(min_replicas=1, max_replicas=8, target_ongoing_requests=target)
    return serve_config.AutoscalingContext(
        deployment_id=None, deployment_name="PersistentReplica", app_name="app",
        current_num_replicas=replicas, target_num_replicas=replicas,
        running_replicas=[f"r{i}" for i in range(replicas)], total_num_requests=ongoing,
        total_queued_requests=0.0,
        aggregated_metrics={ELIGIBLE_DEMAND: demand} if demand is not None else {},
        raw_metrics={}, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8,
        policy_state={}, last_scale_up_time=None, last_scale_down_time=None, current_time=0.0, config=config)


def test_spilled_demand_asks_for_more_replicas_though_nothing_waits():
    # one replica busy, two eligible requests served standard: nothing queued at Serve, demand 3
    desired, _ = eligible_demand_policy(_ctx(1, {"r0": 3.0}, ongoing=1.0))
    assert desired == 3.0


def test_the_largest_report_counts_and_the_target_divides():
    desired, _ = eligible_demand_policy(_ctx(2, {"r0": 3.0, "r1": 4.0}, ongoing=2.0, target=2.0))
    assert desired == 2.0


def test_without_custom_metrics_serve_own_count_is_the_floor():
    desired, _ = eligible_demand_policy(_ctx(1, None, ongoing=2.0))
    assert desired == 2.0
    idle, _ = eligible_demand_policy(_ctx(3, {"r0": 0.0, "r1": 0.0, "r2": 0.0}))
    assert idle == 0.0  # Serve clamps to min_replicas after downscale_delay_s


def test_only_the_persistent_pool_uses_it_and_serve_accepts_the_config():
    persistent = persistent_pool_defaults().model_copy(update={"min_replicas": 1, "max_replicas": 4})
    opts = persistent.serve_options()
    assert opts["autoscaling_config"]["policy"] == {"policy_function": POLICY_PATH}
    parsed = serve_config.AutoscalingConfig(**opts["autoscaling_config"])  # imports and pickles the policy
    assert parsed.policy.get_policy()(_ctx(1, {"r0": 2.0}))[0] == 2.0
    standard = standard_pool_defaults().model_copy(update={"min_replicas": 1, "max_replicas": 4})
    assert "policy" not in standard.serve_options()["autoscaling_config"]

"""Spillover and bursts beyond capacity, over real HTTP against a small real app.

The app has one persistent replica (batch one) and one standard replica that
holds 2 requests with 2 more queued (Serve's ``max_ongoing_requests`` /
``max_queued_requests``), and a 0.3 s cap on spillover waits.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.deployments.conftest import (
    MODEL,
    assert_pages_returned,
    extra_app,
    pool_stats,
    wait_healthy,
)

pytestmark = pytest.mark.ray

SPILL_WAIT_S = 0.3
STANDARD_ONGOING, STANDARD_QUEUED = 2, 2
BURST_TOKENS = 100
"""Tokens of each burst request (the app's context is 256): with 32, admitted requests ended while the burst
still arrived on the CI machine and up to 6 of 8 were admitted. With 200, the two queued requests on a CI
machine at 0.3 s per step waited 62 s for the first two and then ran past the client's 120 s timeout."""
BURST_TIMEOUT_S = 600
"""Client timeout of the burst: the queued requests run after the admitted ones, at the machine's speed."""
ASK = [{"role": "user", "content": "Count from one to fifty in words."}]


@pytest.fixture(scope="module")
def tight(server, otlp):
    with extra_app(server, otlp, "tight", spillover_wait_s=SPILL_WAIT_S,
                   standard_pool={"max_ongoing_requests": STANDARD_ONGOING,
                                  "max_queued_requests": STANDARD_QUEUED}) as base:
        yield base


async def _chat(client: httpx.AsyncClient, base: str, timeout: float = 120, **body) -> httpx.Response:
    return await client.post(f"{base}/v1/chat/completions", timeout=timeout,
                             json={"model": MODEL, "messages": ASK, **body})


def test_busy_persistent_pool_spills_to_standard_at_once(tight, otlp):
    """Three greedy requests at once: the one persistent replica takes one, the others go standard at
    once (no estimate says it frees up soon) with reason ``persistent_capacity`` (span + counter)."""
    before = pool_stats(tight)["router"]["spillovers"]

    async def main():
        async with httpx.AsyncClient() as c:
            return await asyncio.gather(*(_chat(c, tight, temperature=0, max_tokens=48, ignore_eos=True)
                                          for _ in range(3)))

    responses = asyncio.run(main())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    lanes = sorted(r.headers["x-lane"] for r in responses)
    assert lanes == ["persistent", "standard", "standard"], lanes
    for r in responses:
        assert r.json()["usage"]["completion_tokens"] == 48
    assert pool_stats(tight)["router"]["spillovers"] - before == 2
    spilled = {r.json()["id"] for r in responses if r.headers["x-lane"] == "standard"}
    assert len(spilled) == 2
    spans = otlp.wait_for(lambda s: s.name == "fallback"
                          and s.attributes.get("fallback.reason") == "persistent_capacity", timeout=20)
    assert [s.attributes["waited_s"] for s in spans[-2:]] == [0.0, 0.0]  # not dispatched: no wait at all
    assert_pages_returned(tight)


def test_burst_of_twice_capacity_gets_503_with_retry_after(tight):
    """2x what the standard pool holds (ongoing + queued), all at once: the excess gets an
    OpenAI-style 503 with Retry-After, every accepted request completes, nothing crashes."""
    capacity = STANDARD_ONGOING + STANDARD_QUEUED
    # the previous test's requests end everywhere first (pages back), then a pause so that Serve's cached
    # per-replica queue lengths no longer count them (seen in CI without it: 2 of 4 admitted)
    assert_pages_returned(tight)
    time.sleep(2.0)
    engines_before = {e["placement_group_id"] for lane in ("standard", "persistent")
                      for e in pool_stats(tight)[lane]["engines"]}

    async def main():
        async with httpx.AsyncClient() as c:  # sampled: standard lane only; long enough that none of the
            # admitted requests ends (freeing a slot) while the burst is still arriving
            return await asyncio.gather(*(_chat(c, tight, BURST_TIMEOUT_S, temperature=0.9, seed=i,
                                                max_tokens=BURST_TOKENS, ignore_eos=True)
                                          for i in range(2 * capacity)))

    responses = asyncio.run(main())
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    assert {r.status_code for r in refused} <= {503}, [r.text for r in refused]
    # Serve assigns requests by its cached view of each replica's queue, which can still count a request of the
    # previous test that ended a moment ago, so one slot may look taken (seen once in CI: 3 of 4 admitted)
    assert len(ok) >= capacity - 1 and len(refused) >= 1, (len(ok), len(refused))
    for r in ok:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert err["code"] == "overloaded" and err["type"] == "server_error" and "retry" in err["message"]
    wait_healthy(tight)
    stats = assert_pages_returned(tight)
    assert stats["router"]["overloaded"] >= len(refused)
    engines_after = {e["placement_group_id"] for lane in ("standard", "persistent") for e in stats[lane]["engines"]}
    assert engines_after == engines_before  # no replica crashed or was replaced
    retry = httpx.post(f"{tight}/v1/chat/completions", timeout=120,
                       json={"model": MODEL, "messages": ASK, "temperature": 0.9, "max_tokens": 4})
    assert retry.status_code == 200  # retrying after the burst works

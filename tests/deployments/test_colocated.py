"""Co-located mode over real HTTP: one replica hosts both lanes over one copy of the weights and one page pool."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.deployments.conftest import (
    ASK,
    MODEL,
    assert_busy_persistent_lane_spills_at_once,
    assert_pages_returned,
    chat,
    extra_app,
)

pytestmark = pytest.mark.ray

@pytest.fixture(scope="module")
def colocated(server, otlp):
    with extra_app(server, otlp, "coloc", colocated=True) as base:
        yield base


def test_one_replica_serves_both_lanes_with_the_separate_replicas_tokens(colocated, server):
    """Greedy goes persistent, sampled standard, on the one co-located replica; a persistent and a forced
    standard greedy stream run at the same time and both give the separate-replica app's text; the one
    page pool is full again afterwards."""
    greedy = {"temperature": 0, "max_tokens": 40, "ignore_eos": True}
    seen: list[dict] = []

    async def watch(stop: asyncio.Event):
        async with httpx.AsyncClient() as c:
            while not stop.is_set():
                seen.append((await c.get(f"{colocated}/debug/stats", timeout=30)).json()["colocated"])
                await asyncio.sleep(0.05)

    async def main():
        async with httpx.AsyncClient() as c:
            reference = await chat(c, server, **greedy)  # the two-pool session app, persistent lane
            stop = asyncio.Event()
            watcher = asyncio.ensure_future(watch(stop))
            both = await asyncio.gather(chat(c, colocated, **greedy), chat(c, colocated, "standard", **greedy),
                                        chat(c, colocated, temperature=0.9, seed=1, max_tokens=16))
            stop.set()
            await watcher
            return reference, both

    reference, (persistent, standard, sampled) = asyncio.run(main())
    for r in (reference, persistent, standard, sampled):
        assert r.status_code == 200, r.text
    assert [r.headers["x-lane"] for r in (reference, persistent, standard, sampled)] == [
        "persistent", "persistent", "standard", "standard"]
    text = reference.json()["choices"][0]["message"]["content"]
    assert persistent.json()["choices"][0]["message"]["content"] == text
    assert standard.json()["choices"][0]["message"]["content"] == text
    stats = assert_pages_returned(colocated)
    assert "colocated" in stats and "standard" not in stats and stats["colocated"]["replicas"] == 1
    engine = stats["colocated"]["engines"][0]
    assert engine["settings"]["persistent_backend"] == "eager" and engine["settings"]["pipeline_quanta"] is False
    mixed = [s for s in seen if all(s["lanes"][lane]["kv_pages_in_use"] for lane in ("standard", "persistent"))]
    assert mixed, seen[-3:]  # both lanes held pages of the one pool at once
    m = mixed[0]
    assert m["lanes"]["standard"]["kv_pages_in_use"] + m["lanes"]["persistent"]["kv_pages_in_use"] == (
        m["kv_pages_total"] - m["kv_pages_free"])


def test_a_busy_colocated_persistent_lane_spills_at_once(colocated):
    assert_busy_persistent_lane_spills_at_once(colocated, ASK)


def test_what_each_lane_costs_the_other_on_one_replica(colocated):
    """Benchmark printout (no timing assertion): one persistent stream next to 2 standard ones."""
    from benchmarks.interference import format_result, measure

    result = measure(colocated, MODEL, standard_streams=2, prompt_len=64, max_tokens=24, rounds=1)
    print("\n" + format_result(result))
    for lane in ("persistent", "standard"):
        assert result[lane]["alone"]["lanes"] == [lane] and result[lane]["together"]["lanes"] == [lane]
        assert result[lane]["alone"]["failed"] == result[lane]["together"]["failed"] == 0
    assert_pages_returned(colocated)

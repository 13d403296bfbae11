"""A co-located EngineActor (no Ray): both lanes over one engine core, run in turn by the engine thread."""

from __future__ import annotations

import asyncio

import pytest

from replicas.config import EngineConfig
from replicas.engine_actor import EngineActor
from replicas.messages import GenerationChunk, Rejection
from replicas.request import SamplingParams
from tests.replicas.conftest import (
    MODEL,
    PROMPTS,
    TORCH_THREADS,
    chat_ids,
    greedy_request,
    tokens_of,
)

CONFIG = EngineConfig(model=MODEL, progress=False, max_model_len=1024, torch_threads=TORCH_THREADS)
TWENTY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=600, temperature=0.0, ignore_eos=True)


async def _collect(agen) -> list:
    return [item async for item in agen]


@pytest.fixture(scope="module")
def colocated():
    return EngineActor(CONFIG, lane="colocated", mode="auto", backend="eager")


def test_one_engine_serves_both_lanes_at_once_with_the_reference_tokens(colocated, tokenizer, hf_greedy):
    """A persistent request and two standard ones run together on one core: each gets the transformers
    greedy tokens, the persistent one in quanta, and every page is back afterwards."""
    ids = [chat_ids(tokenizer, p) for p in PROMPTS[:3]]
    seen: list[dict] = []

    async def watch(done: asyncio.Event):
        while not done.is_set():
            stats = await colocated.stats()
            seen.append(stats)
            if all(stats["lanes"][lane]["kv_pages_in_use"] for lane in ("standard", "persistent")):
                return
            await asyncio.sleep(0.005)

    async def scenario():
        done = asyncio.Event()
        persistent = _collect(colocated.generate(greedy_request("p", ids[0], TWENTY), lane="persistent"))
        standard = [_collect(colocated.generate(greedy_request(f"s{i}", x, TWENTY))) for i, x in enumerate(ids[1:])]
        watcher = asyncio.ensure_future(watch(done))
        results = await asyncio.gather(persistent, *standard)
        done.set()
        await watcher
        return results, await colocated.stats()

    (persistent, *standard), after = asyncio.run(scenario())
    assert all(isinstance(i, GenerationChunk) and i.lane == "persistent" for i in persistent)
    assert [len(i.token_ids) for i in persistent] == [1, 8, 8, 3]
    assert tokens_of(persistent) == hf_greedy(ids[0], 20, ignore_eos=True)
    for x, items in zip(ids[1:], standard, strict=True):
        assert all(i.lane == "standard" for i in items)
        assert tokens_of(items) == hf_greedy(x, 20, ignore_eos=True)
    both = [s for s in seen if all(s["lanes"][lane]["kv_pages_in_use"] for lane in ("standard", "persistent"))]
    assert both, seen[-1]  # seen mid-flight: each lane holding pages of the one pool, adding up exactly
    s = both[0]
    used = s["kv_pages_total"] - s["kv_pages_free"]
    assert s["lanes"]["standard"]["kv_pages_in_use"] + s["lanes"]["persistent"]["kv_pages_in_use"] == used
    assert after["kv_pages_free"] == after["kv_pages_total"]
    assert after["lanes"]["standard"]["kv_pages_in_use"] == after["lanes"]["persistent"]["kv_pages_in_use"] == 0
    assert after["running"] == after["waiting"] == 0 and after["lane"] == "colocated"


def test_a_busy_persistent_lane_rejects_at_once_while_the_standard_lane_keeps_serving(colocated, tokenizer, hf_greedy):
    ids = chat_ids(tokenizer, PROMPTS[3])

    async def scenario():
        first = colocated.generate(greedy_request("busy", ids, LONG), lane="persistent")
        head = await first.__anext__()
        second = await _collect(colocated.generate(greedy_request("busy-2", ids, TWENTY), lane="persistent"))
        standard = await _collect(colocated.generate(greedy_request("std", ids, TWENTY), lane="standard"))
        await first.aclose()
        for _ in range(400):  # the engine thread stops the abandoned request and frees its pages
            stats = await colocated.stats()
            if stats["running"] == 0 and stats["kv_pages_free"] == stats["kv_pages_total"]:
                break
            await asyncio.sleep(0.02)
        return head, second, standard, stats

    head, second, standard, stats = asyncio.run(scenario())
    assert isinstance(head, GenerationChunk) and len(head.token_ids) == 1
    assert len(second) == 1 and isinstance(second[0], Rejection) and second[0].reason == "queued_work"
    assert tokens_of(standard) == hf_greedy(ids, 20, ignore_eos=True)
    assert stats["running"] == 0 and stats["kv_pages_free"] == stats["kv_pages_total"], stats


def test_colocated_settings_and_lane_names(colocated):
    settings = asyncio.run(colocated.stats())["settings"]
    assert settings["persistent_backend"] == "eager" and settings["pipeline_quanta"] is False
    with pytest.raises(ValueError, match="lane must be"):
        asyncio.run(_collect(colocated.generate(greedy_request("x", [1, 2], TWENTY), lane="fast")))

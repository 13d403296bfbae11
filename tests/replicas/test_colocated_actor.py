"""A co-located EngineActor (no Ray): both lanes over one engine core, run in turn by the engine thread."""

from __future__ import annotations

import asyncio
import threading

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


@pytest.fixture(scope="module")
def favours_persistent():
    """A co-located engine whose policy runs up to 3 persistent steps between two standard steps."""
    config = CONFIG.model_copy(update={"colocated_persistent_steps": 3})
    return EngineActor(config, lane="colocated", mode="auto", backend="eager")


def _record_steps(actor, monkeypatch) -> list[tuple[str, bool]]:
    """Wrap the lanes' steps: each call recorded as (lane, whether the other lane held work then)."""
    order: list[tuple[str, bool]] = []
    standard_step, persistent_step = actor.engine.step, actor.persistent.step

    def standard():
        order.append(("standard", actor.persistent.has_unfinished()))
        return standard_step()

    def persistent():
        order.append(("persistent", actor.engine.has_unfinished()))
        return persistent_step()

    monkeypatch.setattr(actor.engine, "step", standard)
    monkeypatch.setattr(actor.persistent, "step", persistent)
    return order


def _longest_run(order: list[tuple[str, bool]], lane: str) -> int:
    """The most steps of ``lane`` in a row taken while the other lane held work."""
    best = run = 0
    for name, other_busy in order:
        run = run + 1 if name == lane and other_busy else 0
        best = max(best, run)
    return best


@pytest.mark.parametrize("fixture", ["colocated", "favours_persistent"])
def test_the_colocated_policy_bounds_what_each_lane_waits(fixture, request, tokenizer, monkeypatch):
    """While both lanes hold work, the engine loop runs one standard step, then at most
    ``colocated_persistent_steps`` persistent steps (each a prefill or one quantum), and again: a standard
    step waits for at most that many persistent steps, a persistent step for at most one standard step."""
    actor = request.getfixturevalue(fixture)
    bound = actor.core.config.colocated_persistent_steps
    order = _record_steps(actor, monkeypatch)
    ids = [chat_ids(tokenizer, p) for p in PROMPTS[:3]]
    sixty = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)

    async def scenario():
        standard = [_collect(actor.generate(greedy_request(f"s{i}", x, sixty))) for i, x in enumerate(ids[1:])]
        persistent = _collect(actor.generate(greedy_request("p", ids[0], sixty), lane="persistent"))
        return await asyncio.gather(persistent, *standard)

    persistent, *standard = asyncio.run(scenario())
    assert len(tokens_of(persistent)) == 60 and all(len(tokens_of(s)) == 60 for s in standard)
    assert _longest_run(order, "standard") == 1
    assert _longest_run(order, "persistent") == bound  # reached, never passed
    stats = asyncio.run(actor.stats())
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    assert stats["settings"]["colocated_persistent_steps"] == bound


def test_a_persistent_request_aborted_while_queued_in_the_inbox_never_runs(favours_persistent, tokenizer, monkeypatch):
    """The engine thread is held inside a standard step while a persistent request arrives and its caller goes
    away: its Add and Abort wait in the inbox, are applied in order (admitted, then dropped), the lane never
    steps it, and every page is back; the standard request finishes untouched."""
    actor = favours_persistent
    order = _record_steps(actor, monkeypatch)
    gate, entered = threading.Event(), threading.Event()
    recorded_standard = actor.engine.step

    def held():
        entered.set()
        gate.wait(30)
        return recorded_standard()

    monkeypatch.setattr(actor.engine, "step", held)
    ids = chat_ids(tokenizer, PROMPTS[4])

    async def scenario():
        standard = asyncio.ensure_future(_collect(actor.generate(greedy_request("s", ids, TWENTY))))
        while not entered.is_set():
            await asyncio.sleep(0.005)
        queued = asyncio.ensure_future(actor.generate(greedy_request("q", ids, TWENTY), lane="persistent").__anext__())
        await asyncio.sleep(0.05)
        queued.cancel()
        await asyncio.gather(queued, return_exceptions=True)
        gate.set()
        return await standard

    standard = asyncio.run(scenario())
    assert len(tokens_of(standard)) == 20
    assert all(name == "standard" for name, _ in order)  # the persistent lane never stepped "q"
    assert not actor.persistent.busy
    stats = asyncio.run(actor.stats())
    assert stats["kv_pages_free"] == stats["kv_pages_total"] and stats["running"] == 0

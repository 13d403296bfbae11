"""EngineActor as a plain class (no Ray): async streaming on both lanes, startup modes, abandonment."""

from __future__ import annotations

import asyncio
import time

import pytest

from replicas.config import EngineConfig
from replicas.engine_actor import EngineActor, PersistentDecoderLoadError
from replicas.messages import GenerationChunk, GenerationError, Rejection
from replicas.request import SamplingParams
from tests.replicas.conftest import (
    MODEL,
    PROMPTS,
    TORCH_THREADS,
    chat_ids,
    greedy_request,
    tokens_of,
)

CONFIG = EngineConfig(model=MODEL, progress=False, max_model_len=1536, torch_threads=TORCH_THREADS)
SIXTEEN = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=1400, temperature=0.0, ignore_eos=True)  # runs far longer than the tests wait


async def _collect(agen) -> list:
    return [item async for item in agen]


async def _abandon_after(actor: EngineActor, request, n: int, timeout_s: float = 8.0):
    """Read ``n`` items, walk away (break + aclose), then poll stats until the pages are back."""
    agen = actor.generate(request)
    got = []
    async for item in agen:
        got.append(item)
        if len(got) == n:
            break
    during = await actor.stats()
    await agen.aclose()
    deadline = time.monotonic() + timeout_s
    after = await actor.stats()
    while time.monotonic() < deadline and not (after["kv_pages_free"] == after["kv_pages_total"] and after["running"] == 0):
        await asyncio.sleep(0.05)
        after = await actor.stats()
    return got, during, after


@pytest.fixture(scope="module")
def standard_actor():
    return EngineActor(CONFIG, lane="standard")


@pytest.fixture(scope="module")
def persistent_actor():
    return EngineActor(CONFIG, lane="persistent", mode="auto", backend="eager")


def test_unknown_lane_is_refused_before_loading():
    with pytest.raises(ValueError, match="lane must be"):
        EngineActor(CONFIG, lane="fast")


def test_standard_actor_streams_greedy_tokens_for_concurrent_requests(standard_actor, tokenizer, hf_greedy):
    ids = [chat_ids(tokenizer, p) for p in PROMPTS[:3]]

    async def scenario():
        ready = await standard_actor.ready()
        results = await asyncio.gather(*(
            _collect(standard_actor.generate(greedy_request(f"s{i}", x, SIXTEEN))) for i, x in enumerate(ids)
        ))
        return ready, results, await standard_actor.stats()

    ready, results, stats = asyncio.run(scenario())
    # a step's items for the three streams reach their event loop in one hand-over, not one per token
    delivered = stats["deliveries"]["items"] - ready["deliveries"]["items"]
    assert delivered == 48
    assert stats["deliveries"]["handovers"] - ready["deliveries"]["handovers"] <= delivered // 2
    assert ready["lane"] == "standard" and ready["max_model_len"] == 1536 and ready["model"] == MODEL
    for x, items in zip(ids, results, strict=True):
        assert all(isinstance(i, GenerationChunk) and i.lane == "standard" for i in items)
        assert tokens_of(items) == hf_greedy(x, 16, ignore_eos=True)
        assert [i.finish_reason for i in items] == [None] * 15 + ["length"]
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    assert stats["running"] == stats["waiting"] == 0


def test_standard_actor_reports_an_invalid_prompt_as_an_error(standard_actor):
    items = asyncio.run(_collect(standard_actor.generate(greedy_request("empty", [], SIXTEEN))))
    assert len(items) == 1 and isinstance(items[0], GenerationError)
    assert (items[0].stage, items[0].reason, items[0].lane) == ("validation", "invalid_request", "standard")
    assert "empty" in items[0].message


def test_a_failed_engine_step_fails_every_request_the_engine_holds_and_the_replica_keeps_serving(
        standard_actor, tokenizer, hf_greedy):
    """An exception in a standard-lane step ends every request the engine holds (not only those in the
    step) with an ``engine_error``, frees their pages, and the next request is served. The fault is
    injected at the model runner's boundary for one call (nothing else is replaced)."""
    ids = [chat_ids(tokenizer, p) for p in PROMPTS[:2]]
    runner = standard_actor.core.runner
    real_execute = runner.execute
    calls = {"n": 0}

    def fail_third_step(batch, **kwargs):  # kwargs: input_tokens, with async scheduling
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected device fault")
        return real_execute(batch, **kwargs)

    async def scenario():
        runner.execute = fail_third_step
        try:
            failed = await asyncio.gather(*(
                _collect(standard_actor.generate(greedy_request(f"x{i}", x, LONG))) for i, x in enumerate(ids)))
        finally:
            runner.execute = real_execute
        after = await standard_actor.stats()
        served = await _collect(standard_actor.generate(greedy_request("after", ids[0], SIXTEEN)))
        return failed, after, served

    failed, after, served = asyncio.run(scenario())
    for items in failed:
        assert isinstance(items[-1], GenerationError) and items[-1].reason == "engine_error"
        assert "injected device fault" in items[-1].message and len(items) < LONG.max_tokens
    assert after["kv_pages_free"] == after["kv_pages_total"] and after["running"] == after["waiting"] == 0
    assert tokens_of(served) == hf_greedy(ids[0], 16, ignore_eos=True)


def test_actors_report_what_they_resolved_at_load(standard_actor, persistent_actor):
    standard = asyncio.run(standard_actor.stats())["settings"]
    persistent = asyncio.run(persistent_actor.stats())["settings"]
    assert standard["decode_kernels"] == "torch" and standard["pdl"] is False and standard["decode_graphs"] == []
    assert standard["load_format"] == "auto" and "moe_backend" not in standard  # a dense model: no MoE
    assert (persistent["persistent_backend"], persistent["pipeline_quanta"]) == ("eager", False)
    assert persistent["fused_greedy_epilogue"] is False


def test_actors_report_the_accelerator_they_see(standard_actor, monkeypatch):
    """Outside Ray on CPU: no Ray GPU ids and no CUDA device; ``CUDA_VISIBLE_DEVICES`` as the process has it
    (inside Ray it is the GPU share Ray assigned: tests/deployments/test_two_replicas.py)."""
    from replicas.engine_actor import device_facts

    facts = asyncio.run(standard_actor.stats())["accelerator"]
    # gpu_ids: None without Ray, [] once an earlier test in this process started Ray (no GPU either way)
    assert facts["gpu_ids"] in (None, [])
    assert (facts["cuda_device"], facts["cuda_device_name"], facts["cuda_device_uuid"]) == (None, None, None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert device_facts(standard_actor.core.runner.device)["cuda_visible_devices"] == "1"


def test_persistent_actor_streams_quanta(persistent_actor, tokenizer, hf_greedy):
    ids = chat_ids(tokenizer, PROMPTS[3])

    async def scenario():
        return await persistent_actor.ready(), await _collect(persistent_actor.generate(greedy_request("p", ids, SIXTEEN)))

    ready, items = asyncio.run(scenario())
    assert ready["lane"] == "persistent" and ready["decoder_healthy"] is True and ready["backend"] == "eager"
    assert all(isinstance(i, GenerationChunk) and i.lane == "persistent" for i in items)
    assert tokens_of(items) == hf_greedy(ids, 16, ignore_eos=True)
    assert [len(i.token_ids) for i in items] == [1, 8, 7]
    stats = asyncio.run(persistent_actor.stats())
    assert stats["kv_pages_free"] == stats["kv_pages_total"] and stats["running"] == 0


def test_persistent_actor_passes_a_rejection_through(persistent_actor, tokenizer):
    g = greedy_request("hot", chat_ids(tokenizer, PROMPTS[0]), SamplingParams(max_tokens=8, temperature=0.7))
    items = asyncio.run(_collect(persistent_actor.generate(g)))
    assert len(items) == 1 and isinstance(items[0], Rejection) and items[0].reason == "non_greedy"


def test_persistent_actor_runs_one_request_at_a_time(persistent_actor, tokenizer):
    ids = chat_ids(tokenizer, PROMPTS[2])

    async def scenario():
        first = persistent_actor.generate(greedy_request("busy-1", ids, LONG))
        head = await first.__anext__()  # the lane is now busy with the first request
        second = await _collect(persistent_actor.generate(greedy_request("busy-2", ids, SIXTEEN)))
        await first.aclose()
        deadline = time.monotonic() + 8.0  # wait (in this loop) for the worker to stop and free pages
        while (await persistent_actor.stats())["running"] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return head, second, await persistent_actor.stats()

    head, second, stats = asyncio.run(scenario())
    assert isinstance(head, GenerationChunk) and len(head.token_ids) == 1
    assert len(second) == 1 and isinstance(second[0], Rejection) and second[0].reason == "queued_work"
    assert stats["running"] == 0 and stats["kv_pages_free"] == stats["kv_pages_total"]


def test_the_load_record_holds_a_persistent_request_while_it_runs(persistent_actor, standard_actor, tokenizer):
    """``EngineActor.load``: the typed record the engine pushes to its pool board (docs/architecture.md,
    Spillover) names the persistent request while it runs, not after it ended, whether it finished or was
    abandoned; a standard engine's record has no persistent slot."""
    ids = chat_ids(tokenizer, PROMPTS[2])

    async def scenario():
        idle = await persistent_actor.load()
        stream = persistent_actor.generate(greedy_request("held", ids, LONG))
        await stream.__anext__()
        running = await persistent_actor.load()
        await stream.aclose()  # the client went away
        abandoned = await persistent_actor.load()
        deadline = time.monotonic() + 8.0
        while (await persistent_actor.stats())["running"] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await _collect(persistent_actor.generate(greedy_request("short", ids, SIXTEEN)))
        return idle, running, abandoned, await persistent_actor.load(), await standard_actor.load()

    idle, running, abandoned, finished, standard = asyncio.run(scenario())
    assert (idle.running, idle.capacity, idle.lane, idle.decoder_loaded) == (0, 1, "persistent", True)
    assert running.running == 1 and running.request_ids == ("held",) and running.decoder_healthy
    assert abandoned.running == 0 and finished.running == 0 and finished.request_ids == ()
    assert idle.seq < running.seq < abandoned.seq < finished.seq and idle.started_at == finished.started_at
    assert standard.capacity == 0 and standard.lane == "standard" and standard.standard_idle


def test_abandoned_standard_stream_frees_its_pages(standard_actor, tokenizer):
    g = greedy_request("gone", chat_ids(tokenizer, PROMPTS[1]), LONG)
    got, during, after = asyncio.run(_abandon_after(standard_actor, g, 2))
    assert len(got) == 2 and all(isinstance(i, GenerationChunk) and i.finish_reason is None for i in got)
    assert during["kv_pages_free"] < during["kv_pages_total"]  # the request held pages while streaming
    assert after["kv_pages_free"] == after["kv_pages_total"], after
    assert after["running"] == after["waiting"] == 0


def test_abandoned_persistent_stream_frees_its_pages(persistent_actor, tokenizer):
    g = greedy_request("gone-p", chat_ids(tokenizer, PROMPTS[1]), LONG)
    got, during, after = asyncio.run(_abandon_after(persistent_actor, g, 2))
    assert [len(i.token_ids) for i in got] == [1, 8]
    assert during["kv_pages_free"] < during["kv_pages_total"]
    assert after["kv_pages_free"] == after["kv_pages_total"], after
    assert after["running"] == 0 and after["decoder_healthy"] is True


def test_required_mode_with_a_missing_checkpoint_refuses_to_start(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    with pytest.raises(PersistentDecoderLoadError) as exc:
        EngineActor(CONFIG, lane="persistent", mode="required", backend="eager", checkpoint=str(missing))
    assert str(missing) in str(exc.value)
    assert "required" in str(exc.value)


@pytest.fixture(scope="module")
def missing_checkpoint(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt") / "missing"


def test_auto_mode_with_a_missing_checkpoint_rejects_every_request(missing_checkpoint, tokenizer):
    """auto: the replica starts; its lane is unhealthy and rejects with ``unsupported_envelope``
    (the router then falls back), the rejection's detail naming the checkpoint problem."""
    actor = EngineActor(CONFIG, lane="persistent", mode="auto", backend="eager", checkpoint=str(missing_checkpoint))
    stats = asyncio.run(actor.stats())
    assert stats["decoder_healthy"] is False and stats["backend"] is None
    assert stats["unhealthy_reason"].startswith("checkpoint_invalid")
    g = greedy_request("x", chat_ids(tokenizer, PROMPTS[0]), SIXTEEN)
    items = asyncio.run(_collect(actor.generate(g)))
    assert len(items) == 1 and isinstance(items[0], Rejection), items
    rejection = items[0]
    assert (rejection.reason, rejection.lane, rejection.stage) == ("unsupported_envelope", "persistent", "prelaunch")
    assert rejection.detail.startswith("checkpoint_invalid") and str(missing_checkpoint) in rejection.detail
    # request-level reasons still come first
    hot = greedy_request("hot", g.prompt_token_ids, SamplingParams(max_tokens=8, temperature=0.7))
    assert [i.reason for i in asyncio.run(_collect(actor.generate(hot)))] == ["non_greedy"]
    stats = asyncio.run(actor.stats())
    assert stats["kv_pages_free"] == stats["kv_pages_total"] and stats["quanta_run"] == 0

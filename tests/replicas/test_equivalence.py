"""Greedy equivalence: both lanes produce transformers' ``generate(do_sample=False)`` tokens.

The standard lane (continuous batching, all prompts in one engine and each
alone) and the persistent lane (eager backend, quanta of <= 8 tokens) are
checked token-for-token against the transformers reference on five chat
prompts, with EOS ignored (fixed 40 tokens) and with EOS stopping.
"""

from __future__ import annotations

import pytest

from replicas.engine import LLMEngine
from replicas.output_processor import texts_of
from replicas.persistent.eager import EagerBackend
from replicas.persistent.lane import PersistentLane
from replicas.request import SamplingParams
from tests.replicas.conftest import (
    GREEDY,
    PROMPTS,
    chat_ids,
    greedy_request,
    run_standard,
    text_of,
    tokens_of,
)

EOS_STOPPING = SamplingParams(max_tokens=40, temperature=0.0)
MODES = {"ignore_eos": GREEDY, "eos_stopping": EOS_STOPPING}


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [chat_ids(tokenizer, p) for p in PROMPTS]


@pytest.fixture(scope="module")
def references(prompt_ids, hf_greedy) -> dict[str, list[list[int]]]:
    """transformers' greedy continuations per mode, one list per prompt."""
    return {
        "ignore_eos": [hf_greedy(ids, 40, ignore_eos=True) for ids in prompt_ids],
        "eos_stopping": [hf_greedy(ids, 40, ignore_eos=False) for ids in prompt_ids],
    }


def test_references_cover_both_stop_modes(references, core):
    """The prompt set exercises 40-token runs and at least one early EOS stop (else the EOS test is vacuous)."""
    assert all(len(r) == 40 for r in references["ignore_eos"])
    eos = core.eos_token_ids
    stopped = [r for r in references["eos_stopping"] if len(r) < 40]
    assert stopped, "no prompt stops at EOS within 40 tokens"
    assert all(r[-1] in eos for r in stopped)
    # with EOS ignored the model keeps going past the point where it would stop
    for full, short in zip(references["ignore_eos"], references["eos_stopping"], strict=True):
        assert full[: len(short)] == short


def _check_finish(chunks, expected: list[int], eos: frozenset[int]) -> None:
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].finish_reason == ("stop" if expected[-1] in eos and len(expected) < 40 else "length")
    assert chunks[-1].num_output_tokens == len(expected)


@pytest.mark.parametrize("mode", list(MODES))
def test_standard_lane_batched_matches_transformers(core, tokenizer, prompt_ids, references, mode):
    engine = LLMEngine(core)
    reqs = {f"r{i}": (ids, MODES[mode]) for i, ids in enumerate(prompt_ids)}
    for rid, (ids, params) in reqs.items():
        engine.add_request(rid, ids, params)
    first = engine.step()
    assert len(first) == len(PROMPTS), "all prompts should prefill together in one batch"
    assert engine.stats()["running"] == len(PROMPTS)
    rest = run_standard(engine, {})
    for i, ids in enumerate(prompt_ids):
        chunks = texts_of([c for c in first if c.request_id == f"r{i}"] + rest.get(f"r{i}", []), tokenizer,
                          MODES[mode])
        assert tokens_of(chunks) == references[mode][i], f"prompt {i} ({PROMPTS[i]!r})"
        assert all(c.lane == "standard" and len(c.token_ids) == 1 for c in chunks)
        assert chunks[-1].num_prompt_tokens == len(ids)
        _check_finish(chunks, references[mode][i], core.eos_token_ids)
        assert text_of(chunks) == tokenizer.decode(references[mode][i], skip_special_tokens=True)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_standard_lane_alone_matches_transformers(core, prompt_ids, references, mode, index):
    engine = LLMEngine(core)
    chunks = run_standard(engine, {"alone": (prompt_ids[index], MODES[mode])})["alone"]
    assert tokens_of(chunks) == references[mode][index]
    _check_finish(chunks, references[mode][index], core.eos_token_ids)


def _quantum_sizes_ok(sizes: list[int], total: int) -> bool:
    """First token alone, then full quanta of 8, then the remainder (1..8)."""
    return sizes[0] == 1 and all(s == 8 for s in sizes[1:-1]) and 1 <= sizes[-1] <= 8 and sum(sizes) == total


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_persistent_lane_matches_transformers(core, tokenizer, prompt_ids, references, mode, index):
    lane = PersistentLane(core, EagerBackend(core.model, core.runner.device))
    items = list(lane.generate(greedy_request(f"p{index}", prompt_ids[index], MODES[mode])))
    expected = references[mode][index]
    assert all(type(i).__name__ == "GenerationChunk" for i in items), items
    assert tokens_of(items) == expected
    sizes = [len(c.token_ids) for c in items]
    if mode == "ignore_eos":
        assert sizes == [1, 8, 8, 8, 8, 7]
    else:
        assert _quantum_sizes_ok(sizes, len(expected)), sizes
    assert all(c.lane == "persistent" and c.fallback_reason is None for c in items)
    _check_finish(items, expected, core.eos_token_ids)
    assert text_of(items) == tokenizer.decode(expected, skip_special_tokens=True)
    assert lane.healthy and lane.quanta_run == len(items) - 1


def test_persistent_lane_quantum_sizes_follow_max_tokens(core, prompt_ids, references):
    """max_tokens=20: 1 + 8 + 8 + 3; the last quantum is clipped to the tokens left."""
    lane = PersistentLane(core, EagerBackend(core.model, core.runner.device))
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    items = list(lane.generate(greedy_request("q", prompt_ids[1], params)))
    assert [len(c.token_ids) for c in items] == [1, 8, 8, 3]
    assert tokens_of(items) == references["ignore_eos"][1][:20]
    assert items[-1].finish_reason == "length"


def test_warm_up_leaves_the_engine_as_it_found_it(core, prompt_ids, references):
    """``LLMEngine.warm_up`` (the engine actor runs it at load on a GPU; here on CPU, small): its throwaway
    requests end, every page is back (the autouse check), and a request after it gets the reference tokens.
    It refuses an engine that holds requests."""
    engine = LLMEngine(core)
    done = engine.warm_up(lengths=(16, 40), batch=3, batch_len=24, new_tokens=2)
    assert done["prompts"] == 2 + 3 and done["graphs_failed"] == [] and not engine.has_unfinished()
    mode = next(iter(MODES))
    chunks = run_standard(engine, {"after": (prompt_ids[0], MODES[mode])})["after"]
    assert tokens_of(chunks) == references[mode][0]
    engine.add_request("busy", prompt_ids[0], MODES[mode])
    with pytest.raises(RuntimeError, match="idle"):
        engine.warm_up()
    engine.abort("busy")

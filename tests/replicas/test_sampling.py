"""Sampling, stop rules and incremental detokenization on the standard lane (real model)."""

from __future__ import annotations

import math

import pytest
import torch

from replicas.detokenizer import IncrementalDetokenizer
from replicas.engine import LLMEngine
from replicas.request import Request, SamplingParams
from replicas.sampler import _filter_top_k_top_p, make_generator, sample
from tests.replicas.conftest import PROMPTS, chat_ids, run_standard, text_of, tokens_of

N = 12  # tokens per sampled run


@pytest.fixture(scope="module")
def haiku_ids(tokenizer) -> list[int]:
    """A prompt with a long, open-ended answer (sampling has room to differ)."""
    return chat_ids(tokenizer, PROMPTS[1])


def _run(core, ids, **params) -> list:
    return run_standard(LLMEngine(core), {"r": (ids, SamplingParams(**params))})["r"]


def _run_many(core, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    return {rid: tokens_of(ch) for rid, ch in run_standard(LLMEngine(core), requests).items()}


@pytest.fixture(scope="module")
def greedy_haiku(core, haiku_ids) -> list[int]:
    out = tokens_of(_run(core, haiku_ids, max_tokens=N, temperature=0.0, ignore_eos=True))
    assert len(out) == N
    return out


def test_top_k_1_at_temperature_1_is_greedy(core, haiku_ids, greedy_haiku):
    assert tokens_of(_run(core, haiku_ids, max_tokens=N, temperature=1.0, top_k=1, seed=3, ignore_eos=True)) == greedy_haiku


def test_tiny_top_p_is_greedy(core, haiku_ids, greedy_haiku):
    """top_p=1e-6 keeps only the most likely token, through the sampling path (not the greedy shortcut)."""
    params = SamplingParams(max_tokens=N, temperature=1.0, top_p=1e-6, seed=5, ignore_eos=True)
    assert not params.is_greedy
    out = _run_many(core, {f"s{i}": (haiku_ids, params) for i in range(2)})
    assert out["s0"] == out["s1"] == greedy_haiku


def test_same_seed_same_output_different_seeds_differ(core, haiku_ids, greedy_haiku):
    def params(seed):
        return SamplingParams(max_tokens=N, temperature=1.0, seed=seed, ignore_eos=True)

    batch = _run_many(core, {f"seed{s}": (haiku_ids, params(s)) for s in (11, 12, 13, 14)})
    again = tokens_of(_run(core, haiku_ids, max_tokens=N, temperature=1.0, seed=11, ignore_eos=True))
    assert again == batch["seed11"], "the same seed must give the same tokens (alone or batched)"
    assert len({tuple(v) for v in batch.values()}) >= 2, "four different seeds all gave the same tokens"
    assert any(v != greedy_haiku for v in batch.values()), "temperature sampling never left the greedy path"


def test_high_temperature_differs_from_greedy(core, haiku_ids, greedy_haiku):
    out = _run_many(core, {
        f"t{s}": (haiku_ids, SamplingParams(max_tokens=N, temperature=1.5, seed=s, ignore_eos=True)) for s in (1, 2)
    })
    assert all(v != greedy_haiku for v in out.values())


def test_top_k_restricts_every_token_to_the_k_best(core, haiku_ids):
    """With top_k=2 at a high temperature every sampled token is one of the two most likely at its step."""
    out = tokens_of(_run(core, haiku_ids, max_tokens=6, temperature=5.0, top_k=2, seed=0, ignore_eos=True))
    assert len(set(out)) > 1
    for step, tok in enumerate(out):  # replay each prefix through the model to find that step's top-2
        r = Request(f"replay{step}", haiku_ids + out[:step], SamplingParams(max_tokens=1, temperature=0.0))
        core.allocator.grow(r.block_table, r.num_tokens)
        try:
            logits = core.runner.execute([(r, r.num_tokens)])[0]
        finally:
            core.allocator.release(r.block_table)
        assert tok in torch.topk(logits, 2).indices.tolist(), f"step {step}: {tok} not in the top-2"


# --- stop rules -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def greedy_texts(core, tokenizer) -> dict[int, tuple[list[int], str]]:
    out = {}
    for i in (0, 1):
        ch = _run(core, chat_ids(tokenizer, PROMPTS[i]), max_tokens=24, temperature=0.0, ignore_eos=True)
        out[i] = (tokens_of(ch), text_of(ch))
    return out


@pytest.mark.parametrize(
    ("prompt", "stop"),
    [
        (0, ("Paris",)),  # one token
        (1, ("e lapp",)),  # spans tokens " gentle" and " lapping"
        (1, ("shore", "sea,")),  # two stop strings: the earliest match wins
    ],
)
def test_stop_strings_cut_the_text_and_finish_with_stop(core, tokenizer, greedy_texts, prompt, stop):
    greedy_tokens, greedy_text = greedy_texts[prompt]
    first = min(greedy_text.index(s) for s in stop if s in greedy_text)
    chunks = _run(core, chat_ids(tokenizer, PROMPTS[prompt]), max_tokens=24, temperature=0.0, stop=stop)
    text = text_of(chunks)
    assert chunks[-1].finish_reason == "stop"
    assert text == greedy_text[:first]
    assert not any(s in text for s in stop)
    assert not any(s in c.text for c in chunks for s in stop)
    out = tokens_of(chunks)
    # generation ends on the token that completes the stop string
    assert out == greedy_tokens[: len(out)]
    assert any(s in tokenizer.decode(out) for s in stop)
    assert not any(s in tokenizer.decode(out[:-1]) for s in stop)


def test_stop_token_ids_end_generation_kept_in_the_ids_not_in_the_text(core, tokenizer, greedy_texts):
    """As vLLM: the stop token is the last output id (and counted), its text is left out unless
    ``include_stop_str_in_output``."""
    greedy_tokens, _ = greedy_texts[1]
    stop_id = greedy_tokens[3]
    assert tokenizer.decode([stop_id]).strip(), "the stop token must have visible text for this test"
    cut = greedy_tokens.index(stop_id) + 1
    for include in (False, True):
        chunks = _run(core, chat_ids(tokenizer, PROMPTS[1]), max_tokens=24, temperature=0.0,
                      stop_token_ids=(stop_id,), include_stop_str_in_output=include)
        assert tokens_of(chunks) == greedy_tokens[:cut] and chunks[-1].num_output_tokens == cut
        assert chunks[-1].finish_reason == "stop"
        shown = greedy_tokens[:cut] if include else greedy_tokens[: cut - 1]
        assert text_of(chunks) == tokenizer.decode(shown, skip_special_tokens=True)


def test_include_stop_str_in_output_keeps_the_stop_string(core, tokenizer, greedy_texts):
    greedy_tokens, greedy_text = greedy_texts[1]
    stop = "e lapp"  # spans two tokens; the text ends right after it
    chunks = _run(core, chat_ids(tokenizer, PROMPTS[1]), max_tokens=24, temperature=0.0, stop=(stop,),
                  include_stop_str_in_output=True)
    assert chunks[-1].finish_reason == "stop"
    assert text_of(chunks) == greedy_text[: greedy_text.index(stop) + len(stop)]


def test_max_tokens_finishes_with_length(core, tokenizer, greedy_texts):
    greedy_tokens, _ = greedy_texts[1]
    chunks = _run(core, chat_ids(tokenizer, PROMPTS[1]), max_tokens=5, temperature=0.0)
    assert tokens_of(chunks) == greedy_tokens[:5]
    assert [c.finish_reason for c in chunks] == [None] * 4 + ["length"]
    assert chunks[-1].num_output_tokens == 5


def test_context_limit_finishes_with_length(core, tokenizer, greedy_texts):
    """Prompt + output never pass max_model_len: the request ends with "length" there."""
    from tests.replicas.conftest import small_core

    ids = chat_ids(tokenizer, PROMPTS[1])
    limit = len(ids) + 3
    tiny = small_core(core, num_kv_blocks=8, max_model_len=limit)
    chunks = run_standard(LLMEngine(tiny), {"r": (ids, SamplingParams(max_tokens=50, temperature=0.0))})["r"]
    assert tokens_of(chunks) == greedy_texts[1][0][:3]
    assert chunks[-1].finish_reason == "length"
    assert tiny.allocator.num_free == tiny.allocator.num_blocks


# --- sampler unit tests -------------------------------------------------------------------


def _probs(values):
    return torch.tensor([math.log(v) for v in values], dtype=torch.float32)


def test_filter_top_k_keeps_the_k_largest():
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0])
    out = _filter_top_k_top_p(logits, 2, 1.0)
    assert out.tolist() == [float("-inf"), 4.0, 3.0, float("-inf")]
    assert logits.tolist() == [1.0, 4.0, 3.0, 2.0]  # input untouched


@pytest.mark.parametrize("top_k", [None, 0, 4, 10])
def test_filter_top_k_disabled_or_not_smaller_than_vocab(top_k):
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0])
    assert torch.equal(_filter_top_k_top_p(logits, top_k, 1.0), logits)


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        (1e-6, {2}),  # only the most likely token
        (0.45, {2}),  # 0.5 alone reaches 0.45
        (5e-324, {2}),  # a p that is 0 in float32 (schemathesis sent it): the top token stays, no NaN
        (0.7, {2, 0}),  # 0.5 < 0.7: also the next (0.3)
        (0.9, {2, 0, 3}),  # 0.8 < 0.9: also 0.15
        (0.99, {0, 1, 2, 3}),
    ],
)
def test_filter_top_p_keeps_the_nucleus(top_p, kept):
    logits = _probs([0.3, 0.05, 0.5, 0.15])  # order scrambled on purpose
    out = _filter_top_k_top_p(logits, None, top_p)
    assert {i for i, v in enumerate(out.tolist()) if v != float("-inf")} == kept
    for i in kept:  # kept logits are unchanged and in their original places
        assert out[i].item() == pytest.approx(logits[i].item())


def test_filter_top_k_then_top_p_renormalises_over_the_k_kept():
    logits = _probs([0.3, 0.05, 0.5, 0.15])
    # top_k=2 keeps {2: 0.5, 0: 0.3} -> renormalised 0.625 / 0.375; top_p=0.6 keeps only the first
    out = _filter_top_k_top_p(logits, 2, 0.6)
    assert {i for i, v in enumerate(out.tolist()) if v != float("-inf")} == {2}
    out = _filter_top_k_top_p(logits, 2, 0.7)
    assert {i for i, v in enumerate(out.tolist()) if v != float("-inf")} == {2, 0}


def test_sample_rows_follow_their_own_params():
    logits = torch.stack([_probs([0.1, 0.2, 0.7]), _probs([0.6, 0.3, 0.1]), _probs([0.2, 0.5, 0.3])])
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6, seed=1),
    ]
    gens = [make_generator(p) for p in params]
    assert gens[0] is None and gens[1] is None and gens[2] is not None  # greedy rows never use an RNG
    assert sample(logits, params, gens) == [2, 0, 1]


def test_seeded_generators_reproduce_and_unseeded_are_none():
    p = SamplingParams(temperature=1.0, seed=42)
    logits = torch.zeros(1, 1000)
    a = [sample(logits, [p], [g])[0] for g in [make_generator(p)] for _ in range(5)]
    b = [sample(logits, [p], [g])[0] for g in [make_generator(p)] for _ in range(5)]
    assert a == b and len(set(a)) > 1
    assert make_generator(SamplingParams(temperature=1.0)) is None


# --- incremental detokenizer --------------------------------------------------------------


def _stream(tokenizer, ids, stop=(), final_at_end=False):
    d = IncrementalDetokenizer(tokenizer, stop)
    deltas = [d.append([t], final=final_at_end and i == len(ids) - 1) for i, t in enumerate(ids)]
    return d, deltas


def test_detokenizer_stop_string_split_across_tokens(tokenizer):
    ids = tokenizer.encode("Hello world, this is a test", add_special_tokens=False)
    assert tokenizer.decode(ids[:1]) == "Hello" and tokenizer.decode(ids[1:2]) == " world"
    d, deltas = _stream(tokenizer, ids, stop=("o wor",))
    assert "".join(deltas) == "Hell" == d.text
    assert d.stopped_on == "o wor"
    assert all("o wor" not in x for x in deltas)
    assert deltas[2:] == [""] * (len(ids) - 2)  # nothing after the stop
    assert d.append(tokenizer.encode(" more", add_special_tokens=False), final=True) == ""


def test_detokenizer_without_stops_streams_the_full_text(tokenizer, greedy_texts):
    tokens, text = greedy_texts[1]
    d, deltas = _stream(tokenizer, tokens)
    assert "".join(deltas) == text == tokenizer.decode(tokens, skip_special_tokens=True)
    assert all(len(x) > 0 for x in deltas[:3])  # no stop strings: nothing is held back


def test_detokenizer_holds_back_a_possible_stop_prefix_until_final(tokenizer):
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, ("ldX",))
    first = d.append(ids)
    assert first == "Hello wor"  # "ld" could still be the start of "ldX"
    assert d.append([], final=True) == "ld"
    assert d.stopped_on is None and d.text == "Hello world"


def test_detokenizer_never_emits_half_a_character(tokenizer):
    hello = tokenizer.encode("Hello", add_special_tokens=False)
    c3, a9 = tokenizer.convert_tokens_to_ids(["Ã", "©"])  # the two UTF-8 bytes of "é"
    assert tokenizer.decode([c3, a9]) == "é"
    d, deltas = _stream(tokenizer, hello + [c3, a9])
    assert all("\ufffd" not in x for x in deltas)
    assert deltas[-2] == "" and deltas[-1] == "é"
    assert "".join(deltas) == "Helloé"


def test_detokenizer_stop_string_before_a_split_multibyte_character(tokenizer):
    abc = tokenizer.encode("Hello abc", add_special_tokens=False)
    c3, a9 = tokenizer.convert_tokens_to_ids(["Ã", "©"])
    whole = IncrementalDetokenizer(tokenizer, ("cé",))
    assert whole.append(abc + [c3, a9]) == "Hello ab"  # all at once: correct
    d, deltas = _stream(tokenizer, abc + [c3, a9], stop=("cé",))
    assert d.stopped_on == "cé"
    assert "".join(deltas) == "Hello ab"  # streamed: "Hello abc" (the "c" of the stop leaks)


def test_sample_rows_calls_before_read_once_after_queueing_the_picks(monkeypatch):
    """The engine's blocking wait (``EngineConfig.blocking_sync``) runs once per step, after every pick is queued
    (greedy and sampled rows alike) and before the ids are read; the picks are the same with or without it."""
    import replicas.sampler as sampler
    from replicas.sampler import SamplingRow, sample_rows

    order = []
    pick, logprobs = sampler._process_and_pick, sampler._logprobs
    monkeypatch.setattr(sampler, "_process_and_pick", lambda *a: (order.append("pick"), pick(*a))[1])
    monkeypatch.setattr(sampler, "_logprobs", lambda *a: (order.append("read"), logprobs(*a))[1])
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    sampled = SamplingParams(temperature=0.8, seed=3)
    rows = [SamplingRow(SamplingParams(temperature=0.0), None, [1], []),
            SamplingRow(sampled, make_generator(sampled), [1], []),
            SamplingRow(SamplingParams(temperature=0.0), None, [2], [])]
    calls = []
    got = sample_rows(logits, rows, before_read=lambda: (calls.append(1), order.append("wait")))
    assert order == ["pick", "wait", "read"]
    rows[1] = SamplingRow(sampled, make_generator(sampled), [1], [])
    assert calls == [1]
    assert got.token_ids == sample_rows(logits, rows).token_ids
    assert got.token_ids[0] == int(logits[0].argmax()) and got.token_ids[2] == int(logits[2].argmax())

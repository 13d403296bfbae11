"""Stop strings on the persistent lane: the same tokens and text as the standard lane.

The persistent lane sends a whole quantum of tokens at once, the standard lane
one token per step; the reader of either stream (``replicas.output_processor``)
makes the text and cuts the output at the token that completes a stop string,
dropping the rest of the quantum, and ends the stream (the engine aborts the
request). These tests put a stop string's end at every position of a quantum
and check, against the standard lane (continuous batching, one token per step):

* reader level: the greedy tokens given to the output processor a quantum at a
  time give the same tokens, text and finish as given one at a time, for stops
  that end at every token, that span two tokens, that overlap text already
  emitted, with several stops, and with ``include_stop_str_in_output``;
* end to end: both persistent backends (``eager``; ``cuda_graph``'s static
  body on CPU, which launches each quantum behind the one being read, so a cut
  quantum has a follower in flight that must be discarded) give the standard
  lane's tokens, text, finish reason and usage, and every KV page comes back.
"""

from __future__ import annotations

import pytest

from replicas.engine import LLMEngine
from replicas.messages import GenerateRequest, GenerationChunk
from replicas.output_processor import OutputProcessor
from replicas.persistent.cuda_graph import CudaGraphBackend
from replicas.persistent.eager import EagerBackend
from replicas.persistent.lane import PersistentLane
from replicas.request import SamplingParams
from tests.replicas.conftest import assert_pool_full, run_standard, text_of, tokens_of

LENGTH = 24
"""Greedy tokens per reference continuation: the prefill token and nearly three quanta of 8."""
QUANTUM = 8


RAW_PROMPTS = ("Once upon a time", "The capital of France is", "Here is a list of colors:", "def fibonacci(n):")
"""Plain-text prompts (short prefills) whose greedy continuations mix words, digits, code and whitespace."""


@pytest.fixture(scope="module")
def references(core, tokenizer) -> list[tuple[list[int], list[int]]]:
    """``(prompt ids, standard-lane greedy tokens)`` per raw prompt (EOS ignored, LENGTH tokens)."""
    prompts = [list(tokenizer.encode(p)) for p in RAW_PROMPTS]
    params = SamplingParams(max_tokens=LENGTH, temperature=0.0, ignore_eos=True)
    out = run_standard(LLMEngine(core), {f"r{i}": (ids, params) for i, ids in enumerate(prompts)})
    return [(ids, tokens_of(out[f"r{i}"])) for i, ids in enumerate(prompts)]


def _prefix_texts(tokenizer, tokens: list[int]) -> list[str]:
    """``texts[j]`` = the decoded text of the first ``j`` tokens."""
    return [tokenizer.decode(tokens[:j], skip_special_tokens=True) for j in range(len(tokens) + 1)]


def stops_ending_at(texts: list[str], k: int) -> list[str]:
    """Stop strings whose first match is completed by token ``k`` (0-based), in several shapes: the new text's
    tail, one that reaches back into the previous token's text, and the longest new suffix; deduplicated."""
    before, after = texts[k], texts[k + 1]
    if len(after) <= len(before) or not after.startswith(before):
        return []
    new = after[len(before):]
    shapes = [new[-1:], new[-2:], after[max(0, len(before) - 3): len(before) + 1], new]
    return [s for s in dict.fromkeys(shapes) if s and s not in before]


def _host_run(core, tokenizer, tokens: list[int], params: SamplingParams, chunks: list[int]):
    """Feed ``tokens`` to an :class:`OutputProcessor` in chunks of the given sizes, as the engines send them (one
    token per standard step, a quantum per persistent step); return (tokens, text, finish)."""
    processor = OutputProcessor(tokenizer, params)
    out, text, finish, at = [], "", None, 0
    for size in chunks:
        part = tokens[at: at + size]
        at += size
        chunk = processor.process(GenerationChunk("h", part, finish_reason="length" if at >= len(tokens) else None,
                                                  num_output_tokens=at))
        out += chunk.token_ids
        text += chunk.text
        finish = chunk.finish_reason
        if finish is not None:
            break
    return out, text, finish


@pytest.mark.parametrize("include", [False, True], ids=["cut", "include_stop_str"])
def test_stop_strings_per_quantum_equal_per_token(core, tokenizer, references, include):
    """Every stop end position 0..23 (the prefill token, then quanta of 8: every offset inside a quantum),
    several stop shapes, each alone and together with a stop that never matches."""
    cases = 0
    for _, tokens in references:
        texts = _prefix_texts(tokenizer, tokens)
        for k in range(len(tokens)):
            for stop in stops_ending_at(texts, k):
                for stops in ((stop,), ("\x00never", stop)):
                    params = SamplingParams(max_tokens=LENGTH, temperature=0.0, ignore_eos=True, stop=stops,
                                            include_stop_str_in_output=include)
                    one = _host_run(core, tokenizer, tokens, params, [1] * LENGTH)
                    quanta = _host_run(core, tokenizer, tokens, params, [1] + [QUANTUM] * 3)
                    assert quanta == one, (k, stops)
                    out, text, finish = one
                    assert out == tokens[: k + 1] and finish == "stop", (k, stops)
                    cut = texts[k + 1].index(stop) + (len(stop) if include else 0)
                    assert text == texts[k + 1][:cut]
                    cases += 1
    assert cases >= 250  # the shapes really exist at (nearly) every position


def test_text_without_stop_strings_per_quantum_equals_per_token(core, tokenizer, references):
    """No stop strings: a quantum is detokenized in one call; the text still equals the per-token text."""
    for _, tokens in references:
        params = SamplingParams(max_tokens=LENGTH, temperature=0.0, ignore_eos=True)
        assert _host_run(core, tokenizer, tokens, params, [1] + [QUANTUM] * 3) == \
            _host_run(core, tokenizer, tokens, params, [1] * LENGTH)


def _lanes(core):
    return {
        "eager": PersistentLane(core, EagerBackend(core.model, core.runner.device)),
        "cuda_graph": PersistentLane(core, CudaGraphBackend(core.model, core.runner.device, core.config.max_model_len)),
    }


LANE_LENGTH = 1 + QUANTUM + 3
"""End to end: the prefill token, one full quantum and part of a second."""


@pytest.fixture(scope="module")
def lane_cases(tokenizer, references) -> list[tuple[list[int], tuple[str, ...]]]:
    """(prompt, stops) with the stop completed by the prefill token, by each position of the first quantum, at
    the first position of the second, and never (the request ends at max_tokens)."""
    ids, tokens = references[0]
    texts = _prefix_texts(tokenizer, tokens)
    cases = []
    for k in range(QUANTUM + 2):
        shapes = stops_ending_at(texts, k)
        assert shapes, f"no stop string ends at token {k}"
        cases.append((ids, (shapes[-1], "\x00never")))
    cases.append((ids, ("\x00never",)))
    return cases


def test_both_lanes_give_identical_tokens_and_text_with_stop_strings(core, lane_cases):
    params = [SamplingParams(max_tokens=LANE_LENGTH, temperature=0.0, ignore_eos=True, stop=stops)
              for _, stops in lane_cases]
    standard = run_standard(LLMEngine(core), {f"s{i}": (ids, p) for i, ((ids, _), p)
                                              in enumerate(zip(lane_cases, params, strict=True))})
    lanes = _lanes(core)
    # cuda_graph (pipelined: a cut quantum has a follower in flight) at every position; eager at a few
    subsets = {"eager": {0, 3, QUANTUM, QUANTUM + 1, len(lane_cases) - 1}, "cuda_graph": set(range(len(lane_cases)))}
    for name, lane in lanes.items():
        for i, ((ids, stops), p) in enumerate(zip(lane_cases, params, strict=True)):
            if i not in subsets[name]:
                continue
            out = list(lane.generate(GenerateRequest(f"p{i}", list(ids), p)))
            expected = standard[f"s{i}"]
            assert all(c.lane == "persistent" for c in out), (name, stops)
            assert tokens_of(out) == tokens_of(expected), (name, stops)
            assert text_of(out) == text_of(expected), (name, stops)
            assert out[-1].finish_reason == expected[-1].finish_reason, (name, stops)
            assert out[-1].num_output_tokens == expected[-1].num_output_tokens, (name, stops)
            assert [c.finish_reason for c in out[:-1]] == [None] * (len(out) - 1)
            assert_pool_full(core)
        assert lane.healthy
    assert not lanes["cuda_graph"].backend._in_flight  # every follower of a cut quantum was discarded
    assert [len(standard[f"s{i}"]) for i in range(len(lane_cases))] == list(range(1, QUANTUM + 3)) + [LANE_LENGTH]


def test_both_lanes_give_identical_tokens_with_min_tokens(core, tokenizer):
    """``min_tokens`` bans EOS and stop ids until that many tokens exist: the device's argmax does not mask them, so
    the lane recomputes the one position where a banned id came out (host forward, ban applied) and drops the
    rest of the quantum. A greedy answer that ends with EOS after 8 tokens, asked for at least 3 (no effect), 8
    and 13 tokens, alone and with a stop id that comes earlier, and with a stop string (checked only from
    ``min_tokens`` on)."""
    from tests.replicas.conftest import PROMPTS, chat_ids

    ids = chat_ids(tokenizer, PROMPTS[0])
    plain = run_standard(LLMEngine(core), {"r": (ids, SamplingParams(max_tokens=16, temperature=0.0))})["r"]
    natural = tokens_of(plain)
    assert natural[-1] in core.eos_token_ids and len(natural) == 8, natural
    cases = [dict(min_tokens=3), dict(min_tokens=8), dict(min_tokens=13),
             dict(min_tokens=6, stop_token_ids=(natural[2],)), dict(min_tokens=9, stop=("Paris",))]
    params = [SamplingParams(max_tokens=16, temperature=0.0, **kw) for kw in cases]
    standard = run_standard(LLMEngine(core), {f"s{i}": (ids, p) for i, p in enumerate(params)})
    for name, lane in _lanes(core).items():
        for i, p in enumerate(params):
            if name == "eager" and i not in (1, 4):
                continue
            out = list(lane.generate(GenerateRequest(f"m{i}", list(ids), p)))
            expected = standard[f"s{i}"]
            assert tokens_of(out) == tokens_of(expected), (name, cases[i])
            assert text_of(out) == text_of(expected), (name, cases[i])
            assert out[-1].finish_reason == expected[-1].finish_reason, (name, cases[i])
            assert len(tokens_of(out)) >= p.min_tokens
            assert_pool_full(core)
        assert lane.healthy and not getattr(lane.backend, "_in_flight", None)
        assert lane.min_tokens_recomputes >= 2  # the ban really changed tokens the device picked
    assert len(tokens_of(standard["s2"])) >= 13 and not set(tokens_of(standard["s2"])[:13]) & core.eos_token_ids


def test_a_cut_quantum_registers_only_the_kept_tokens_pages(core, tokenizer):
    """Prefix caching on the persistent lane: a request cut by a stop string mid-quantum (by the reader, which
    ends the stream) registers the pages of the tokens the engine generated; a page's hash covers its tokens
    and all before them, so the next turn, whose prompt holds the kept reply only, finds the full pages below
    the last kept token and no page with a dropped token, and decodes what an uncached lane decodes."""
    from tests.replicas.conftest import chat_ids, greedy_request, small_core

    def lane(prefix_caching: bool) -> PersistentLane:
        small = small_core(core, num_kv_blocks=64, max_model_len=512, prefix_caching=prefix_caching)
        return PersistentLane(small, EagerBackend(small.model, small.runner.device))

    prompt = chat_ids(tokenizer, "Write two sentences about rivers and the sea, then one about mountains.")
    cached, plain = lane(True), lane(False)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    full = tokens_of(list(plain.generate(greedy_request("ref", prompt, params))))
    k = 16 + 3  # inside the third quantum (the prefill token, then quanta of 8)
    stop = tokenizer.decode(full[: k + 1], skip_special_tokens=True)
    cut = list(cached.generate(greedy_request("cut", prompt, SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,)))))
    assert tokens_of(cut) == full[: k + 1] and cut[-1].finish_reason == "stop"
    assert_pool_full(cached.core)
    turn2 = prompt + full[: k + 1] + chat_ids(tokenizer, "Shorter, please.")[1:]
    short = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    again = tokens_of(list(cached.generate(greedy_request("t2", turn2, short))))
    # every full page of prompt + kept reply was registered and found; none past the last kept token
    assert cached.prefix_hit_tokens == (len(prompt) + k + 1) // 16 * 16
    assert again == tokens_of(list(plain.generate(greedy_request("t2p", turn2, short))))
    assert_pool_full(cached.core)
    assert_pool_full(plain.core)

"""Prompt logprobs (completions ``echo`` + ``logprobs``: what lm-eval's loglikelihood tasks read) on the standard
lane, against transformers' logits of the same prompt.

They are computed in the prefill from every prompt position's logits: whole, in
chunks (chunked prefill), and with prefix caching on (a cached page has no
logits, so a request that needs them does not read the prefix cache, as vLLM;
the pages it computes are still cached for others).
"""

from __future__ import annotations

import pytest
import torch

from replicas.engine import LLMEngine
from replicas.request import SamplingParams
from replicas.scheduler import SchedulerConfig
from tests.replicas.conftest import PROMPTS, chat_ids, run_standard, small_core

K = 3


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return chat_ids(tokenizer, PROMPTS[1])


@pytest.fixture(scope="module")
def reference(hf_model, prompt) -> tuple[list[float], list[list[int]]]:
    """transformers' logprob of each prompt token given the ones before it (from position 1), and the top K ids."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    values = [float(lp[t - 1, prompt[t]]) for t in range(1, len(prompt))]
    tops = [torch.topk(lp[t - 1], K).indices.tolist() for t in range(1, len(prompt))]
    return values, tops


def _prompt_logprobs(engine: LLMEngine, prompt, params, rid="r"):
    chunks = run_standard(engine, {rid: (prompt, params)})[rid]
    first = [c for c in chunks if c.prompt_logprobs is not None]
    assert len(first) == 1 and first[0] is chunks[0], "prompt logprobs come once, on the first chunk"
    return chunks[0].prompt_logprobs


def _check(entries, prompt, reference) -> None:
    values, tops = reference
    assert len(entries) == len(prompt) and entries[0] is None
    for t, e in enumerate(entries[1:], start=1):
        assert e.token_id == prompt[t]
        assert e.logprob == pytest.approx(values[t - 1], abs=2e-3), t
        assert [i for i, _ in e.top] == tops[t - 1] or abs(e.top[-1][1] - e.top[-2][1]) < 1e-3, t
        assert [v for _, v in e.top] == sorted((v for _, v in e.top), reverse=True)
        assert e.logprob <= e.top[0][1] + 1e-6


PARAMS = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=K)


def test_prompt_logprobs_match_transformers_whole_and_chunked(core, prompt, reference):
    _check(_prompt_logprobs(LLMEngine(core), prompt, PARAMS), prompt, reference)
    chunked = LLMEngine(core, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=7, enable_chunked_prefill=True))
    assert len(prompt) > 3 * 7  # several chunks, the last one partial
    _check(_prompt_logprobs(chunked, prompt, PARAMS, "c"), prompt, reference)


def test_prompt_logprobs_skip_the_prefix_cache_and_still_fill_it(core, prompt, reference):
    cached = small_core(core, num_kv_blocks=32, max_model_len=256, prefix_caching=True)
    engine = LLMEngine(cached)
    plain = SamplingParams(max_tokens=2, temperature=0.0)
    run_standard(engine, {"warm": (prompt, plain)})  # the prompt's full pages are now in the prefix cache
    engine.add_request("lp", prompt, PARAMS)
    lp_req = engine._tracked["lp"].req
    entries = run_standard(engine, {})["lp"][0].prompt_logprobs
    assert lp_req.num_cached_tokens == 0  # it did not read the cache: every position has logits
    _check(entries, prompt, reference)
    engine.add_request("again", prompt, plain)
    again = engine._tracked["again"].req
    run_standard(engine, {})
    assert again.num_cached_tokens == (len(prompt) - 1) // 16 * 16 > 0  # the cache still serves the others
    assert cached.allocator.num_free == cached.allocator.num_blocks


def test_n2_and_a_batch_each_get_their_own_prompt_logprobs(core, prompt, reference, tokenizer):
    other = chat_ids(tokenizer, PROMPTS[2])
    engine = LLMEngine(core)
    out = run_standard(engine, {"a": (prompt, SamplingParams(max_tokens=2, temperature=0.8, seed=1, n=2,
                                                             prompt_logprobs=0)),
                                "b": (other, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))})
    per_choice = {c.index: c.prompt_logprobs for c in out["a"] if c.prompt_logprobs is not None}
    assert set(per_choice) == {0, 1}
    for entries in per_choice.values():
        assert [e.token_id for e in entries[1:]] == prompt[1:] and all(e.top == [] for e in entries[1:])
        assert [e.logprob for e in entries[1:]] == pytest.approx(reference[0], abs=2e-3)
    b = out["b"][0].prompt_logprobs
    assert len(b) == len(other) and all(len(e.top) == 1 for e in b[1:])

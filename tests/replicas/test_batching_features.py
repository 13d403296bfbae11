"""Standard-lane scheduling features on the real model: chunked prefill, prefix caching, n > 1.

Each test compares against the same request run alone with every feature off,
so a feature that changed tokens (a wrong mask offset in a prefill chunk, a
stale cached page, a sibling's pages written by another) would fail here.
"""

from __future__ import annotations

import pytest

from replicas.engine import LLMEngine
from replicas.request import SamplingParams
from replicas.scheduler import SchedulerConfig
from tests.replicas.conftest import (
    PROMPTS,
    assert_pool_full,
    chat_ids,
    run_standard,
    small_core,
    tokens_of,
)

G = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _alone(core, ids, params=G) -> list[int]:
    plain = small_core(core, 64, 1024, prefix_caching=False)
    eng = LLMEngine(plain, SchedulerConfig(enable_chunked_prefill=False))
    return tokens_of(run_standard(eng, {"r": (ids, params)})["r"])


@pytest.fixture(scope="module")
def reference(core, tokenizer):
    ids = [chat_ids(tokenizer, p) for p in PROMPTS]
    return ids, [_alone(core, x) for x in ids]


def test_chunked_prefill_matches_whole_prefill(core, reference):
    ids, want = reference
    eng_core = small_core(core, 64, 1024)
    eng = LLMEngine(eng_core, SchedulerConfig(max_num_batched_tokens=16, enable_chunked_prefill=True))
    steps = []
    eng.add_request("r", ids[0], G)
    chunks = []
    while eng.has_unfinished():
        out = eng.step()
        steps.append(len(out))
        chunks += out
    # a prompt of > 16 tokens needs several prefill steps that emit nothing
    assert len(ids[0]) > 32 and steps[:2] == [0, 0]
    assert tokens_of(chunks) == want[0]
    assert_pool_full(eng_core)


def test_one_request_among_seven_others_with_every_feature_on(core, reference):
    """Greedy output identical alone vs batched with 7 others (chunked prefill + prefix cache on)."""
    ids, want = reference
    eng_core = small_core(core, 128, 1024, prefix_caching=True)
    eng = LLMEngine(eng_core, SchedulerConfig(max_num_batched_tokens=48, enable_chunked_prefill=True))
    reqs = {f"r{i}": (ids[i % len(ids)], G) for i in range(8)}
    out = run_standard(eng, reqs)
    for i in range(8):
        assert tokens_of(out[f"r{i}"]) == want[i % len(ids)], i
    assert_pool_full(eng_core)


def test_prefix_cache_reuses_pages_and_keeps_tokens(core, reference):
    ids, want = reference
    eng_core = small_core(core, 64, 1024, prefix_caching=True)
    eng = LLMEngine(eng_core)
    first = run_standard(eng, {"a": (ids[0], G)})["a"]
    eng.add_request("b", ids[0], G)
    eng.step()
    b = eng.scheduler.running[0]
    assert b.num_cached_tokens == (len(ids[0]) - 1) // 16 * 16 > 0
    while eng.has_unfinished():
        eng.step()
    assert tokens_of(first) == want[0]
    # a different prompt with the same chat-template prefix shares only whole equal pages
    eng.add_request("c", ids[1], G)
    eng.step()
    c = eng.scheduler.running[0]
    common = next(i for i, (x, y) in enumerate(zip(ids[0], ids[1], strict=False)) if x != y)
    assert c.num_cached_tokens == common // 16 * 16
    while eng.has_unfinished():
        eng.step()
    assert eng_core.allocator.num_cached > 0
    assert_pool_full(eng_core)


def test_prefix_cache_switch_off_caches_nothing(core, reference):
    ids, _ = reference
    eng_core = small_core(core, 64, 1024, prefix_caching=False)
    eng = LLMEngine(eng_core)
    run_standard(eng, {"a": (ids[0], G)})
    eng.add_request("b", ids[0], G)
    eng.step()
    assert eng.scheduler.running[0].num_cached_tokens == 0
    while eng.has_unfinished():
        eng.step()
    assert eng_core.allocator.num_cached == 0
    assert_pool_full(eng_core)


def test_n_sequences_share_prompt_pages(core, reference):
    ids, want = reference
    eng_core = small_core(core, 64, 1024, prefix_caching=True)
    eng = LLMEngine(eng_core)
    eng.add_request("n3", ids[0], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, n=3))
    by_index: dict[int, list[int]] = {0: [], 1: [], 2: []}
    shared_seen = False
    while eng.has_unfinished():
        for c in eng.step():
            assert c.request_id == "n3"
            by_index[c.index] += c.token_ids
        running = eng.scheduler.running
        if len(running) == 3:
            first_page = running[0].block_table[0]
            shared_seen |= all(r.block_table[0] == first_page for r in running)
            shared_seen &= eng_core.allocator.ref_count(first_page) == 3
    assert shared_seen, "the three sequences never held the same prompt page"
    assert by_index[0] == by_index[1] == by_index[2] == want[0]
    assert_pool_full(eng_core)


def test_n_sampled_sequences_differ_and_abort_frees_all(core, reference):
    ids, _ = reference
    eng_core = small_core(core, 64, 1024, prefix_caching=True)
    eng = LLMEngine(eng_core)
    eng.add_request("s", ids[1], SamplingParams(max_tokens=16, temperature=1.0, seed=3, n=3, ignore_eos=True))
    outs: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for _ in range(8):
        for c in eng.step():
            outs[c.index] += c.token_ids
    assert len({tuple(v) for v in outs.values()}) > 1
    assert eng.abort("s") and not eng.has_unfinished()
    assert_pool_full(eng_core)


def test_preempted_request_resumes_with_prefix_cache_hits(core, reference):
    ids, want = reference
    eng_core = small_core(core, 8, 128, prefix_caching=True)
    eng = LLMEngine(eng_core)
    out = run_standard(eng, {f"r{i}": (ids[i], G) for i in range(3)})
    assert eng.scheduler.num_preemptions > 0
    for i in range(3):
        assert tokens_of(out[f"r{i}"]) == want[i]
    assert_pool_full(eng_core)

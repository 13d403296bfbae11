"""Continuous-batching scheduler: admission limits and preemption by recompute.

The unit tests drive the real :class:`Scheduler` over a real allocator the way
:class:`LLMEngine` does (advance ``num_computed_tokens``, append a token). The
end-to-end test runs the real model on an engine with too few KV pages, so
requests get preempted, and checks their greedy outputs equal each request run
alone.
"""

from __future__ import annotations

from replicas.engine import LLMEngine
from replicas.kv_cache import PageAllocator
from replicas.request import Request, RequestStatus, SamplingParams
from replicas.scheduler import Scheduler, SchedulerConfig
from tests.replicas.conftest import assert_pool_full, run_standard, small_core, tokens_of

PARAMS = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)


def _req(rid: str, prompt_len: int) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), PARAMS)


def _advance(batch: list[tuple[Request, int]], token: int = 7) -> None:
    """What the engine does after a forward: the new tokens' KV is in, one token is sampled."""
    for req, n in batch:
        req.num_computed_tokens += n
        req.output_token_ids.append(token)


def test_preemption_frees_the_newest_request_and_requeues_it_first():
    alloc = PageAllocator(3)
    sched = Scheduler(SchedulerConfig(), alloc)
    a, b = _req("a", 16), _req("b", 16)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert [(r.request_id, n) for r, n in batch] == [("a", 16), ("b", 16)]
    assert a.status is b.status is RequestStatus.RUNNING
    _advance(batch)
    # both need a second page for token 17; only one page is free: b (newest) is preempted
    batch = sched.schedule()
    assert [(r.request_id, n) for r, n in batch] == [("a", 1)]
    assert b.status is RequestStatus.WAITING and list(sched.waiting) == [b]
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert b.output_token_ids == [7]  # its output so far is kept and recomputed later
    assert len(a.block_table) == 2 and alloc.num_free == 1
    _advance(batch)
    sched.finish(a)
    assert a.status is RequestStatus.FINISHED and alloc.num_free == 3
    # re-admitted: prefill of prompt + output so far (16 + 1 tokens)
    batch = sched.schedule()
    assert [(r.request_id, n) for r, n in batch] == [("b", 17)]
    assert len(b.block_table) == 2
    sched.finish(b)
    assert alloc.num_free == 3 and sched.num_unfinished == 0


def test_preemption_of_a_later_request_lets_an_earlier_one_continue():
    alloc = PageAllocator(4)
    sched = Scheduler(SchedulerConfig(), alloc)
    reqs = [_req(r, 16) for r in "abc"]
    for r in reqs:
        sched.add(r)
    _advance(sched.schedule())  # 3 pages used, 1 free
    batch = sched.schedule()  # a grows into the free page; b cannot grow: c (newest) is preempted for b
    assert [r.request_id for r, _ in batch] == ["a", "b"]
    assert reqs[2].status is RequestStatus.WAITING and reqs[2].block_table == []
    assert alloc.num_free == 0
    for r in reqs:
        sched.finish(r)
    assert alloc.num_free == 4


def test_waiting_requests_wait_for_pages_in_order():
    alloc = PageAllocator(2)
    sched = Scheduler(SchedulerConfig(), alloc)
    big, small = _req("big", 20), _req("small", 3)
    hog = _req("hog", 10)
    sched.add(hog)
    _advance(sched.schedule())  # hog holds 1 page
    sched.add(big)  # needs 2 pages: does not fit
    sched.add(small)  # fits, but FCFS keeps it behind big
    batch = sched.schedule()
    assert [r.request_id for r, _ in batch] == ["hog"]
    assert list(sched.waiting) == [big, small]
    sched.finish(hog)
    batch = sched.schedule()
    assert [r.request_id for r, _ in batch] == ["big"]
    for r in (big, small):
        sched.finish(r)
    assert alloc.num_free == 2


def test_token_budget_and_max_num_seqs_limit_admission():
    alloc = PageAllocator(16)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, enable_chunked_prefill=False), alloc)
    reqs = [_req("a", 10), _req("b", 10), _req("c", 40), _req("d", 1)]
    for r in reqs:
        sched.add(r)
    batch = sched.schedule()
    assert [(r.request_id, n) for r, n in batch] == [("a", 10)]  # b would pass the 16-token budget
    _advance(batch)
    batch = sched.schedule()
    assert [(r.request_id, n) for r, n in batch] == [("a", 1), ("b", 10)]
    _advance(batch)
    batch = sched.schedule()  # max_num_seqs=2: nothing else is admitted
    assert [r.request_id for r, _ in batch] == ["a", "b"]
    _advance(batch)
    sched.finish(reqs[0])
    sched.finish(reqs[1])
    batch = sched.schedule()  # a prompt longer than the budget still runs, alone
    assert [(r.request_id, n) for r, n in batch] == [("c", 40)]
    sched.finish(reqs[2])
    sched.finish(reqs[3])  # finishing a waiting request just drops it
    assert alloc.num_free == 16 and sched.num_unfinished == 0


PREEMPT_PROMPTS = ("The capital of France is", "Once upon a time,", "def fibonacci(n):", "My favourite colour is")


def test_preemption_by_recompute_keeps_greedy_outputs(core):
    """4 requests of 5-6 prompt + 24 output tokens need 8 pages; the cache has 4: requests are preempted."""
    small = small_core(core, num_kv_blocks=4, max_model_len=64)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [core.tokenizer.encode(p) for p in PREEMPT_PROMPTS]
    engine = LLMEngine(small)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    preempted: set[str] = set()
    most_running = 0
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        for chunk in engine.step():
            outputs[chunk.request_id].extend(chunk.token_ids)
        most_running = max(most_running, len(engine.scheduler.running))
        # a request back in the waiting queue after producing output was preempted
        preempted |= {r.request_id for r in engine.scheduler.waiting if r.output_token_ids}
        assert small.allocator.num_free + sum(len(r.block_table) for r in engine.scheduler.running) == 4
    assert not engine.has_unfinished()
    assert preempted, "the test setup should force at least one preemption"
    assert most_running >= 2, "requests should have been batched together"
    assert_pool_full(small)
    for i, ids in enumerate(prompts):
        alone = tokens_of(run_standard(LLMEngine(small), {"alone": (ids, params)})["alone"])
        assert len(alone) == 24
        assert outputs[f"r{i}"] == alone, f"request r{i} (preempted: {f'r{i}' in preempted})"
    assert_pool_full(small)


def test_chunked_prefill_splits_prompts_under_the_token_budget():
    alloc = PageAllocator(16)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, enable_chunked_prefill=True), alloc)
    a, b = _req("a", 10), _req("b", 40)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert [(r.request_id, n) for r, n in batch] == [("a", 10), ("b", 6)]
    a.num_computed_tokens += 10
    a.output_token_ids.append(7)
    b.num_computed_tokens += 6  # a prompt chunk: no token sampled
    batch = sched.schedule()
    assert [(r.request_id, n) for r, n in batch] == [("a", 1), ("b", 15)]  # decode keeps flowing
    assert len(b.block_table) == 2
    for r in (a, b):
        sched.finish(r)
    assert alloc.num_free == 16

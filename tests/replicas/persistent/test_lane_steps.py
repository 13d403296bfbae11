"""The persistent lane's step API (``add`` → ``step`` → ``abort``), as the engine actor's one loop drives it.

Both quantum steps run on CPU with real backends: the ``eager`` backend is synchronous
(pipeline depth 0) and the ``cuda_graph`` backend's static quantum body (no graph captured
on CPU) is a :class:`PipelinedBackend` (depth 1: the next quantum launched before this one
is read). Faults come from ``replicas/persistent/faults.py`` (the app's fault injection).
"""

from __future__ import annotations

import dataclasses
import threading

import pytest

from replicas.messages import GenerationChunk, GenerationError, Rejection
from replicas.persistent.contract import BackendLaunchError, PrelaunchError
from replicas.persistent.cuda_graph import CudaGraphBackend
from replicas.persistent.eager import EagerBackend
from replicas.persistent.faults import FaultInjection, with_faults
from replicas.persistent.lane import PersistentLane, Phase, classify_failure
from replicas.request import SamplingParams
from tests.replicas.conftest import PROMPTS, assert_pool_full, chat_ids, greedy_request, tokens_of

PARAMS = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ids(tokenizer) -> list[int]:
    return chat_ids(tokenizer, PROMPTS[3])


@pytest.fixture(scope="module")
def want(core, ids) -> list[int]:
    """The eager backend's tokens (equal to the standard lane's: test_contract.py)."""
    return tokens_of(list(PersistentLane(core, EagerBackend(core.model, "cpu")).generate(greedy_request("w", ids, PARAMS))))


def _backend(core, kind: str):
    if kind == "eager":
        return EagerBackend(core.model, "cpu")
    return CudaGraphBackend(core.model, "cpu", core.config.max_model_len)


def _lane(core, kind: str, pipeline_quanta: bool = True, faults: FaultInjection | None = None):
    """A lane over ``core``'s cache and pages, its config's ``pipeline_quanta`` set as asked."""
    backend = _backend(core, kind)
    if faults is not None:
        backend = with_faults(backend, faults)
    shared = dataclasses.replace(core, config=core.config.model_copy(update={"pipeline_quanta": pipeline_quanta}))
    return PersistentLane(shared, backend), backend


def _in_flight(backend) -> int:
    inner = getattr(backend, "inner", backend)
    return len(getattr(inner, "_in_flight", ()))


def _drain(lane) -> list:
    items = []
    while lane.has_unfinished():
        items.extend(lane.step())
    return items


@pytest.mark.parametrize(("kind", "pipeline_quanta", "depth"),
                         [("eager", True, 0), ("cuda_graph", False, 0), ("cuda_graph", True, 1)],
                         ids=["eager", "cuda_graph_synchronous", "cuda_graph_pipelined"])
def test_each_step_streams_one_item_at_the_depth_chosen_at_load(core, ids, want, kind, pipeline_quanta, depth):
    """add admits and reserves the prompt pages; each step streams one item: the prefill's first token, then one
    quantum of up to 8 tokens; a pipelined lane holds the next quantum in flight between steps, a synchronous
    one nothing; the tokens are the same either way and every page is back when the last item comes."""
    lane, backend = _lane(core, kind, pipeline_quanta)
    assert lane.pipeline_depth == depth
    assert lane.add(greedy_request("s", ids, PARAMS)) is None
    assert lane.busy and core.allocator.num_free < core.allocator.num_blocks
    sizes, in_flight, items = [], [], []
    while lane.has_unfinished():
        step = lane.step()
        assert len(step) == 1 and isinstance(step[0], GenerationChunk)
        items += step
        sizes.append(len(step[0].token_ids))
        in_flight.append(_in_flight(backend))
    assert tokens_of(items) == want and items[-1].finish_reason == "length"
    assert sizes == [1, 8, 8, 3]
    # after the prefill nothing runs; pipelined: quantum 2 rides behind quantum 1, then 3 behind 2; the end discards
    assert in_flight == ([0, 1, 1, 0] if depth else [0, 0, 0, 0])
    assert not lane.busy and lane.step() == []
    assert_pool_full(core)


@pytest.mark.parametrize("kind", ["eager", "cuda_graph"])
def test_a_prelaunch_rejection_continues_on_the_reference_decode(core, ids, want, kind):
    """The first quantum refused before launch (the cache untouched): the request continues on the eager
    reference path in the same lane, with the same tokens; the chunk of that quantum says why; the decoder
    stays healthy."""
    lane, _ = _lane(core, kind, faults=FaultInjection(stage="prelaunch", every_n=1))
    items = list(lane.generate(greedy_request("f", ids, PARAMS)))
    assert all(isinstance(i, GenerationChunk) for i in items)
    assert tokens_of(items) == want
    assert [c.fallback_reason for c in items] == [None, "injected_fault", None, None]
    assert lane.healthy
    assert_pool_full(core)


@pytest.mark.parametrize(("kind", "pipeline_quanta"), [("eager", True), ("cuda_graph", False), ("cuda_graph", True)])
def test_a_failure_after_launch_is_terminal_in_one_step(core, ids, want, kind, pipeline_quanta):
    """The 2nd quantum fails after launch: that step returns the post-launch error alone, the request is over
    (pages back, a pipelined follower discarded) and the decoder is unhealthy; the next add is refused."""
    lane, backend = _lane(core, kind, pipeline_quanta, FaultInjection(stage="after_launch", every_n=2))
    assert lane.add(greedy_request("x", ids, PARAMS)) is None
    first, quantum, failed = lane.step(), lane.step(), lane.step()
    assert tokens_of(first + quantum) == want[:9]
    assert len(failed) == 1 and isinstance(failed[0], GenerationError)
    assert (failed[0].stage, failed[0].reason) == ("postlaunch", "backend_launch_error")
    assert not lane.busy and not lane.healthy and _in_flight(backend) == 0
    assert_pool_full(core)
    refused = lane.add(greedy_request("y", ids, PARAMS))
    assert isinstance(refused, Rejection) and refused.reason == "decoder_unhealthy"


def test_classify_failure_takes_the_contract_reason_or_backend_launch_error():
    assert classify_failure(BackendLaunchError("x")) == "backend_launch_error"
    assert classify_failure(PrelaunchError("x", reason="cancelled")) == "cancelled"
    assert classify_failure(RuntimeError("device lost")) == "backend_launch_error"


@pytest.mark.parametrize(("kind", "pipeline_quanta"), [("eager", True), ("cuda_graph", True)])
@pytest.mark.parametrize("after_steps", [0, 1, 2], ids=["before_prefill", "after_prefill", "between_quanta"])
def test_abort_in_each_phase_frees_every_page(core, ids, kind, pipeline_quanta, after_steps):
    """abort drops the current request in any phase (admitted with its prompt pages and not prefilled, after
    the prefill, between quanta with a follower in flight) and streams nothing; the lane takes the next."""
    lane, backend = _lane(core, kind, pipeline_quanta)
    assert lane.add(greedy_request("a", ids, PARAMS)) is None
    for _ in range(after_steps):
        lane.step()
    assert lane._current.phase is (Phase.PREFILL if after_steps == 0 else Phase.DECODE)
    assert lane.abort("other") is False and lane.busy
    assert lane.abort("a") is True
    assert not lane.busy and lane.step() == [] and _in_flight(backend) == 0
    assert_pool_full(core)
    assert lane.abort("a") is False
    assert lane.add(greedy_request("b", ids, SamplingParams(max_tokens=2, temperature=0.0))) is None
    assert len(tokens_of(_drain(lane))) == 2
    assert_pool_full(core)


def test_the_cancel_flag_ends_with_an_abort_chunk_at_the_next_step(core, ids):
    cancel = threading.Event()
    lane, backend = _lane(core, "cuda_graph")
    assert lane.add(greedy_request("c", ids, PARAMS), cancel) is None
    lane.step()
    lane.step()
    cancel.set()
    out = lane.step()
    assert [(c.finish_reason, c.token_ids) for c in out] == [("abort", [])]
    assert not lane.busy and _in_flight(backend) == 0
    assert_pool_full(core)


def test_add_refuses_without_taking_anything(core, ids):
    """A second request while one holds the lane: queued_work; a prompt the engine cannot run: an
    invalid_request error. Neither takes a page nor disturbs the current request."""
    lane, _ = _lane(core, "eager")
    assert lane.add(greedy_request("a", ids, PARAMS)) is None
    free = core.allocator.num_free
    busy = lane.add(greedy_request("b", ids, PARAMS))
    assert isinstance(busy, Rejection) and (busy.reason, busy.stage) == ("queued_work", "prelaunch")
    bad = lane.add(greedy_request("c", [], PARAMS))
    assert isinstance(bad, GenerationError) and bad.reason == "invalid_request"
    assert core.allocator.num_free == free and lane.current_request_id == "a"
    assert len(tokens_of(_drain(lane))) == PARAMS.max_tokens
    assert_pool_full(core)

"""The ``cuda_graph`` backend's static quantum body, run eagerly on CPU, against the ``eager`` backend.

On CPU no graph is captured (``use_graphs`` is False): the same static body a
graph records runs step by step, so these tests check its numerics and its
on-device bookkeeping (stop ids, counts, committed length). ``tests/gpu/``
runs the captured graphs on an NVIDIA GPU.
"""

from __future__ import annotations

import pytest

from replicas.messages import GenerateRequest
from replicas.persistent.contract import BackendLaunchError, CacheBinding, PrelaunchError
from replicas.persistent.cuda_graph import CudaGraphBackend
from replicas.persistent.eager import EagerBackend
from replicas.persistent.lane import PersistentLane
from replicas.request import SamplingParams
from tests.replicas.conftest import PROMPTS, assert_pool_full, chat_ids, tokens_of


def _run(lane, ids, params):
    return list(lane.generate(GenerateRequest("r", list(ids), params)))


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_static_quanta_equal_eager_quanta(core, tokenizer, ignore_eos):
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=ignore_eos)
    ids = chat_ids(tokenizer, PROMPTS[0])
    eager = _run(PersistentLane(core, EagerBackend(core.model, "cpu")), ids, params)
    graph_backend = CudaGraphBackend(core.model, "cpu", core.config.max_model_len)
    assert graph_backend.use_graphs is False
    static = _run(PersistentLane(core, graph_backend), ids, params)
    assert tokens_of(static) == tokens_of(eager)
    assert [len(c.token_ids) for c in static] == [len(c.token_ids) for c in eager]
    assert static[-1].finish_reason == eager[-1].finish_reason
    assert_pool_full(core)


def test_stop_mid_quantum_counts_only_up_to_the_stop(core, tokenizer):
    ids = chat_ids(tokenizer, PROMPTS[0])
    greedy = tokens_of(_run(PersistentLane(core, EagerBackend(core.model, "cpu")), ids,
                            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)))
    stop = greedy[4]  # the 5th token: inside the first quantum after the prefill token
    backend = CudaGraphBackend(core.model, "cpu", core.config.max_model_len)
    out = _run(PersistentLane(core, backend), ids,
               SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,)))
    assert tokens_of(out) == greedy[: greedy.index(stop) + 1]
    assert out[-1].finish_reason == "stop"
    assert_pool_full(core)


def test_too_long_block_map_is_refused_before_launch(core):
    import torch

    from replicas.persistent.contract import QuantumRequest

    backend = CudaGraphBackend(core.model, "cpu", max_model_len=64)
    backend.bind_cache(CacheBinding.from_kv_tensor(core.kv_cache.tensor))
    req = QuantumRequest(pending_token=1, committed_kv_length=70, max_sequence_length=2048, max_tokens=2,
                         full_block_map=torch.arange(5, dtype=torch.int32))
    with pytest.raises(PrelaunchError, match="exceeds"):
        backend.run_quantum(req)


def _quantum(core, pending: int, committed: int, size: int, pages: list[int], stop=()):
    import torch

    from replicas.persistent.contract import QuantumRequest

    return QuantumRequest(pending_token=pending, committed_kv_length=committed,
                          max_sequence_length=core.config.max_model_len, max_tokens=size,
                          full_block_map=torch.tensor(pages, dtype=torch.int32), stop_token_ids=tuple(stop))


def _prefilled(core, tokenizer, new_pages: int):
    """A prompt prefilled through the engine's runner; returns (request, first token, its pages)."""
    from replicas.request import Request

    req = Request("p", chat_ids(tokenizer, PROMPTS[1]), SamplingParams(max_tokens=32, temperature=0.0))
    n = req.num_prompt_tokens
    core.allocator.grow(req.block_table, n + new_pages * 16)
    logits = core.runner.execute([(req, n)])
    req.num_computed_tokens = n
    return req, int(logits[0].argmax()), list(req.block_table)


def test_a_following_quantum_continues_from_the_device_state(core, tokenizer):
    """Quantum k+1 launched behind quantum k (``follows=True``, with a wrong pending token the backend must
    ignore) gives the tokens that one 8-step quantum run after k gives."""
    backend = CudaGraphBackend(core.model, "cpu", core.config.max_model_len)
    backend.bind_cache(CacheBinding.from_kv_tensor(core.kv_cache.tensor))
    req, first, pages = _prefilled(core, tokenizer, new_pages=2)
    n = req.num_prompt_tokens
    try:
        whole = backend.run_quantum(_quantum(core, first, n, 8, pages)).emitted_tokens
        whole += backend.run_quantum(_quantum(core, whole[-1], n + 8, 8, pages)).emitted_tokens
        backend.launch_quantum(_quantum(core, first, n, 8, pages))
        backend.launch_quantum(_quantum(core, 12345, n + 8, 8, pages), follows=True)
        with pytest.raises(PrelaunchError, match="in flight"):
            backend.launch_quantum(_quantum(core, first, n, 1, pages))
        a, b = backend.collect_quantum(), backend.collect_quantum()
        assert a.emitted_tokens + b.emitted_tokens == whole
        assert b.committed_kv_length == n + 16
        # after a stop, the follower counts nothing
        stop = whole[2]
        backend.launch_quantum(_quantum(core, first, n, 8, pages, stop=(stop,)))
        backend.launch_quantum(_quantum(core, 0, n + 8, 8, pages, stop=(stop,)), follows=True)
        a, b = backend.collect_quantum(), backend.collect_quantum()
        assert a.emitted_tokens == whole[:3] and a.finish_reason == "eos"
        assert b.emitted_tokens == []
        with pytest.raises(BackendLaunchError, match="no quantum in flight"):
            backend.collect_quantum()
    finally:
        backend.discard_quanta()
        core.allocator.release(req.block_table)
    assert_pool_full(core)


def test_a_following_quantum_needs_one_before_it(core):
    backend = CudaGraphBackend(core.model, "cpu", core.config.max_model_len)
    backend.bind_cache(CacheBinding.from_kv_tensor(core.kv_cache.tensor))
    with pytest.raises(PrelaunchError, match="needs one launched before it"):
        backend.launch_quantum(_quantum(core, 1, 16, 2, [0, 1]), follows=True)
    backend.launch_quantum(_quantum(core, 1, 16, 2, [0, 1, 2]))
    backend.discard_quanta()  # the device state is no longer a quantum the caller tracks
    with pytest.raises(PrelaunchError, match="needs one launched before it"):
        backend.launch_quantum(_quantum(core, 1, 18, 2, [0, 1, 2]), follows=True)


def test_the_lane_launches_each_quantum_behind_the_one_it_reads(core, tokenizer):
    """Through the lane: every quantum after the first is launched as a follower, the tokens equal the eager
    backend's, a stop inside a quantum drops the follower, and a cancel mid-request frees every page."""
    import threading

    ids = chat_ids(tokenizer, PROMPTS[0])
    params = SamplingParams(max_tokens=27, temperature=0.0, ignore_eos=True)
    greedy = tokens_of(_run(PersistentLane(core, EagerBackend(core.model, "cpu")), ids, params))
    backend = CudaGraphBackend(core.model, "cpu", core.config.max_model_len)
    follows = []
    launch = backend.launch_quantum

    def recording_launch(req, follows_previous=False):
        follows.append(follows_previous)
        launch(req, follows_previous)

    backend.launch_quantum = recording_launch
    lane = PersistentLane(core, backend)
    out = _run(lane, ids, params)
    assert tokens_of(out) == greedy
    assert follows == [False, True, True, True]  # 26 tokens after the prefill token: 8 + 8 + 8 + 2
    follows.clear()
    stop = greedy[10]  # inside the second quantum, while the third runs behind it
    out = _run(lane, ids, SamplingParams(max_tokens=27, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,)))
    assert tokens_of(out) == greedy[:11] and out[-1].finish_reason == "stop"
    assert follows == [False, True, True] and not backend._in_flight
    assert_pool_full(core)
    cancel = threading.Event()
    chunks = []
    for chunk in lane.generate(GenerateRequest("c", list(ids), params), cancel=cancel):
        chunks.append(chunk)
        if len(chunks) == 2:
            cancel.set()
    assert chunks[-1].finish_reason == "abort" and not backend._in_flight
    assert_pool_full(core)


def _lane_with_faults(core, stage: str, every_n: int):
    from replicas.persistent.faults import (
        FaultInjectingPipelinedBackend,
        FaultInjection,
        with_faults,
    )

    backend = CudaGraphBackend(core.model, "cpu", core.config.max_model_len)
    wrapped = with_faults(backend, FaultInjection(stage=stage, every_n=every_n))
    assert isinstance(wrapped, FaultInjectingPipelinedBackend)
    return PersistentLane(core, wrapped), backend


def test_a_failure_collected_with_a_follower_in_flight_is_terminal(core, tokenizer):
    """The 2nd quantum (a follower) fails when it is read, while the 3rd already runs behind it: the request
    ends with a post-launch error, the decoder is unhealthy, the follower is discarded, no page leaks."""
    from replicas.messages import GenerationError

    lane, backend = _lane_with_faults(core, "after_launch", 2)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    out = _run(lane, chat_ids(tokenizer, PROMPTS[0]), params)
    assert isinstance(out[-1], GenerationError) and out[-1].stage == "postlaunch"
    assert len(tokens_of(out[:-1])) == 1 + 8  # the prefill token and the first quantum
    assert not lane.healthy and not backend._in_flight
    assert_pool_full(core)


def test_a_refused_follower_runs_on_its_own_later(core, tokenizer):
    """Every 2nd launch refused before launch (a follower each time): nothing falls back, the tokens equal
    the eager backend's, no page leaks."""
    ids = chat_ids(tokenizer, PROMPTS[2])
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    want = tokens_of(_run(PersistentLane(core, EagerBackend(core.model, "cpu")), ids, params))
    lane, backend = _lane_with_faults(core, "prelaunch", 2)
    out = _run(lane, ids, params)
    assert tokens_of(out) == want and all(getattr(c, "fallback_reason", None) is None for c in out)
    assert lane.healthy and not backend._in_flight
    assert_pool_full(core)


def test_a_follower_that_fails_to_launch_is_terminal(core, tokenizer):
    """The follower's launch itself fails (a device error while queueing it): the request ends with a
    post-launch error and the decoder is marked unhealthy; the quantum before it is discarded."""
    from replicas.messages import GenerationError

    backend = CudaGraphBackend(core.model, "cpu", core.config.max_model_len)
    launch = backend.launch_quantum

    def failing_follower(req, follows=False):
        if follows:
            raise BackendLaunchError("device lost while queueing the follower")
        launch(req, follows)

    backend.launch_quantum = failing_follower
    lane = PersistentLane(core, backend)
    out = _run(lane, chat_ids(tokenizer, PROMPTS[0]), SamplingParams(max_tokens=20, temperature=0.0))
    assert isinstance(out[-1], GenerationError) and out[-1].stage == "postlaunch"
    assert "follower" in out[-1].message and not lane.healthy and not backend._in_flight
    assert_pool_full(core)

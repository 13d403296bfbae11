"""The ``cuda_graph`` backend's static quantum body, run eagerly on CPU, against the ``eager`` backend.

On CPU no graph is captured (``use_graphs`` is False): the same static body a
graph records runs step by step, so these tests check its numerics and its
on-device bookkeeping (stop ids, counts, committed length). ``tests/gpu/``
runs the captured graphs on an NVIDIA GPU.
"""

from __future__ import annotations

import pytest

from replicas.messages import GenerateRequest
from replicas.persistent.contract import CacheBinding, PrelaunchError
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
                         eos_token_id=2, ignore_eos=True, full_block_map=torch.arange(5, dtype=torch.int32))
    with pytest.raises(PrelaunchError, match="exceeds"):
        backend.run_quantum(req)

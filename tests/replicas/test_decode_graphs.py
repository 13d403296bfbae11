"""The standard lane's decode-graph path on CPU: the batched static decode step it records, and bucketing.

CUDA graphs themselves are captured and replayed only on a GPU (``tests/gpu``:
the standard lane with graphs gives the persistent lane's tokens). Here the
step a graph records — ``decode_static`` over several sequences at once, with
the torch references of its kernels — is checked against the eager forward.
"""

from __future__ import annotations

import torch

from replicas.decode_graphs import DecodeGraphs
from replicas.kernels.paged_attention import PAGE_SIZE
from replicas.model_runner import build_metadata
from replicas.request import Request, SamplingParams
from tests.replicas.conftest import chat_ids


def _prefilled(core, prompts: list[list[int]]) -> list[Request]:
    """Requests whose prompts are in the cache (one pending token each: the prompt's last)."""
    reqs = []
    for i, ids in enumerate(prompts):
        req = Request(f"g{i}", list(ids), SamplingParams(max_tokens=4, temperature=0.0))
        req.block_table = core.allocator.allocate(-(-(len(ids) + 1) // PAGE_SIZE))
        core.runner.execute([(req, len(ids) - 1)])  # everything but the last prompt token
        req.num_computed_tokens = len(ids) - 1
        reqs.append(req)
    return reqs


def _static_and_eager(core, reqs: list[Request], max_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the requests' pending tokens from one batched ``decode_static`` step and from the eager
    forward (the cache restored in between, so both write the same KV)."""
    tables = torch.zeros(len(reqs), max_blocks, dtype=torch.long)
    for i, r in enumerate(reqs):
        tables[i, : len(r.block_table)] = torch.tensor(r.block_table)
    token = torch.tensor([r.all_token_ids[r.num_computed_tokens] for r in reqs])
    position = torch.tensor([r.num_computed_tokens for r in reqs])
    saved = core.kv_cache.tensor.clone()
    with torch.inference_mode():
        static = core.model.decode_static(token, position, tables, core.runner.kv_planes)
    core.kv_cache.tensor.copy_(saved)
    input_ids, meta = build_metadata([(r, 1) for r in reqs], "cpu")
    with torch.inference_mode():
        eager = core.model(input_ids, meta, core.runner.kv_planes)
    return static, eager


def test_batched_static_decode_step_equals_the_eager_forward(core, tokenizer):
    """Three sequences of different lengths in one static step (what a bucket-4 graph records, minus the
    padding row) give the eager forward's logits."""
    prompts = [chat_ids(tokenizer, t) for t in ("Hi", "What is the capital of France?", "Count to five.")]
    reqs = _prefilled(core, prompts)
    try:
        static, eager = _static_and_eager(core, reqs, max_blocks=8)
        assert static.shape == eager.shape == (3, core.model.config.vocab_size)
        torch.testing.assert_close(static, eager, rtol=1e-4, atol=1e-4)
        assert torch.equal(static.argmax(-1), eager.argmax(-1))
    finally:
        for r in reqs:
            core.allocator.free(r.block_table)


def test_buckets_take_only_pure_decode_batches_that_fit(core):
    graphs = DecodeGraphs(core.model, core.runner.kv_planes, torch.device("cuda"), max_model_len=64,
                          batch_sizes=(1, 2, 4, 8))
    req = Request("b", [1, 2, 3], SamplingParams(max_tokens=4))
    req.block_table = [0, 1]
    assert graphs.bucket([(req, 1)]) == 1
    assert graphs.bucket([(req, 1)] * 3) == 4
    assert graphs.bucket([(req, 1)] * 9) is None  # above the largest bucket
    assert graphs.bucket([(req, 1), (req, 2)]) is None  # a prompt chunk: not pure decode
    req.block_table = list(range(5))  # 80 tokens of pages > max_model_len 64
    assert graphs.bucket([(req, 1)]) is None
    graphs._failed.add(2)
    req.block_table = [0]
    assert graphs.bucket([(req, 1)] * 2) is None  # a bucket whose capture failed runs eagerly


def test_a_model_limits_its_graph_buckets():
    """A model's ``max_decode_graph_batch`` drops larger buckets (GPT-OSS has none since its grouped MoE
    kernels serve large batches), and an engine with no bucket left has no graphs at all."""
    from replicas.config import EngineConfig
    from replicas.engine import decode_graphs
    from replicas.models.gpt_oss import GptOssForCausalLM

    limited = type("M", (), {"max_decode_graph_batch": 16, "has_static_decode": True})()
    assert DecodeGraphs(limited, [], torch.device("cuda"), 64, batch_sizes=(1, 8, 16, 32)).batch_sizes == (1, 8, 16)
    from replicas.kernels.decode_ops import DecodeOps
    from replicas.kernels.moe import DECODE_MAX_TOKENS, MoE, MoEChoice

    model = GptOssForCausalLM.__new__(GptOssForCausalLM)
    model.__dict__["ops"] = DecodeOps.reference(moe=True)  # CPU: dequantizing prefill path
    assert model.max_decode_graph_batch == DECODE_MAX_TOKENS == 16
    model.__dict__["ops"] = DecodeOps(moe=MoE.__new__(MoE))  # the grouped GEMMs: any batch is capturable
    model.ops.moe.choice = MoEChoice("triton_tc", "grouped_gemm", False)
    assert model.max_decode_graph_batch is None
    gpt = type("M", (), {"max_decode_graph_batch": None, "decode_static": None})()
    assert DecodeGraphs(gpt, [], torch.device("cuda"), 64).batch_sizes[-1] == 256
    off = type("M", (), {"max_decode_graph_batch": 0, "has_static_decode": True})()
    kv = type("KV", (), {"planes": lambda self: []})()
    assert decode_graphs(EngineConfig(), off, kv, torch.device("cuda")) is None
    assert decode_graphs(EngineConfig(), limited, kv, torch.device("cuda")) is not None
    assert decode_graphs(EngineConfig(enforce_eager=True), limited, kv, torch.device("cuda")) is None
    assert decode_graphs(EngineConfig(), limited, kv, torch.device("cpu")) is None


def test_batched_static_decode_step_equals_the_eager_forward_gpt_oss(tmp_path):
    """The same on a tiny random GPT-OSS (sinks, sliding window, MXFP4 experts routed per row)."""
    from ops.tools.make_tiny_gpt_oss import make_tiny_gpt_oss
    from replicas.config import EngineConfig
    from replicas.engine import EngineCore
    from tests.replicas.conftest import TORCH_THREADS

    core = EngineCore.load(EngineConfig(model=str(make_tiny_gpt_oss(tmp_path / "m", seed=1)), dtype="float32",
                                        progress=False, max_model_len=512, torch_threads=TORCH_THREADS))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, core.model.config.vocab_size, (n,), generator=g).tolist() for n in (150, 40)]
    static, eager = _static_and_eager(core, _prefilled(core, prompts), max_blocks=16)
    torch.testing.assert_close(static, eager, rtol=1e-4, atol=1e-4)

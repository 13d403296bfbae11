"""GPT-OSS's kernel forward (``GptOssForCausalLM.forward_kernels``: the GPU's prefill and mixed steps) against
the torch reference forward, on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set by this
folder's conftest), fp32, a tiny random model.

The ops are forced to the Triton kernels on the CPU (``DecodeOps(triton=True)`` with the ``triton_fp32`` MoE
backend and the grouped GEMMs as its prefill path, what an fp32 model resolves to on a GPU). One forward mixes
a whole prompt, a chunk after cached context and decode tokens (more than 16 tokens: the grouped GEMMs), one
has 16 or fewer (the decode MoE kernel); logits and the KV written agree with the reference forward's.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from ops.tools.model_shapes import shape_config  # noqa: E402
from replicas.kernels.decode_ops import DecodeOps  # noqa: E402
from replicas.kernels.moe import MoE, MoEChoice  # noqa: E402
from replicas.kv_cache import KVCache  # noqa: E402
from replicas.model_runner import build_metadata  # noqa: E402
from replicas.models.gpt_oss import GptOssForCausalLM  # noqa: E402
from replicas.models.gpt_oss_config import GptOssConfig  # noqa: E402
from replicas.request import Request, SamplingParams  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def models():
    """(the model on forced Triton ops, the same weights on the torch references)."""
    cfg = GptOssConfig.from_dict(shape_config("tiny-gpt-oss"))
    wide = {"block_j": 32, "block_r": 64}  # whole rows per program: few programs for the interpreter
    ops = DecodeOps(triton=True, prefill_kernels=True,
                    moe=MoE(MoEChoice("triton_fp32", "grouped_gemm", False, tiles=wide)))
    kernels = GptOssForCausalLM.from_config(cfg, torch.float32, DEVICE, seed=3).use_ops(ops)
    return kernels, GptOssForCausalLM.from_config(cfg, torch.float32, DEVICE, seed=3)


def _request(rid: str, n: int, computed: int, seed: int, pages: list[int]) -> Request:
    ids = torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    req = Request(rid, ids, SamplingParams())
    req.block_table, req.num_computed_tokens = pages, computed
    return req


def _check(models, batch, blocks: int) -> None:
    """The cached context of every request written by the reference, then one forward of ``batch`` on each
    model from copies of that cache: logits and the KV written agree."""
    kernels, reference = models
    cache = KVCache(reference.config, blocks, torch.float32, DEVICE)
    for req, _ in batch:
        if req.num_computed_tokens:
            saved, req.num_computed_tokens = req.num_computed_tokens, 0
            ids, meta = build_metadata([(req, saved)], DEVICE)
            reference(ids, meta, cache.planes())
            req.num_computed_tokens = saved
    out = []
    for model, on in ((kernels, True), (reference, False)):
        kv = cache.tensor.clone()
        ids, meta = build_metadata(batch, DEVICE)
        meta.kernels = on
        out.append((model(ids, meta, [(kv[0, i], kv[1, i]) for i in range(kv.shape[1])]), kv))
    (got, kv_got), (want, kv_want) = out
    assert got.shape == want.shape == (len(batch), reference.config.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    torch.testing.assert_close(kv_got, kv_want, rtol=1e-5, atol=1e-5)


def test_mixed_step_through_the_grouped_gemms(models):
    """A whole prompt, a decode token, a chunk after cached context: 18 tokens, over the decode kernels' 16."""
    prompt = _request("p", 7, 0, 1, [7])
    chunk = _request("c", 30, 20, 2, [0, 9])  # 10 new tokens after 20 cached, across a page boundary
    dec = _request("d", 40, 39, 3, [4, 11, 2])
    _check(models, [(prompt, 7), (dec, 1), (chunk, 10)], blocks=12)


def test_few_tokens_through_the_decode_moe_kernel(models):
    """Sixteen tokens or fewer (a prefix-cached repeat's last chunk, small mixed steps): the decode backend's
    partials summed by the next add + RMSNorm."""
    chunk = _request("c", 36, 32, 5, [3, 1, 6])  # 4 tokens after two cached pages
    dec = _request("d", 18, 17, 6, [4, 0])
    _check(models, [(chunk, 4), (dec, 1)], blocks=8)

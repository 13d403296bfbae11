"""GPT-OSS on the row-exact ops (``DecodeOps.batch_invariant``, ``docs/exactness.md``) on the CPU under Triton's
interpreter (fp32, a tiny random model): the prefill family (``forward_kernels``) and the decode family
(``decode_static``) compute the reference forward's function, and the model runner with ``batch_invariant``
keeps decode rows and prompt tokens in separate forwards whose logits land in the batch's order.

Row exactness of the decode family: a decode row's logits are bitwise the same alone and beside other decode
rows and beside prompt tokens. The probe is row 0 in every launch, because the interpreter's matmul (numpy's
BLAS) rounds a row differently by its position in a tile, which GPU MMA tiles do not (``tests/gpu`` checks
arbitrary positions in bf16)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from ops.tools.model_shapes import shape_config
from replicas.kernels.decode_ops import DecodeOps
from replicas.kernels.moe import MoE, MoEChoice
from replicas.kv_cache import KVCache
from replicas.model_runner import ModelRunner, build_metadata
from replicas.models.gpt_oss import GptOssForCausalLM
from replicas.models.gpt_oss_config import GptOssConfig
from replicas.request import Request, SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def models():
    """(the model on the row-exact ops, the same weights on the torch references)."""
    cfg = GptOssConfig.from_dict(shape_config("tiny-gpt-oss"))
    ops = DecodeOps(triton=True, prefill_kernels=True, batch_invariant=True,
                    moe=MoE(MoEChoice("triton_fp32", "grouped_gemm", False)))
    exact = GptOssForCausalLM.from_config(cfg, torch.float32, DEVICE, seed=3).use_ops(ops)
    return exact, GptOssForCausalLM.from_config(cfg, torch.float32, DEVICE, seed=3)


def _request(rid: str, n: int, computed: int, seed: int, pages: list[int]) -> Request:
    ids = torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    req = Request(rid, ids, SamplingParams())
    req.block_table, req.num_computed_tokens = pages, computed
    return req


def _fill(reference, cache: KVCache, reqs: list[Request]) -> None:
    """Write each request's cached context with the reference forward."""
    for req in reqs:
        if req.num_computed_tokens:
            saved, req.num_computed_tokens = req.num_computed_tokens, 0
            ids, meta = build_metadata([(req, saved)], DEVICE)
            reference(ids, meta, cache.planes())
            req.num_computed_tokens = saved


def _planes(kv: torch.Tensor):
    return [(kv[0, i], kv[1, i]) for i in range(kv.shape[1])]


def test_row_exact_forward_and_decode_step_compute_the_reference_function(models):
    exact, reference = models
    prompt = _request("p", 23, 0, 1, [7, 8])
    dec = _request("d", 40, 39, 3, [4, 11, 2])
    cache = KVCache(reference.config, 12, torch.float32, DEVICE)
    _fill(reference, cache, [dec])
    outs = []
    for model, on in ((exact, True), (reference, False)):
        kv = cache.tensor.clone()
        ids, meta = build_metadata([(prompt, 23), (dec, 1)], DEVICE)
        meta.kernels = on
        outs.append((model(ids, meta, _planes(kv)), kv))
    (got, kv_got), (want, kv_want) = outs
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    torch.testing.assert_close(kv_got, kv_want, rtol=1e-5, atol=1e-5)
    kv = cache.tensor.clone()
    step = exact.decode_static(torch.tensor([dec.all_token_ids[39]], device=DEVICE),
                               torch.tensor([39], device=DEVICE),
                               torch.tensor([dec.block_table], device=DEVICE), _planes(kv))
    torch.testing.assert_close(step.float(), want[1:], rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_runner_splits_mixed_steps_and_decode_rows_are_exact(models):
    """A decode row alone, beside another decode row, and beside a prompt and a prompt chunk: the same bits;
    the mixed step's prompt rows agree with the reference forward and come back in the batch's order."""
    exact, reference = models
    cache = KVCache(reference.config, 16, torch.float32, DEVICE)
    runner = ModelRunner(exact, None, DEVICE, kernels=True, batch_invariant=True)

    def fresh():
        dec = _request("d", 40, 39, 3, [4, 11, 2])
        other = _request("o", 20, 19, 5, [5, 6])
        chunk = _request("c", 30, 20, 2, [0, 9])
        prompt = _request("p", 7, 0, 1, [12])
        dec.output_token_ids = [dec.all_token_ids[39]]  # generated: the prompt is 39 tokens
        dec.prompt_token_ids = dec.prompt_token_ids[:39]
        other.output_token_ids = [other.all_token_ids[19]]
        other.prompt_token_ids = other.prompt_token_ids[:19]
        return dec, other, chunk, prompt

    dec, other, chunk, prompt = fresh()
    assert dec.prefill_done and dec.all_token_ids[39] == dec.output_token_ids[0]
    _fill(reference, cache, [dec, other, chunk])
    results = []
    for batch_of in (lambda d, o, c, p: [(d, 1)], lambda d, o, c, p: [(d, 1), (o, 1)],
                     lambda d, o, c, p: [(d, 1), (p, 7), (o, 1), (c, 10)]):
        kv = cache.tensor.clone()
        runner.kv_planes = _planes(kv)
        d, o, c, p = fresh()
        results.append(runner.execute(batch_of(d, o, c, p)))
    alone, two, mixed = results
    assert torch.equal(two[0], alone[0]) and torch.equal(mixed[0], alone[0])
    assert torch.equal(mixed[2], two[1])
    kv = cache.tensor.clone()
    d, o, c, p = fresh()
    ids, meta = build_metadata([(p, 7), (c, 10)], DEVICE)
    want = reference(ids, meta, _planes(kv))
    torch.testing.assert_close(mixed[[1, 3]], want, rtol=1e-4, atol=1e-4 * want.abs().max().item())

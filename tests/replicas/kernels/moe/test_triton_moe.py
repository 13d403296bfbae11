"""MoE-path Triton kernels (MXFP4 gate_up+SwiGLU / down+sum, top-k router, add+RMSNorm) against their
torch references, on fresh random inputs: Triton's CPU interpreter in fp32 here, the GPU (fp32 and bf16)
in ``tests/gpu``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from replicas.kernels.decode_ops import add_rmsnorm_reference  # noqa: E402
from replicas.kernels.moe.mma_format import mxfp4_activations  # noqa: E402
from replicas.kernels.moe.reference import moe_reference  # noqa: E402
from replicas.kernels.moe.triton_fp32 import triton_moe_gemv  # noqa: E402
from replicas.kernels.moe.triton_portable import triton_moe  # noqa: E402
from replicas.kernels.moe.triton_tc import triton_moe_tc  # noqa: E402
from replicas.kernels.reference import router_topk_reference  # noqa: E402
from replicas.kernels.triton_rmsnorm import triton_add_rmsnorm  # noqa: E402
from replicas.kernels.triton_router import triton_add_rmsnorm_route, triton_router_topk  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class RandomExperts:
    """``E`` random packed MXFP4 experts with GPT-OSS's buffer names (scales near 2**0 keep values O(1))."""

    def __init__(self, e: int, hidden: int, inter: int, seed: int, dtype=torch.float32):
        g = torch.Generator().manual_seed(seed)

        def packed(rows, cols):
            blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
            scales = torch.randint(121, 128, (e, rows, cols // 32), generator=g, dtype=torch.uint8)
            return blocks.to(DEVICE), scales.to(DEVICE)

        self.gate_up_proj_blocks, self.gate_up_proj_scales = packed(2 * inter, hidden)
        self.down_proj_blocks, self.down_proj_scales = packed(hidden, inter)
        self.gate_up_proj_bias = torch.randn(e, 2 * inter, generator=g).to(DEVICE, dtype)
        self.down_proj_bias = torch.randn(e, hidden, generator=g).to(DEVICE, dtype)
        self.alpha, self.limit = 1.702, 7.0


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.parametrize("tokens,k,with_residual", [(1, 4, True), (3, 2, False), (1, 1, False)])
def test_mxfp4_moe_matches_dequantized_reference(tokens, k, with_residual):
    hidden, inter, e = 96, 64, 8  # 3 and 2 scale groups per row: exercises the masked last tile
    experts = RandomExperts(e, hidden, inter, seed=tokens * 10 + k)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)]).to(DEVICE)
    weights = torch.softmax(torch.randn(tokens, k, generator=g), -1).to(DEVICE)
    residual = torch.randn(tokens, hidden, generator=g).to(DEVICE) if with_residual else None
    ours = triton_moe(x, weights, ids, experts.gate_up_proj_blocks, experts.gate_up_proj_scales,
                      experts.gate_up_proj_bias, experts.down_proj_blocks, experts.down_proj_scales,
                      experts.down_proj_bias, experts.alpha, experts.limit, residual=residual,
                      block_j=16, block_r=16, groups_per_tile=2)
    ref = moe_reference(x, weights, ids, experts)
    if residual is not None:
        ref = ref + residual
    assert ref.abs().max() > 1.0  # a real signal, not zeros
    assert _rel_err(ours, ref) < 1e-5


@pytest.mark.parametrize("tokens,k,blocks_per_step", [(1, 4, 2), (3, 2, 4), (2, 1, 16), (1, 4, 1)])
def test_simt_fp32_moe_matches_dequantized_reference(tokens, k, blocks_per_step):
    """The exact-fp32 SIMT kernels with their plain-Triton E2M1 decoding (the inline PTX runs on the GPU,
    ``tests/gpu``): per-expert weighted partials that sum to the reference; several K steps, a masked last
    step (3 blocks in steps of 2), one step larger than the row (16 > 3), one block per step."""
    hidden, inter, e = 96, 64, 8
    experts = RandomExperts(e, hidden, inter, seed=tokens * 7 + k)
    g = torch.Generator().manual_seed(k + 5)
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)]).to(DEVICE)
    weights = torch.softmax(torch.randn(tokens, k, generator=g), -1).to(DEVICE)
    parts = triton_moe_gemv(x, weights, ids, experts.gate_up_proj_blocks, experts.gate_up_proj_scales,
                            experts.gate_up_proj_bias, experts.down_proj_blocks, experts.down_proj_scales,
                            experts.down_proj_bias, experts.alpha, experts.limit, block_j=2, block_r=4,
                            blocks_per_step=blocks_per_step, num_warps=1, ptx=torch.cuda.is_available())
    assert parts.shape == (tokens, k, hidden)
    ref = moe_reference(x, weights, ids, experts)
    assert ref.abs().max() > 1
    assert _rel_err(parts.sum(1), ref) < 1e-5


def test_router_topk_matches_topk_softmax():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 40, generator=g).to(DEVICE)  # continuous: no ties
    w, ids = triton_router_topk(logits, 4, torch.float32)
    w_ref, ids_ref = router_topk_reference(logits, 4, torch.float32)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-6)
    assert torch.allclose(w.sum(-1), torch.ones(5, device=DEVICE))


def test_router_topk_ties_go_to_the_lowest_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, -1.0], [0.5, 0.5, 0.5, 0.5, 0.5, 0.5]], device=DEVICE)
    w, ids = triton_router_topk(logits, 3, torch.float32)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]
    torch.testing.assert_close(w, torch.full((2, 3), 1 / 3, device=DEVICE))


@pytest.mark.parametrize("e,k,block_n", [(40, 4, 4), (128, 4, 4), (32, 2, 8), (42, 3, 4)])
def test_add_rmsnorm_route_matches_the_three_launches(e, k, block_n):
    """One launch = add + RMSNorm (GPT-OSS's fp32 weight), router GEMV, top-k softmax; called twice with one
    workspace on fresh inputs, so a counter left behind by the first call would leave the second call's top-k
    unwritten. 42 experts: the last program's rows are partly masked."""
    hidden = 96
    ws: dict = {}
    for call in range(2):
        g = torch.Generator().manual_seed(100 * e + call)
        res, delta = (torch.randn(1, hidden, generator=g).to(DEVICE) for _ in range(2))
        norm_w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(DEVICE)
        router_w = torch.randn(e, hidden, generator=g).to(DEVICE)
        router_b = torch.randn(e, generator=g).to(DEVICE)
        x, h, h_mx, w, ids = triton_add_rmsnorm_route(res, delta, norm_w, 1e-5, router_w, router_b, k,
                                                      mxfp4_out=True, workspace=ws, block_n=block_n)
        x_ref, h_ref = add_rmsnorm_reference(res, delta, norm_w, 1e-5, True)
        w_ref, ids_ref = router_topk_reference(torch.nn.functional.linear(h_ref, router_w, router_b), k,
                                               torch.float32)
        torch.testing.assert_close(x, x_ref)
        torch.testing.assert_close(h, h_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(h_mx.float(), mxfp4_activations(h_ref).float(), rtol=1e-2, atol=0)
        assert torch.equal(ids, ids_ref)
        torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)
        assert ws["route_counter"].item() == 0


def test_add_rmsnorm_route_rejects_bad_shapes():
    z = torch.zeros(1, 32, device=DEVICE)
    with pytest.raises(ValueError, match="residual/delta"):
        triton_add_rmsnorm_route(torch.zeros(2, 32, device=DEVICE), torch.zeros(2, 32, device=DEVICE),
                                 torch.ones(32, device=DEVICE), 1e-5, torch.zeros(8, 32, device=DEVICE),
                                 torch.zeros(8, device=DEVICE), 2)
    with pytest.raises(ValueError, match="residual/delta"):
        triton_add_rmsnorm_route(z, z, torch.ones(32, device=DEVICE), 1e-5, torch.zeros(8, 32, device=DEVICE),
                                 torch.zeros(7, device=DEVICE), 2)


@pytest.mark.parametrize("with_delta", [True, False])
@pytest.mark.parametrize("weight_in_fp32", [True, False])
def test_add_rmsnorm_matches_reference(with_delta, weight_in_fp32):
    g = torch.Generator().manual_seed(int(with_delta) + 2 * int(weight_in_fp32))
    x = torch.randn(3, 100, generator=g).to(DEVICE)
    delta = torch.randn(3, 100, generator=g).to(DEVICE) if with_delta else None
    weight = (1 + 0.1 * torch.randn(100, generator=g)).to(DEVICE)
    x_new, y = triton_add_rmsnorm(x, delta, weight, 1e-5, weight_in_fp32)
    x_ref, y_ref = add_rmsnorm_reference(x, delta, weight, 1e-5, weight_in_fp32)
    torch.testing.assert_close(x_new, x_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)


def test_add_rmsnorm_sums_fp32_partials_in_order():
    """The MoE experts' partial outputs ``[T, K, N]`` fp32 are added to the residual, then normed."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 100, generator=g).to(DEVICE)
    parts = torch.randn(2, 4, 100, generator=g).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(100, generator=g)).to(DEVICE)
    x_new, y = triton_add_rmsnorm(x, parts, weight, 1e-5, True)
    x_ref, y_ref = add_rmsnorm_reference(x, parts, weight, 1e-5, True)
    torch.testing.assert_close(x_new, x + parts.sum(1), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(x_new, x_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_dequantize_matches_torch_exactly(dtype):
    """Every code, scales from 2**-20 to 2**20, a block count that is not a multiple of the tile."""
    from replicas.kernels.moe.mxfp4 import dequantize_mxfp4
    from replicas.kernels.moe.prefill_dequantize import triton_dequantize_mxfp4

    g = torch.Generator().manual_seed(11)
    blocks = torch.randint(0, 256, (3, 37, 5, 16), generator=g, dtype=torch.uint8).to(DEVICE)
    scales = torch.randint(107, 148, (3, 37, 5), generator=g, dtype=torch.uint8).to(DEVICE)
    ours = triton_dequantize_mxfp4(blocks, scales, dtype, ptx=torch.cuda.is_available())
    assert ours.shape == (3, 37, 160) and ours.dtype == dtype
    assert torch.equal(ours, dequantize_mxfp4(blocks, scales, dtype))
    # the same blocks in the decode kernels' bit layout dequantize to the same values
    from replicas.kernels.moe.decode_layout import repack_

    assert torch.equal(triton_dequantize_mxfp4(repack_(blocks.clone()), scales, dtype, repacked=True), ours)


@pytest.mark.parametrize("tokens,k,pairs", [(1, 4, 1), (2, 2, 2)])
def test_tensor_core_moe_plain_path_matches_reference(tokens, k, pairs):
    """``triton_moe_tc``'s plain-Triton path (the interpreter cannot run its PTX; ``tests/gpu`` checks that):
    block scales, the MMA activation format (times 2**64, permuted pairs), the masked last step of 4 blocks,
    the fused SwiGLU written back in that format. bf16 activations and SwiGLU output: bf16 tolerance."""
    hidden, inter, e = 160, 96, 8  # 5 and 3 blocks per row: the last step of 4 blocks is partly masked
    experts = RandomExperts(e, hidden, inter, seed=tokens * 7 + k)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)]).to(DEVICE)
    weights = torch.softmax(torch.randn(tokens, k, generator=g), -1).to(DEVICE)
    parts = triton_moe_tc(x, weights, ids, experts.gate_up_proj_blocks, experts.gate_up_proj_scales,
                          experts.gate_up_proj_bias, experts.down_proj_blocks, experts.down_proj_scales,
                          experts.down_proj_bias, experts.alpha, experts.limit, pairs=pairs, ptx=False)
    assert parts.shape == (tokens, k, hidden)
    ref = moe_reference(x.float(), weights, ids, experts)
    assert ref.abs().max() > 1
    assert _rel_err(parts.sum(1), ref) < 2e-2


def test_mxfp4_activations_format():
    """Times 2**64 (exact: a power of two), within every 8 values the order 0, 4, 1, 5, 2, 6, 3, 7."""
    x = torch.randn(2, 16).bfloat16()
    mx = mxfp4_activations(x)
    assert mx.dtype == torch.bfloat16 and mx.shape == x.shape
    order = [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]
    assert torch.equal(mx.float(), x.float()[:, order] * 2.0 ** 64)


def test_add_rmsnorm_writes_the_mxfp4_activation_format():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 96, generator=g).to(DEVICE)
    delta = torch.randn(2, 96, generator=g).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(96, generator=g)).to(DEVICE)
    x_new, y, y_mx = triton_add_rmsnorm(x, delta, weight, 1e-5, True, mxfp4_out=True)
    # one bf16 rounding apart at most: the CPU interpreter rounds fp32 -> bf16 toward zero (the GPU test
    # checks bit equality)
    torch.testing.assert_close(y_mx.float(), mxfp4_activations(y).float(), rtol=1e-2, atol=0)
    assert torch.equal(y, triton_add_rmsnorm(x, delta, weight, 1e-5, True)[1])

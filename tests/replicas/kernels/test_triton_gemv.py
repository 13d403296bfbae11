"""The batch-one dense GEMV (``replicas.kernels.triton_gemv``) against ``F.linear`` on fresh random inputs:
Triton's CPU interpreter here (fp32), the GPU (bf16) in ``tests/gpu``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from replicas.kernels.triton_gemv import triton_gemv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("n,k,with_bias,block_k", [(24, 96, True, 32), (7, 200, False, 64), (16, 64, True, 512)])
def test_gemv_matches_linear(n, k, with_bias, block_k):
    """Several K steps with a masked last one (200 = 3 x 64 + 8), rows not a multiple of the tile."""
    g = torch.Generator().manual_seed(n * k)
    x = torch.randn(1, k, generator=g).to(DEVICE)
    w = torch.randn(n, k, generator=g).to(DEVICE)
    b = torch.randn(n, generator=g).to(DEVICE) if with_bias else None
    ours = triton_gemv(x, w, b, block_n=4, block_k=block_k, num_warps=1)
    torch.testing.assert_close(ours, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_gemv_reads_a_row_view_of_a_larger_weight():
    """The fused qkv weight's row blocks are views (row stride = the full width)."""
    g = torch.Generator().manual_seed(3)
    full = torch.randn(40, 64, generator=g).to(DEVICE)
    x = torch.randn(1, 64, generator=g).to(DEVICE)
    view = full[8:24]
    torch.testing.assert_close(triton_gemv(x, view, block_n=4, block_k=32, num_warps=1), x @ view.T,
                               rtol=1e-5, atol=1e-5)


def test_gemv_rejects_batches():
    with pytest.raises(ValueError, match="expected x"):
        triton_gemv(torch.zeros(2, 8, device=DEVICE), torch.zeros(4, 8, device=DEVICE))


def test_programmatic_dependent_launch_is_off_off_the_gpu():
    """The Triton interpreter and CPU tensors launch without PDL (``replicas.kernels.pdl``; the GPU tests run
    every decode kernel with it on)."""
    from replicas.kernels.pdl import pdl_args

    assert pdl_args(torch.zeros(1)) == {"PDL": False}


@pytest.mark.parametrize("n,k,block_k", [(24, 96, 32), (7, 200, 64)])
def test_gemv_swiglu_epilogue_matches_llama_mlp_input(n, k, block_k):
    """``swiglu=True``: rows ``[0, n)`` gate, ``[n, 2n)`` up; ``silu(gate) * up`` (rows not a multiple of the
    tile, a masked last K step)."""
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=g).to(DEVICE)
    w = torch.randn(2 * n, k, generator=g).to(DEVICE)
    gate, up = (x @ w.T).chunk(2, dim=-1)
    ours = triton_gemv(x, w, block_n=4, block_k=block_k, num_warps=1, swiglu=True)
    assert ours.shape == (1, n)
    torch.testing.assert_close(ours, torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="N even with swiglu"):
        triton_gemv(x, w[:-1], swiglu=True)


@pytest.mark.parametrize("with_delta,swiglu,weight_in_fp32", [(True, False, False), (False, True, False),
                                                               (True, True, True)])
def test_add_rmsnorm_gemv_matches_the_two_steps(with_delta, swiglu, weight_in_fp32):
    """The residual add + RMSNorm recomputed by every program of the projection's launch: the same ``x`` and
    the same projection as ``add_rmsnorm_reference`` then ``F.linear`` (K = 200: not a power of two)."""
    from replicas.kernels.decode_ops import add_rmsnorm_reference
    from replicas.kernels.triton_gemv import triton_add_rmsnorm_gemv

    g = torch.Generator().manual_seed(int(with_delta) + 2 * int(swiglu))
    k, n = 200, 24
    res = torch.randn(1, k, generator=g).to(DEVICE)
    delta = torch.randn(1, k, generator=g).to(DEVICE) if with_delta else None
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(DEVICE)
    w = torch.randn(2 * n if swiglu else n, k, generator=g).to(DEVICE)
    bias = None if swiglu else torch.randn(n, generator=g).to(DEVICE)
    x, y = triton_add_rmsnorm_gemv(res, delta, nw, 1e-5, w, bias, weight_in_fp32=weight_in_fp32, swiglu=swiglu,
                                   num_warps=1)
    x_ref, h = add_rmsnorm_reference(res, delta, nw, 1e-5, weight_in_fp32)
    proj = torch.nn.functional.linear(h, w, bias)
    if swiglu:
        gate, up = proj.chunk(2, dim=-1)
        proj = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(x, x_ref, rtol=0, atol=0)
    torch.testing.assert_close(y, proj, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="weight \\[N, 200\\]"):
        triton_add_rmsnorm_gemv(res, delta, nw, 1e-5, w[:, :100])
    wide = torch.zeros(1, 4160, device=DEVICE)
    with pytest.raises(ValueError, match="K <= 4096"):
        triton_add_rmsnorm_gemv(wide, None, torch.ones(4160, device=DEVICE), 1e-5, torch.zeros(4, 4160, device=DEVICE))

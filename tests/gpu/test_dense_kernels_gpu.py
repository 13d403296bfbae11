"""On an NVIDIA GPU: the batch-one dense GEMV at gpt-oss-120b's projection shapes against an fp32 reference
(fresh random inputs; bf16 weights and activations, fp32 sums, one rounding at the end)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@pytest.mark.parametrize("n,k,bias", [(5120, 2880, True), (2880, 4096, True), (128, 2880, True), (1000, 300, False)])
@pytest.mark.parametrize("block_n,block_k,warps", [(8, 512, 4), (4, 256, 8), (16, 512, 4)])
def test_gemv_at_120b_projection_shapes(n, k, bias, block_n, block_k, warps):
    from replicas.kernels.decode_ops import DecodeOps
    from replicas.kernels.triton_gemv import triton_gemv

    g = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(1, k, generator=g, device="cuda").bfloat16()
    w = (torch.randn(n, k, generator=g, device="cuda") / k ** 0.5).bfloat16()
    b = torch.randn(n, generator=g, device="cuda").bfloat16() if bias else None
    ours = triton_gemv(x, w, b, block_n=block_n, block_k=block_k, num_warps=warps)
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    assert ours.dtype == torch.bfloat16 and ours.shape == (1, n)
    # one bf16 rounding of an fp32 sum: within bf16's half-ulp (2**-9 relative) plus fp32 order noise
    torch.testing.assert_close(ours.float(), ref, rtol=2 ** -8, atol=1e-3)
    ops = DecodeOps.build("cuda", torch.bfloat16)
    assert torch.equal(ops.linear(x, w, b), triton_gemv(x, w, b))  # the dispatcher takes this kernel at batch one

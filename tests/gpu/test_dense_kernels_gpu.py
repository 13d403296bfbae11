"""On an NVIDIA GPU: the batch-one dense GEMV at gpt-oss-120b's projection shapes against an fp32 reference
(fresh random inputs; bf16 weights and activations, fp32 sums, one rounding at the end)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@pytest.mark.parametrize("n,k,bias", [(5120, 2880, True), (2880, 4096, True), (128, 2880, True), (1000, 300, False)])
@pytest.mark.parametrize("block_n,block_k,warps", [(8, 512, 4), (4, 256, 8), (16, 512, 4)])
def test_gemv_at_120b_projection_shapes(n, k, bias, block_n, block_k, warps):
    from replicas.kernels.static_decode import linear
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
    assert torch.equal(linear(x, w, b), triton_gemv(x, w, b))  # the dispatcher takes this kernel at batch one


@pytest.mark.parametrize("n,k,bias", [(5120, 2880, True), (2880, 4096, True), (576, 1536, False), (96, 64, True)])
@pytest.mark.parametrize("rows,stages,per_sm", [(4, 4, 2), (8, 2, 1), (2, 6, 4), (1, 1, 1)])
def test_bulk_copy_gemv_at_120b_projection_shapes(n, k, bias, rows, stages, per_sm, monkeypatch):
    """The CUDA GEMV with bulk-copied weight rows: the same fp32 reference as the Triton GEMV, every tiling
    (tiles that take several turns per block, a single stage), and through the dispatcher when selected."""
    from replicas.kernels import static_decode
    from replicas.kernels.cuda_gemv_bulk import cuda_gemv_bulk

    g = torch.Generator(device="cuda").manual_seed(n + k + 1)
    x = torch.randn(1, k, generator=g, device="cuda").bfloat16()
    w = (torch.randn(n, k, generator=g, device="cuda") / k ** 0.5).bfloat16()
    b = torch.randn(n, generator=g, device="cuda").bfloat16() if bias else None
    ours = cuda_gemv_bulk(x, w, b, rows=rows, stages=stages, blocks_per_sm=per_sm)
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    assert ours.dtype == torch.bfloat16 and ours.shape == (1, n)
    torch.testing.assert_close(ours.float(), ref, rtol=2 ** -8, atol=1e-3)
    monkeypatch.setattr(static_decode, "DENSE_KERNEL", "bulk")
    torch.testing.assert_close(static_decode.linear(x, w, b).float(), ref, rtol=2 ** -8, atol=1e-3)


def test_bulk_copy_gemv_in_a_cuda_graph_and_its_fallbacks(monkeypatch):
    """Captured in a CUDA graph and replayed on new inputs; operands it does not take (fp16, a row count
    that no tile divides, several rows) go to the Triton GEMV or torch through the dispatcher."""
    from replicas.kernels import static_decode
    from replicas.kernels.cuda_gemv_bulk import cuda_gemv_bulk, supports

    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(1, 2880, generator=g, device="cuda").bfloat16()
    w = (torch.randn(640, 2880, generator=g, device="cuda") / 50).bfloat16()
    cuda_gemv_bulk(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = cuda_gemv_bulk(x, w)
    for _ in range(3):
        x.copy_(torch.randn(1, 2880, generator=g, device="cuda"))
        graph.replay()
        torch.testing.assert_close(y.float(), x.float() @ w.float().T, rtol=2 ** -8, atol=1e-3)
    assert not supports(x.half(), w.half()) and not supports(x, w[:, :100]) and not supports(x, w[:638])
    monkeypatch.setattr(static_decode, "DENSE_KERNEL", "bulk")
    odd = w[:638]
    torch.testing.assert_close(static_decode.linear(x, odd).float(), x.float() @ odd.float().T, rtol=2 ** -8,
                               atol=1e-3)
    with pytest.raises(ValueError, match="unsupported"):
        cuda_gemv_bulk(x.repeat(2, 1), w)

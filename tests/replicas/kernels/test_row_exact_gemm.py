"""The row-exact GEMMs (``replicas.kernels.row_exact_gemm``): each row bitwise equal to the same row computed
alone or beside other random rows, for every split factor; and the function ``F.linear`` computes. Triton's
CPU interpreter here (fp32); the same module runs compiled in bf16 on a GPU (``make test-gpu``), where the
tile shapes, not the interpreter's matmul, decide the bits."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from replicas.kernels.row_exact_gemm import chunk_steps, decode_gemm, prefill_gemm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
ROWS = (1, 2, 3, 7, 16, 17, 64, 100, 256) if DEVICE == "cuda" else (1, 2, 3, 17, 33)


def _weights(n: int, k: int, seed: int, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(DEVICE, DTYPE)
    b = torch.randn(n, generator=g).to(DEVICE, DTYPE) if bias else None
    return w, b


def _alone(gemm, row: torch.Tensor, index: int, w, b) -> torch.Tensor:
    """``row`` computed with no other (non-zero) row: alone on the GPU; on the CPU at the same ``index`` of a
    zero matrix, since the interpreter's matmul (numpy's BLAS) rounds a row differently by its position in the
    tile (GPU MMA tiles do not; that is asserted there)."""
    if DEVICE == "cuda":
        return gemm(row[None], w, b)[0]
    x = torch.zeros(index + 1, row.shape[0], dtype=row.dtype)
    x[index] = row
    return gemm(x, w, b)[index]


@pytest.mark.parametrize("gemm", [decode_gemm, prefill_gemm], ids=["decode", "prefill"])
@pytest.mark.parametrize("n,k,bias", [(72, 200, True), (40, 96, False)])
def test_each_row_is_the_same_at_every_row_count(gemm, n, k, bias):
    """Rows of a launch of M rows (the others random each time) equal the same rows computed alone."""
    w, b = _weights(n, k, n * k, bias)
    g = torch.Generator().manual_seed(1)
    for m in ROWS:
        x = torch.randn(m, k, generator=g).to(DEVICE, DTYPE)
        out = gemm(x, w, b)
        for r in sorted({0, m // 2, m - 1}):
            assert torch.equal(out[r], _alone(gemm, x[r], r, w, b)), f"row {r} differs at M={m}"
        torch.testing.assert_close(out.float(), torch.nn.functional.linear(x, w, b).float(),
                                   rtol=2e-2 if DTYPE != torch.float32 else 1e-5,
                                   atol=5e-2 if DTYPE != torch.float32 else 1e-4)


def test_decode_split_factor_does_not_change_the_bits():
    """The chunk sums added in one program or across programs plus the reduce launch: the same additions."""
    w, b = _weights(48, 1000, 5)  # 16 K-steps of 64 (the last masked): 8 chunks of 2 steps
    assert chunk_steps(1000) == 2
    x = torch.randn(3, 1000, generator=torch.Generator().manual_seed(2)).to(DEVICE, DTYPE)
    one = decode_gemm(x, w, b, splits=1)
    for splits in (2, 3, 8, 64):
        assert torch.equal(decode_gemm(x, w, b, splits=splits), one), splits


def test_decode_reads_strided_rows_and_row_views_of_a_larger_weight():
    """The fused qkv weight's row blocks are views; activations may be a strided slice."""
    full, _ = _weights(80, 64, 9, bias=False)
    view = full[16:56]
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(4)).to(DEVICE, DTYPE)[:, ::2]
    torch.testing.assert_close(decode_gemm(x, view).float(), (x @ view.T).float(), rtol=1e-4, atol=1e-4)


def test_shape_errors_are_clear():
    w, b = _weights(8, 32, 0)
    with pytest.raises(ValueError, match="x \\[M, K\\]"):
        decode_gemm(torch.zeros(2, 16, device=DEVICE, dtype=DTYPE), w, b)
    with pytest.raises(ValueError, match="bias"):
        prefill_gemm(torch.zeros(2, 32, device=DEVICE, dtype=DTYPE), w, b[:4])

"""Triton kernel: batch-one dense GEMV ``y = W x + b`` (bf16/fp16 weights, fp32 sums).

At one token, GPT-OSS's attention projections (qkv 2880 → 5120, o 4096 →
2880) and router (2880 → 128) are small enough that cuBLAS's kernel choices
leave bandwidth unused (a split-K kernel plus a reduce launch for the o
projection and the router; ``docs/decisions/0021-triton-batch-one-gemv.md`` has the comparison). Here
one launch reads each weight row once, every
thread issuing its next 16-byte loads before the current step's arithmetic
(a batch-one GEMV has nothing else to hide DRAM latency with), sums in fp32,
adds the bias and rounds once.

Reference: ``torch.nn.functional.linear`` (the same math; fp32 summation order
differs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replicas.kernels.pdl import pdl_args, pdl_wait
from replicas.kernels.triton_rmsnorm import rmsnorm_row


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, stride_wn, res_ptr, nw_ptr, xout_ptr, eps,
                 K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr,
                 NORM: tl.constexpr, HAS_DELTA: tl.constexpr, WEIGHT_FP32: tl.constexpr, PDL: tl.constexpr):
    """Grid ``(cdiv(N, BN),)``: ``y[n] = sum_k W[n, k] x[k] (+ b[n])`` for ``BN`` rows, ``BK`` columns a step.
    With ``SWIGLU`` each program also reads rows ``n + N`` (the up projection under the gate rows ``n``) and
    stores ``silu(gate) * up``. With ``NORM`` (one step: ``BK >= K``) the input is
    ``rmsnorm(res + x)`` (weight ``nw``; ``res`` alone without ``HAS_DELTA``), computed by every program;
    program 0 stores ``res + x`` at ``xout``."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    n_ok = n < N
    if SWIGLU:  # gate rows n, then up rows n + N: one [2 BN] tile
        n2 = tl.reshape(tl.join(n, n + N), [2 * BN])
        ok2 = tl.reshape(tl.join(n_ok, n_ok), [2 * BN])
    else:
        n2 = n
        ok2 = n_ok
    rows = w_ptr + n2.to(tl.int64)[:, None] * stride_wn
    k = tl.arange(0, BK)
    NS: tl.constexpr = (K + BK - 1) // BK
    w = tl.load(rows + k[None, :], mask=ok2[:, None] & (k < K)[None, :], other=0.0)  # weights: before the wait
    pdl_wait(PDL)
    if NORM:  # the whole row: the residual add and the RMSNorm that feed this projection
        x = tl.load(res_ptr + k, mask=k < K, other=0.0)
        if HAS_DELTA:
            x = x + tl.load(x_ptr + k, mask=k < K, other=0.0)  # rounded like torch's add
            if tl.program_id(0) == 0:
                tl.store(xout_ptr + k, x, mask=k < K)
        x = rmsnorm_row(x, tl.load(nw_ptr + k, mask=k < K, other=0.0), K, eps, WEIGHT_FP32)
        x = x.to(res_ptr.dtype.element_ty)
    else:
        x = tl.load(x_ptr + k, mask=k < K, other=0.0)
    for i in tl.static_range(NS):
        if i + 1 < NS:
            kn = (i + 1) * BK + k
            w_next = tl.load(rows + kn[None, :], mask=ok2[:, None] & (kn < K)[None, :], other=0.0)
            x_next = tl.load(x_ptr + kn, mask=kn < K, other=0.0)
        part = w.to(tl.float32) * x.to(tl.float32)[None, :]
        if i == 0:
            acc = part
        else:
            acc += part
        if i + 1 < NS:
            w, x = w_next, x_next
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + n2, mask=ok2, other=0.0).to(tl.float32)
    if SWIGLU:
        gate, up = tl.split(tl.reshape(y, [BN, 2]))
        y = gate * tl.sigmoid(gate) * up
    tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


def _weight_rows(weight: torch.Tensor, k: int, swiglu: bool, who: str) -> tuple[torch.Tensor, int]:
    """``weight`` ``[N, k]`` with unit stride along K (copied if not) and the output count (``N / 2`` with
    ``swiglu``). Raises ValueError (naming ``who``) on another shape or an odd ``N`` with ``swiglu``."""
    if weight.dim() != 2 or weight.shape[1] != k or (swiglu and weight.shape[0] % 2):
        raise ValueError(f"{who}: expected weight [N, {k}] (N even with swiglu), got {tuple(weight.shape)}")
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    return weight, weight.shape[0] // 2 if swiglu else weight.shape[0]


def triton_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                block_n: int = 4, block_k: int | None = None, num_warps: int | None = None,
                swiglu: bool = False, pdl: bool = True) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for one row: ``x`` ``[1, K]``, ``weight`` ``[N, K]`` (unit stride along
    K), ``bias`` ``[N]`` or None → ``[1, N]`` in ``x.dtype``, summed in fp32.

    Tile defaults (``block_k``/``num_warps`` None): 256 columns and 4 warps for outputs wider than 256
    rows (the qkv and o projections), 512 columns and 8 warps for narrower ones such as the router
    (N = 128): the best that ``python -m benchmarks.kernels --kernels dense`` found on an H200 at
    gpt-oss-120b's shapes (``docs/decisions/0021-triton-batch-one-gemv.md``).

    ``swiglu``: ``weight`` is ``[2N, K]``, gate rows over up rows (Llama's fused ``gate_up_proj``), and the
    result is ``silu(gate) * up`` ``[1, N]`` (Shazeer 2020), from the fp32 sums, rounded once.

    Raises:
        ValueError: ``x`` is not one row, or the shapes do not match (an odd row count with ``swiglu``).
    """
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"triton_gemv: expected x [1, K], got {tuple(x.shape)}")
    k = x.shape[1]
    weight, n = _weight_rows(weight, k, swiglu, "triton_gemv")
    narrow = n <= 256
    block_k = block_k or (512 if narrow else 256)
    num_warps = num_warps or (8 if narrow else 4)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x.contiguous(), weight, bias if bias is not None else weight, y, n, weight.stride(0), x, x, x, 0.0,
        K=k, BN=block_n, BK=min(block_k, triton.next_power_of_2(k)), HAS_BIAS=bias is not None, SWIGLU=swiglu,
        NORM=False, HAS_DELTA=False, WEIGHT_FP32=False, num_warps=num_warps, **pdl_args(x, pdl),
    )
    return y


NORM_MAX_K = 4096
"""Widest input :func:`triton_add_rmsnorm_gemv` takes: each program holds its rows whole ([BN, K] in one step)."""


def triton_add_rmsnorm_gemv(residual: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor,
                            eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None,
                            weight_in_fp32: bool = False, swiglu: bool = False, block_n: int = 4,
                            num_warps: int = 4, pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add, the RMSNorm and the projection after them in one launch: ``x = residual + delta``,
    ``(x, F.linear(rmsnorm(x) * norm_weight, weight, bias))`` (with ``swiglu``, as :func:`triton_gemv`).

    Every program recomputes the row's norm (``K`` values, from L2) instead of waiting for a separate
    add + RMSNorm launch; worth it while ``K`` is small (SmolLM2: 576). The norm matches
    :func:`~replicas.kernels.triton_rmsnorm.triton_add_rmsnorm` (Llama's or GPT-OSS's weight convention).

    Args:
        residual: ``[1, K]``; delta: ``[1, K]`` (same dtype) or None (then ``x`` is ``residual``).
        norm_weight: ``[K]``; eps: the norm's epsilon. weight: ``[N, K]`` (``[2N, K]`` with ``swiglu``).

    Returns:
        ``(x [1, K], y [1, N])`` in ``residual.dtype``.

    Raises:
        ValueError: not one row, mismatched shapes, or ``K > NORM_MAX_K``.
    """
    k = residual.shape[-1]
    if residual.dim() != 2 or residual.shape[0] != 1 or k > NORM_MAX_K \
            or (delta is not None and delta.shape != residual.shape):
        raise ValueError(f"triton_add_rmsnorm_gemv: expected residual and delta [1, K <= {NORM_MAX_K}], got "
                         f"{tuple(residual.shape)} and {None if delta is None else tuple(delta.shape)}")
    weight, n = _weight_rows(weight, k, swiglu, "triton_add_rmsnorm_gemv")
    residual = residual.contiguous()
    x_new = torch.empty_like(residual) if delta is not None else residual
    y = torch.empty(1, n, dtype=residual.dtype, device=residual.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        delta.contiguous() if delta is not None else residual, weight, bias if bias is not None else weight, y, n,
        weight.stride(0), residual, norm_weight, x_new, eps,
        K=k, BN=block_n, BK=triton.next_power_of_2(k), HAS_BIAS=bias is not None, SWIGLU=swiglu, NORM=True,
        HAS_DELTA=delta is not None, WEIGHT_FP32=weight_in_fp32, num_warps=num_warps, **pdl_args(residual, pdl),
    )
    return x_new, y

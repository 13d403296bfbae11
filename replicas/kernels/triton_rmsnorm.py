"""Triton kernel: RMSNorm fused with the residual add that precedes it.

``x = x + delta`` (optional), then ``y = rmsnorm(x) * weight``, in one launch
per token row instead of Inductor-less torch's five (add, pow, mean, rsqrt,
mul). RMSNorm: Zhang & Sennrich 2019, ``x / sqrt(mean(x**2) + eps)``, computed
in fp32. The weight is applied either after rounding to the activation dtype
(HF Llama: ``weight * x.to(dtype)``) or in fp32 (HF GPT-OSS:
``(weight * x).to(dtype)``), chosen by ``weight_in_fp32``.
Reference: :func:`replicas.kernels.decode_ops.add_rmsnorm_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replicas.kernels.moe.mma_format import X_SCALE, mma_position
from replicas.kernels.pdl import pdl_args, pdl_wait


@triton.jit
def rmsnorm_row(x, w, N, eps, WEIGHT_FP32: tl.constexpr):
    """RMSNorm of one row ``x`` ``[BLOCK]`` (its ``N`` real elements; the rest zeros) with weight ``w``
    ``[BLOCK]``: fp32 statistics, the weight applied in fp32 (``WEIGHT_FP32``, GPT-OSS) or after rounding to
    ``x.dtype`` (Llama), as :func:`replicas.kernels.reference.rms_norm`."""
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    if WEIGHT_FP32:
        return w.to(tl.float32) * (xf * inv)
    else:
        return w * (xf * inv).to(x.dtype)


@triton.jit
def _add_rmsnorm_kernel(x_ptr, delta_ptr, w_ptr, x_out_ptr, y_ptr, ymx_ptr, N, eps,
                        BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr, WEIGHT_FP32: tl.constexpr,
                        NPART: tl.constexpr, MXFP4_OUT: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)  # a weight: may be read before the wait
    pdl_wait(PDL)
    x = tl.load(x_ptr + row * N + offs, mask=mask, other=0.0)
    if NPART > 0:  # delta: [T, NPART, N] fp32 partial sums, added in order in fp32, rounded once
        acc = x.to(tl.float32)
        for p in tl.static_range(NPART):
            acc += tl.load(delta_ptr + (row * NPART + p) * N + offs, mask=mask, other=0.0)
        x = acc.to(x_ptr.dtype.element_ty)
        tl.store(x_out_ptr + row * N + offs, x, mask=mask)
    elif HAS_DELTA:
        x = x + tl.load(delta_ptr + row * N + offs, mask=mask, other=0.0)  # rounded like torch's add
        tl.store(x_out_ptr + row * N + offs, x, mask=mask)
    y = rmsnorm_row(x, w, N, eps, WEIGHT_FP32).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * N + offs, y, mask=mask)
    if MXFP4_OUT:  # y again in the tensor-core MoE kernels' activation format (mma_format.mxfp4_activations)
        tl.store(ymx_ptr + row * N + mma_position(offs), (y.to(tl.float32) * X_SCALE).to(tl.bfloat16), mask=mask)


def triton_add_rmsnorm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                       weight_in_fp32: bool, mxfp4_out: bool = False, pdl: bool = True) -> tuple[torch.Tensor, ...]:
    """``(x + delta, rmsnorm(x + delta) * weight)`` for ``x``, ``delta`` ``[T, N]`` (same dtype).

    Args:
        x: ``[T, N]`` residual stream; delta: ``[T, N]`` (same dtype), ``[T, P, N]`` fp32 partial sums
            (added to ``x`` in fp32 in order p = 0..P-1, rounded once: the MoE experts' outputs of
            :meth:`replicas.kernels.moe.MoE.partials`), or None (plain RMSNorm,
            ``x`` returned as is).
        weight: ``[N]``; eps: the norm's epsilon (model config ``rms_norm_eps``).
        weight_in_fp32: GPT-OSS convention (weight applied in fp32) vs Llama's (after rounding).

    Returns:
        ``(x_new [T, N] x.dtype, y [T, N] x.dtype)``.
    """
    x = x.contiguous()
    t, n = x.shape
    x_out = torch.empty_like(x) if delta is not None else x
    y = torch.empty_like(x)
    y_mx = torch.empty(t, n, dtype=torch.bfloat16, device=x.device) if mxfp4_out else y
    npart = delta.shape[1] if delta is not None and delta.dim() == 3 else 0
    block = triton.next_power_of_2(n)
    # one program per row: at batch one a single SM reads the row and its partials, so give it enough
    # warps to keep many loads in flight (16 at GPT-OSS's 2880; docs/decisions/0021-triton-batch-one-gemv.md has the timing)
    _add_rmsnorm_kernel[(t,)](x, delta.contiguous() if delta is not None else x, weight, x_out, y, y_mx, n, eps,
                              BLOCK=block, HAS_DELTA=delta is not None, WEIGHT_FP32=weight_in_fp32, NPART=npart,
                              MXFP4_OUT=mxfp4_out, num_warps=min(16, max(4, block // 256)), **pdl_args(x, pdl))
    return (x_out, y, y_mx) if mxfp4_out else (x_out, y)

"""Triton kernels: MXFP4 MoE GEMV through ``tl.dot_scaled`` (Triton's microscaling matmul).

``tl.dot_scaled(x, None, "bf16", w, w_scale, "e2m1")`` multiplies bf16
activations by packed E2M1 weights with per-32-value E8M0 scales; on GPUs
without native FP4 tensor cores (Hopper) Triton upcasts the weight tile to
bf16 in registers with its own bit-level conversion and runs the dot on
tensor cores. Weights are read in their checkpoint layout: the B operand
``[K/2, N]`` (two codes per byte along K, low nibble first — OCP MX v1.0 §5,
transformers' ``_convert_moe_packed_tensors``) is the transposed view of
``*_blocks`` ``[rows, K/2]``; the scales ``[N, K/32]`` are ``*_scales`` as stored.

Per MoE layer for ``T`` tokens with ``K`` experts each (``T * K`` pairs):

1. :func:`_gate_up_kernel` — grid ``(pairs, cdiv(2I, BN))``: ``W_gu[e] x + b``
   for ``BN`` interleaved gate/up rows, then the clamped SwiGLU on the pairs →
   ``h`` ``[pairs, I]`` fp32.
2. :func:`_down_kernel` — grid ``(pairs, cdiv(hidden, BN))``: each routed
   expert's weighted output ``w_k (W_d[e] h + b)`` → partials ``[T, K, hidden]``
   fp32, summed in order by the next add+RMSNorm launch.

The activation is the A operand ``[16, BK]`` (row 0 real: batch one is padded
to the tensor-core minimum). Activations are rounded to bf16 (the model's
dtype in production). Reference: :func:`replicas.kernels.moe.moe_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replicas.models.mxfp4 import BLOCK_SIZE


@triton.jit
def _rows_dot_scaled(blocks_ptr, scales_ptr, x_ptr, rows, row_mask, stride_br, stride_sr, KDIM,
                     BN: tl.constexpr, BK: tl.constexpr):
    """``[BN]`` fp32: packed rows ``rows`` (``[BN]`` int64) · the ``KDIM`` activations at ``x_ptr``."""
    m = tl.arange(0, 16)
    kb = tl.arange(0, BK // 2)  # packed bytes along K
    ks = tl.arange(0, BK // 32)  # scales along K
    kk = tl.arange(0, BK)
    acc = tl.zeros([16, BN], tl.float32)
    for k0 in range(0, KDIM, BK):
        k_ok = (k0 + kk) < KDIM
        xt = tl.load(x_ptr + k0 + kk[None, :] + m[:, None] * 0, mask=(m[:, None] == 0) & k_ok[None, :], other=0.0)
        b_ok = (k0 // 2 + kb) < KDIM // 2
        w = tl.load(blocks_ptr + rows[None, :] * stride_br + (k0 // 2 + kb)[:, None],
                    mask=b_ok[:, None] & row_mask[None, :], other=0)  # [BK/2, BN]
        s_ok = (k0 // 32 + ks) < KDIM // 32
        s = tl.load(scales_ptr + rows[:, None] * stride_sr + (k0 // 32 + ks)[None, :],
                    mask=row_mask[:, None] & s_ok[None, :], other=0)  # [BN, BK/32]
        acc = tl.dot_scaled(xt.to(tl.bfloat16), None, "bf16", w, s, "e2m1", acc)
    return tl.sum(tl.where(m[:, None] == 0, acc, 0.0), axis=0)


@triton.jit
def _gate_up_kernel(
    x_ptr, ids_ptr, blocks_ptr, scales_ptr, bias_ptr, h_ptr,
    stride_be, stride_br, stride_se, stride_sr, stride_bias,
    INTER, alpha, limit,
    K: tl.constexpr, HIDDEN: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    pair = tl.program_id(0)
    token = pair // K
    e = tl.load(ids_ptr + pair).to(tl.int64)
    r = tl.program_id(1) * BN + tl.arange(0, BN)  # interleaved rows: 2j gate, 2j + 1 up
    r_mask = r < 2 * INTER
    v = _rows_dot_scaled(blocks_ptr + e * stride_be, scales_ptr + e * stride_se, x_ptr + token * HIDDEN,
                         r.to(tl.int64), r_mask, stride_br, stride_sr, HIDDEN, BN, BK)
    v += tl.load(bias_ptr + e * stride_bias + r, mask=r_mask, other=0.0).to(tl.float32)
    gate, up = tl.split(tl.reshape(v, (BN // 2, 2)))
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    j = tl.program_id(1) * (BN // 2) + tl.arange(0, BN // 2)
    tl.store(h_ptr + pair * INTER + j, (up + 1.0) * gate * tl.sigmoid(gate * alpha), mask=j < INTER)


@triton.jit
def _down_kernel(
    h_ptr, ids_ptr, w_ptr, blocks_ptr, scales_ptr, bias_ptr, part_ptr,
    stride_be, stride_br, stride_se, stride_sr, stride_bias,
    HIDDEN, INTER,
    BN: tl.constexpr, BK: tl.constexpr,
):
    pair = tl.program_id(0)
    r = tl.program_id(1) * BN + tl.arange(0, BN)
    r_mask = r < HIDDEN
    e = tl.load(ids_ptr + pair).to(tl.int64)
    w = tl.load(w_ptr + pair).to(tl.float32)
    y = _rows_dot_scaled(blocks_ptr + e * stride_be, scales_ptr + e * stride_se, h_ptr + pair * INTER,
                         r.to(tl.int64), r_mask, stride_br, stride_sr, INTER, BN, BK)
    y += tl.load(bias_ptr + e * stride_bias + r, mask=r_mask, other=0.0).to(tl.float32)
    tl.store(part_ptr + pair * HIDDEN + r, w * y, mask=r_mask)


def triton_moe_scaled(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    gate_up_blocks: torch.Tensor, gate_up_scales: torch.Tensor, gate_up_bias: torch.Tensor,
    down_blocks: torch.Tensor, down_scales: torch.Tensor, down_bias: torch.Tensor,
    alpha: float, limit: float, block_n: int = 32, block_k: int = 256, num_warps: int = 4, num_stages: int = 3,
) -> torch.Tensor:
    """Each routed expert's weighted output, ``[T, K, hidden]`` fp32 (two launches).

    Args: as :func:`replicas.kernels.triton_moe.triton_moe`; ``block_n`` output rows and ``block_k``
    input values per step (multiples of 32; ``block_n`` even).

    Returns:
        partials ``p`` with ``x + p.sum(1)`` (in order k = 0..K-1) the MoE layer plus its residual.
    """
    t, hidden = x.shape
    k = ids.shape[1]
    inter = gate_up_blocks.shape[1] // 2
    pairs = t * k
    if hidden % BLOCK_SIZE or inter % BLOCK_SIZE:
        raise ValueError(f"hidden {hidden} and expert width {inter} must be multiples of {BLOCK_SIZE}")
    gu_b = gate_up_blocks.view(gate_up_blocks.shape[0], 2 * inter, hidden // 2)
    dn_b = down_blocks.view(down_blocks.shape[0], hidden, inter // 2)
    x, ids, weights = x.contiguous(), ids.contiguous(), weights.contiguous()
    h = torch.empty(pairs, inter, dtype=torch.float32, device=x.device)
    _gate_up_kernel[(pairs, triton.cdiv(2 * inter, block_n))](
        x, ids, gu_b, gate_up_scales, gate_up_bias, h,
        gu_b.stride(0), gu_b.stride(1), gate_up_scales.stride(0), gate_up_scales.stride(1), gate_up_bias.stride(0),
        inter, alpha, limit, K=k, HIDDEN=hidden, BN=block_n, BK=block_k, num_warps=num_warps, num_stages=num_stages,
    )
    partials = torch.empty(t, k, hidden, dtype=torch.float32, device=x.device)
    _down_kernel[(pairs, triton.cdiv(hidden, block_n))](
        h, ids, weights, dn_b, down_scales, down_bias, partials,
        dn_b.stride(0), dn_b.stride(1), down_scales.stride(0), down_scales.stride(1), down_bias.stride(0),
        hidden, inter, BN=block_n, BK=block_k, num_warps=num_warps, num_stages=num_stages,
    )
    return partials

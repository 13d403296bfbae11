"""Triton kernels: MXFP4 x bf16 mixture-of-experts GEMV for decode (GPT-OSS experts).

Two launches per MoE layer, for ``T`` tokens with ``K`` experts each (batch
one: ``T = 1``; the grouped variant for small batches is the same kernels with
``T > 1``: one (token, expert) pair per program row of the grid):

1. :func:`_gate_up_swiglu_kernel` — for every pair, ``gate_up = W_gu[e] x + b``
   straight from the packed MXFP4 bytes, then GPT-OSS's clamped SwiGLU on the
   interleaved gate/up rows; writes ``h`` ``[T*K, I]`` fp32. Grid
   ``(T*K, cdiv(I, BLOCK_J))``.
2. :func:`_down_sum_kernel` — for every token, ``sum_k w_k (W_d[e_k] h_k + b_d[e_k])``
   (+ an optional residual), in one program per row block, so the K experts
   are summed without atomics (deterministic). Grid ``(T, cdiv(hidden, BLOCK_R))``.

The expert ids and routing weights are read from device memory (no host sync:
capturable in a CUDA graph). Weights are read once per pair; for a large ``T``
(prefill) the dequantize-then-GEMM reference is the better path.

MXFP4 decoding (OCP MX v1.0 §5; byte layout as :mod:`replicas.kernels.moe.mxfp4`):
byte ``j`` of a 16-byte block holds elements ``2j`` (low nibble) and ``2j+1``
(high nibble); E2M1 code ``c`` is sign ``c & 8``, exponent ``(c >> 1) & 3``
(bias 1), mantissa ``c & 1``, read through fp16 (:func:`_e2m1_via_f16`); the block's
E8M0 scale code ``s`` is the fp32 ``2**(s - 127)`` (exponent field ``s``).
Products accumulate in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replicas.kernels.moe.mxfp4 import BLOCK_SIZE, BYTES_PER_BLOCK


@triton.jit
def _e2m1_via_f16(code):
    """E2M1 codes (int32, 0..15) → fp32 value / 2**14 with a few integer ops (fewer than building the
    fp32 bit pattern directly; docs/decisions/0016-deleted-moe-kernels.md compares the two).

    The code's 3 magnitude bits land on fp16's two lowest exponent bits and top mantissa bit, the
    sign on fp16's sign: fp16 then reads ``2**(e-15) (1 + m/2)`` (``e > 0``) or ``m * 2**-15``
    (subnormal, ``e == 0``): exactly the E2M1 value times ``2**-14`` in both cases. The caller
    folds ``2**14`` into the block scale.
    """
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _mxfp4_row_dot(row_ptr, srow_ptr, x_ptr, G, GT: tl.constexpr, BR: tl.constexpr, row_mask):
    """``[BR]`` fp32 dot products of BR packed rows (``row_ptr`` ``[BR]`` byte pointers, ``srow_ptr`` scale
    pointers) with the fp32-castable vector at ``x_ptr`` (``G * 32`` values)."""
    offs_g = tl.arange(0, GT)
    offs_c = tl.arange(0, 16)
    acc = tl.zeros([BR], tl.float32)
    for g0 in range(0, G, GT):
        g = g0 + offs_g
        g_mask = g < G
        m3 = row_mask[:, None, None] & g_mask[None, :, None]
        b = tl.load(row_ptr[:, None, None] + g[None, :, None] * 16 + offs_c[None, None, :], mask=m3, other=0)
        b = b.to(tl.int32)
        xi = g[:, None] * 32 + offs_c[None, :] * 2  # [GT, 16] index of the low-nibble element
        xe = tl.load(x_ptr + xi, mask=g_mask[:, None], other=0.0).to(tl.float32)
        xo = tl.load(x_ptr + xi + 1, mask=g_mask[:, None], other=0.0).to(tl.float32)
        s = tl.load(srow_ptr[:, None] + g[None, :], mask=row_mask[:, None] & g_mask[None, :], other=0)
        part = tl.sum(_e2m1_via_f16(b & 15) * xe[None, :, :] + _e2m1_via_f16(b >> 4) * xo[None, :, :], axis=2)
        scale = ((s.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)  # 2**(s-127) * 2**14
        acc += tl.sum(part * scale, axis=1)
    return acc


@triton.jit
def _gate_up_swiglu_kernel(
    x_ptr, ids_ptr, blocks_ptr, scales_ptr, bias_ptr, h_ptr,
    stride_be, stride_br, stride_se, stride_sr, stride_bias,
    INTER, G, alpha, limit,
    K: tl.constexpr, HIDDEN: tl.constexpr, BJ: tl.constexpr, GT: tl.constexpr,
):
    pair = tl.program_id(0)
    pid = tl.program_id(1)
    token = pair // K
    e = tl.load(ids_ptr + pair).to(tl.int64)
    j = pid * BJ + tl.arange(0, BJ)
    j_mask = j < INTER
    gate_rows = (2 * j).to(tl.int64)
    x = x_ptr + token * HIDDEN
    base = blocks_ptr + e * stride_be
    sbase = scales_ptr + e * stride_se
    gate = _mxfp4_row_dot(base + gate_rows * stride_br, sbase + gate_rows * stride_sr, x, G, GT, BJ, j_mask)
    up = _mxfp4_row_dot(base + (gate_rows + 1) * stride_br, sbase + (gate_rows + 1) * stride_sr, x, G, GT, BJ,
                        j_mask)
    gate += tl.load(bias_ptr + e * stride_bias + 2 * j, mask=j_mask, other=0.0).to(tl.float32)
    up += tl.load(bias_ptr + e * stride_bias + 2 * j + 1, mask=j_mask, other=0.0).to(tl.float32)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    h = (up + 1.0) * gate * tl.sigmoid(gate * alpha)
    tl.store(h_ptr + pair * INTER + j, h, mask=j_mask)


@triton.jit
def _down_sum_kernel(
    h_ptr, ids_ptr, w_ptr, blocks_ptr, scales_ptr, bias_ptr, res_ptr, out_ptr,
    stride_be, stride_br, stride_se, stride_sr, stride_bias,
    HIDDEN, G, INTER,
    K: tl.constexpr, BR: tl.constexpr, GT: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    token = tl.program_id(0)
    r = tl.program_id(1) * BR + tl.arange(0, BR)
    r_mask = r < HIDDEN
    rows = r.to(tl.int64)
    out = tl.zeros([BR], tl.float32)
    for k in range(K):
        pair = token * K + k
        e = tl.load(ids_ptr + pair).to(tl.int64)
        w = tl.load(w_ptr + pair).to(tl.float32)
        y = _mxfp4_row_dot(blocks_ptr + e * stride_be + rows * stride_br, scales_ptr + e * stride_se + rows * stride_sr,
                           h_ptr + pair * INTER, G, GT, BR, r_mask)
        y += tl.load(bias_ptr + e * stride_bias + r, mask=r_mask, other=0.0).to(tl.float32)
        out += w * y
    if HAS_RESIDUAL:
        out += tl.load(res_ptr + token * HIDDEN + r, mask=r_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * HIDDEN + r, out.to(out_ptr.dtype.element_ty), mask=r_mask)


def triton_moe(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    gate_up_blocks: torch.Tensor, gate_up_scales: torch.Tensor, gate_up_bias: torch.Tensor,
    down_blocks: torch.Tensor, down_scales: torch.Tensor, down_bias: torch.Tensor,
    alpha: float, limit: float, residual: torch.Tensor | None = None,
    block_j: int = 8, block_r: int = 8, groups_per_tile: int = 8,
) -> torch.Tensor:
    """MXFP4 MoE for ``T`` tokens: ``residual + sum_k weights[:, k] * expert_{ids[:, k]}(x)``.

    Args:
        x: ``[T, hidden]`` activations (bf16 or fp32), contiguous.
        weights: ``[T, K]`` routing weights; ids: ``[T, K]`` int expert ids (on the device).
        gate_up_blocks: uint8 ``[E, 2I, hidden/32, 16]``; gate_up_scales: uint8 ``[E, 2I, hidden/32]``;
            gate_up_bias: ``[E, 2I]`` (rows interleaved: ``2j`` gate, ``2j+1`` up).
        down_blocks: uint8 ``[E, hidden, I/32, 16]``; down_scales: uint8 ``[E, hidden, I/32]``;
            down_bias: ``[E, hidden]``.
        alpha, limit: the clamped SwiGLU's constants (GPT-OSS: 1.702, 7.0).
        residual: optional ``[T, hidden]`` added to the result (fuses the layer's residual add).
        block_j, block_r, groups_per_tile: tile sizes (SwiGLU outputs per program, output rows per
            program, 32-value groups per inner step).

    Returns:
        ``[T, hidden]`` in ``x.dtype``.
    """
    t, hidden = x.shape
    k = ids.shape[1]
    two_i = gate_up_blocks.shape[1]
    inter = two_i // 2
    for name, tensor in (("gate_up_blocks", gate_up_blocks), ("down_blocks", down_blocks)):
        if tensor.dtype != torch.uint8 or tensor.shape[-1] != BYTES_PER_BLOCK or not tensor.is_contiguous():
            raise ValueError(f"{name}: expected contiguous uint8 [..., G, {BYTES_PER_BLOCK}], got "
                             f"{tensor.dtype} {tuple(tensor.shape)}")
    x = x.contiguous()
    ids = ids.contiguous()
    weights = weights.contiguous()
    h = torch.empty(t * k, inter, dtype=torch.float32, device=x.device)
    _gate_up_swiglu_kernel[(t * k, triton.cdiv(inter, block_j))](
        x, ids, gate_up_blocks, gate_up_scales, gate_up_bias, h,
        gate_up_blocks.stride(0), gate_up_blocks.stride(1), gate_up_scales.stride(0), gate_up_scales.stride(1),
        gate_up_bias.stride(0), inter, hidden // BLOCK_SIZE, alpha, limit,
        K=k, HIDDEN=hidden, BJ=block_j, GT=groups_per_tile,
    )
    out = torch.empty_like(x)
    _down_sum_kernel[(t, triton.cdiv(hidden, block_r))](
        h, ids, weights, down_blocks, down_scales, down_bias, residual if residual is not None else x, out,
        down_blocks.stride(0), down_blocks.stride(1), down_scales.stride(0), down_scales.stride(1),
        down_bias.stride(0), hidden, inter // BLOCK_SIZE, inter,
        K=k, BR=block_r, GT=groups_per_tile, HAS_RESIDUAL=residual is not None,
    )
    return out

"""Triton kernels: MXFP4 MoE GEMV on tensor cores, for NVIDIA GPUs (decode, a few tokens).

Why: decoding E2M1 one value at a time with scalar integer and conversion
instructions costs ~14 instructions per weight, which makes the plain kernels
of :mod:`replicas.kernels.triton_moe` ALU-bound at ~650 GB/s on an H200
(``python -m ops.bench.kernels``). Here four packed bytes (eight E2M1 codes)
are turned into eight fp16 values with ~22 32-bit integer instructions of
inline PTX (``prmt`` + masks/shifts, two values per register), and the dot
products run on tensor cores (``tl.dot``), each 32-value block's E8M0 scale
applied to its partial sums afterwards.

The fp16 trick: a code's magnitude bits ``e1 e0 m`` placed on fp16's two
lowest exponent bits and top mantissa bit (sign on the sign bit) read as
``2**(e-15) * (1 + m/2)`` for ``e > 0`` and ``m * 2**-15`` (subnormal) for
``e = 0`` — the E2M1 value times ``2**-14`` in every case (OCP MX v1.0 §5.3.3
for E2M1), which the scale absorbs: ``2**(s - 127 + 14)``.

Layout of a program's work: ``BR`` weight rows x one 32-value block per step;
the activations enter as the B operand ``[16, 16]`` (even / odd elements of
the block, one real column: N is padded to the tensor-core minimum). Results
are fp32. ``down`` writes each routed expert's weighted output separately
(``[T, K, hidden]`` fp32 partials, no atomics), summed in a fixed order by the
caller (:func:`replicas.kernels.triton_rmsnorm.triton_add_rmsnorm` fuses that
sum with the residual add and the next RMSNorm).

PTX inline assembly cannot run in Triton's CPU interpreter: these kernels are
checked on the GPU (``tests/gpu``) against the same references.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replicas.models.mxfp4 import BLOCK_SIZE

_E2M1_X4_TO_F16 = tl.constexpr("""
{
.reg .b32 t01, t23, a, b, z;
mov.b32 z, 0;
prmt.b32 t01, $4, z, 0x4140;
prmt.b32 t23, $4, z, 0x4342;
and.b32 a, t01, 0x00070007; shl.b32 a, a, 9; and.b32 b, t01, 0x00080008; shl.b32 b, b, 12; or.b32 $0, a, b;
and.b32 a, t23, 0x00070007; shl.b32 a, a, 9; and.b32 b, t23, 0x00080008; shl.b32 b, b, 12; or.b32 $1, a, b;
and.b32 a, t01, 0x00700070; shl.b32 a, a, 5; and.b32 b, t01, 0x00800080; shl.b32 b, b, 8; or.b32 $2, a, b;
and.b32 a, t23, 0x00700070; shl.b32 a, a, 5; and.b32 b, t23, 0x00800080; shl.b32 b, b, 8; or.b32 $3, a, b;
}
""")
"""Four bytes (``$4``) → low-nibble values (``$0``, ``$1``: bytes 0,1 and 2,3 as fp16x2) and high-nibble
values (``$2``, ``$3``), each the E2M1 value times 2**-14. ``prmt`` spreads bytes 0 and 1 (2 and 3) to the
two 16-bit lanes; masks and shifts then place each nibble's bits in its lane."""


@triton.jit
def _e2m1_pairs(b):
    """uint8 ``[..]`` packed bytes → (low-nibble fp16, high-nibble fp16) values times 2**-14."""
    return tl.inline_asm_elementwise(_E2M1_X4_TO_F16, "=r,=r,=r,=r,r", [b], dtype=(tl.float16, tl.float16),
                                     is_pure=True, pack=4)


@triton.jit
def _group_dot(b, x_ptr, srow_ptr, g, valid, row_mask):
    """One 32-value block ``g`` of BR rows: ``[BR, 16]`` fp32 (column 0 real), already scaled."""
    offs = tl.arange(0, 16)
    cols = tl.arange(0, 16)
    lo, hi = _e2m1_pairs(b)
    xi = g * 32 + offs * 2
    xmask = (cols[None, :] == 0) & valid
    xe = tl.load(x_ptr + xi[:, None] + cols[None, :] * 0, mask=xmask, other=0.0).to(tl.float16)
    xo = tl.load(x_ptr + xi[:, None] + 1 + cols[None, :] * 0, mask=xmask, other=0.0).to(tl.float16)
    part = tl.dot(lo, xe) + tl.dot(hi, xo)  # [BR, 16]
    s = tl.load(srow_ptr + g, mask=row_mask & valid, other=0).to(tl.int32)
    scale = ((s + 14) << 23).to(tl.float32, bitcast=True)  # 2**(s - 127) * 2**14
    return part * scale[:, None]


@triton.jit
def _mxfp4_rows_dot_mma(row_ptr, srow_ptr, x_ptr, g_start, g_end, BR: tl.constexpr, row_mask):
    """``[BR]`` fp32: packed rows (byte pointers ``row_ptr [BR]``, scale pointers ``srow_ptr [BR]``) · the
    activations at ``x_ptr``, over 32-value blocks ``g_start .. g_end - 1``.

    Four blocks per step, their byte loads issued together (memory-level parallelism: a batch-one
    GEMV has nothing else to hide DRAM latency with)."""
    offs = tl.arange(0, 16)
    cols = tl.arange(0, 16)
    acc = tl.zeros([BR, 16], tl.float32)
    for g in range(g_start, g_end, 4):
        v0 = g < g_end
        v1 = g + 1 < g_end
        v2 = g + 2 < g_end
        v3 = g + 3 < g_end
        b0 = tl.load(row_ptr[:, None] + g * 16 + offs[None, :], mask=row_mask[:, None] & v0, other=0)
        b1 = tl.load(row_ptr[:, None] + (g + 1) * 16 + offs[None, :], mask=row_mask[:, None] & v1, other=0)
        b2 = tl.load(row_ptr[:, None] + (g + 2) * 16 + offs[None, :], mask=row_mask[:, None] & v2, other=0)
        b3 = tl.load(row_ptr[:, None] + (g + 3) * 16 + offs[None, :], mask=row_mask[:, None] & v3, other=0)
        acc += _group_dot(b0, x_ptr, srow_ptr, g, v0, row_mask)
        acc += _group_dot(b1, x_ptr, srow_ptr, g + 1, v1, row_mask)
        acc += _group_dot(b2, x_ptr, srow_ptr, g + 2, v2, row_mask)
        acc += _group_dot(b3, x_ptr, srow_ptr, g + 3, v3, row_mask)
    return tl.sum(tl.where(cols[None, :] == 0, acc, 0.0), axis=1)


@triton.jit
def _gate_up_mma_kernel(
    x_ptr, ids_ptr, blocks_ptr, scales_ptr, gu_ptr,
    stride_be, stride_br, stride_se, stride_sr,
    INTER, G, GS, PAIRS,
    K: tl.constexpr, HIDDEN: tl.constexpr, BJ: tl.constexpr,
):
    """Grid ``(pairs, cdiv(I, BJ), splits)``: partial gate and up sums of blocks ``split*GS ..`` →
    ``gu[split, pair, 0|1, j]`` fp32 (no bias)."""
    pair = tl.program_id(0)
    pid = tl.program_id(1)
    split = tl.program_id(2)
    token = pair // K
    e = tl.load(ids_ptr + pair).to(tl.int64)
    j = pid * BJ + tl.arange(0, BJ)
    j_mask = j < INTER
    rows = (2 * j).to(tl.int64)
    x = x_ptr + token * HIDDEN
    base = blocks_ptr + e * stride_be
    sbase = scales_ptr + e * stride_se
    g0 = split * GS
    g1 = tl.minimum(g0 + GS, G)
    gate = _mxfp4_rows_dot_mma(base + rows * stride_br, sbase + rows * stride_sr, x, g0, g1, BJ, j_mask)
    up = _mxfp4_rows_dot_mma(base + (rows + 1) * stride_br, sbase + (rows + 1) * stride_sr, x, g0, g1, BJ, j_mask)
    out = gu_ptr + ((split * PAIRS + pair) * 2) * INTER + j
    tl.store(out, gate, mask=j_mask)
    tl.store(out + INTER, up, mask=j_mask)


@triton.jit
def _swiglu_kernel(gu_ptr, bias_ptr, ids_ptr, h_ptr, INTER, PAIRS, stride_bias, alpha, limit,
                   SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """Grid ``(pairs, cdiv(I, BLOCK))``: sum the split partials, add the bias, clamped SwiGLU → ``h`` fp32."""
    pair = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = j < INTER
    e = tl.load(ids_ptr + pair).to(tl.int64)
    gate = tl.load(bias_ptr + e * stride_bias + 2 * j, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(bias_ptr + e * stride_bias + 2 * j + 1, mask=mask, other=0.0).to(tl.float32)
    for sp in tl.static_range(SPLITS):
        row = gu_ptr + ((sp * PAIRS + pair) * 2) * INTER + j
        gate += tl.load(row, mask=mask, other=0.0)
        up += tl.load(row + INTER, mask=mask, other=0.0)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    tl.store(h_ptr + pair * INTER + j, (up + 1.0) * gate * tl.sigmoid(gate * alpha), mask=mask)


@triton.jit
def _down_mma_kernel(
    h_ptr, ids_ptr, w_ptr, blocks_ptr, scales_ptr, bias_ptr, part_ptr,
    stride_be, stride_br, stride_se, stride_sr, stride_bias,
    HIDDEN, G, GS, INTER,
    K: tl.constexpr, BR: tl.constexpr, SPLITS: tl.constexpr,
):
    """Grid ``(pairs, cdiv(hidden, BR), splits)``: ``part[token, k * SPLITS + split] = w_k * (W_d h)`` over
    blocks ``split*GS ..``, the bias added by split 0."""
    pair = tl.program_id(0)
    r = tl.program_id(1) * BR + tl.arange(0, BR)
    split = tl.program_id(2)
    r_mask = r < HIDDEN
    rows = r.to(tl.int64)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    w = tl.load(w_ptr + pair).to(tl.float32)
    g0 = split * GS
    g1 = tl.minimum(g0 + GS, G)
    y = _mxfp4_rows_dot_mma(blocks_ptr + e * stride_be + rows * stride_br,
                            scales_ptr + e * stride_se + rows * stride_sr, h_ptr + pair * INTER, g0, g1, BR, r_mask)
    y += tl.load(bias_ptr + e * stride_bias + r, mask=r_mask & (split == 0), other=0.0).to(tl.float32)
    tl.store(part_ptr + (pair * SPLITS + split) * HIDDEN + r, w * y, mask=r_mask)


def triton_moe_partials(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    gate_up_blocks: torch.Tensor, gate_up_scales: torch.Tensor, gate_up_bias: torch.Tensor,
    down_blocks: torch.Tensor, down_scales: torch.Tensor, down_bias: torch.Tensor,
    alpha: float, limit: float, block_j: int = 32, block_r: int = 32, splits: int = 5, num_warps: int = 2,
    num_stages: int = 1,
) -> torch.Tensor:
    """Per routed expert and K-split, its weighted output (three launches: gate_up, SwiGLU, down).

    Args: as :func:`replicas.kernels.triton_moe.triton_moe` (``x`` ``[T, hidden]`` bf16/fp16/fp32;
    activations must fit fp16: GPT-OSS's normed inputs and clamped SwiGLU outputs do), plus
    ``splits``: programs sharing one row block along the input dimension (more loads in flight).
    Defaults: the fastest of ``python -m ops.bench.kernels`` on an H200 at gpt-oss-120b's shape.

    Returns:
        ``[T, K * splits, hidden]`` fp32 partials; ``x + partials.sum(1)`` (in order) is the MoE layer
        with its residual.
    """
    t, hidden = x.shape
    k = ids.shape[1]
    inter = gate_up_blocks.shape[1] // 2
    pairs = t * k
    x, ids, weights = x.contiguous(), ids.contiguous(), weights.contiguous()
    g_in, g_mid = hidden // BLOCK_SIZE, inter // BLOCK_SIZE
    gs_in, gs_mid = triton.cdiv(g_in, splits), triton.cdiv(g_mid, splits)
    gu = torch.empty(splits, pairs, 2, inter, dtype=torch.float32, device=x.device)
    _gate_up_mma_kernel[(pairs, triton.cdiv(inter, block_j), splits)](
        x, ids, gate_up_blocks, gate_up_scales, gu,
        gate_up_blocks.stride(0), gate_up_blocks.stride(1), gate_up_scales.stride(0), gate_up_scales.stride(1),
        inter, g_in, gs_in, pairs, K=k, HIDDEN=hidden, BJ=block_j, num_warps=num_warps, num_stages=num_stages,
    )
    h = torch.empty(pairs, inter, dtype=torch.float32, device=x.device)
    _swiglu_kernel[(pairs, triton.cdiv(inter, 1024))](
        gu, gate_up_bias, ids, h, inter, pairs, gate_up_bias.stride(0), alpha, limit, SPLITS=splits, BLOCK=1024,
    )
    partials = torch.empty(t, k * splits, hidden, dtype=torch.float32, device=x.device)
    _down_mma_kernel[(pairs, triton.cdiv(hidden, block_r), splits)](
        h, ids, weights, down_blocks, down_scales, down_bias, partials,
        down_blocks.stride(0), down_blocks.stride(1), down_scales.stride(0), down_scales.stride(1),
        down_bias.stride(0), hidden, g_mid, gs_mid, inter,
        K=k, BR=block_r, SPLITS=splits, num_warps=num_warps, num_stages=num_stages,
    )
    return partials

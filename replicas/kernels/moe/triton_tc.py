"""Triton kernels: MXFP4 MoE GEMV on the tensor cores through inline-PTX ``mma.sync`` (decode, few tokens).

At batch one an MXFP4 GEMV is bound by its instruction stream, not by DRAM:
the SIMT kernel (:mod:`replicas.kernels.moe.triton_fp32`) spends about 4.5
instructions per weight (3.25 to decode an E2M1 code into an fp32 bit pattern,
one fp32 FMA, the activations' conversion). Here each code is decoded into a
*bf16* bit pattern two at a time (about 1.9 integer instructions per weight)
and the multiply-adds run on the tensor cores (one ``mma.m16n8k16`` per 256
weights), accumulating in fp32.

The MMA fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16"): lane ``t``
of a warp holds A rows ``t/4`` and ``t/4 + 8`` at the k-columns of its quad
position ``q = t % 4``. Each lane loads, per step, one 32-value block (16
bytes) of each of its two rows: block ``4 * step + q``, so the four lanes of a
quad hold four *different* blocks, with four different E8M0 scales, of the
same rows. The activations therefore enter as a diagonal B operand: lane ``t``
supplies its block's activations only in MMA column ``n = 2q`` (only lanes with
``t // 4 == 2q`` load them; the others read a zero buffer), so column ``2q`` of
the result is block ``q``'s partial dot product, and it lands in the
accumulator (``c0`` for row ``t/4``, ``c2`` for ``t/4 + 8``) of the very lane that
loaded that block. Each lane scales its partial sums in fp32 and accumulates;
a row's sum over blocks is one reduction over the quad (``shfl``) and one over
the warps that split the row (shared memory), at the end.

Nothing here depends on how Triton lays tensors out (Triton 3.6 and 3.9 lay
the same ``[rows, 4, 16]`` byte tile out differently): the PTX path works on
one-element-per-thread tensors, every lane computes its rows and blocks from
``%tid.x`` and loads with inline PTX, and results are stored through computed
indices.

Bit tricks (OCP MX v1.0 §5.3.3 for E2M1; bf16 is fp32's top half): a code's
magnitude bits ``e1 e0 m`` on bf16 bits 8..6 and its sign on bit 15 read as the
E2M1 value times ``2**-126`` (``e = 0`` gives bf16 subnormals, which the tensor
cores take as they are: the GPU tests check every code). Two codes fill one
bf16x2 register with two shifts, one mask and one ``lop3``. The
activations come pre-scaled by ``2**64`` (so no product underflows fp32) and
pre-permuted into the same code pairs, written by the kernel that produces
them (:func:`mxfp4_activations`): the gate_up kernel writes the down kernel's
input that way, and :func:`~replicas.kernels.triton_rmsnorm.triton_add_rmsnorm`
can write the gate_up input that way. Products of a bf16 code and a bf16
activation are exact in fp32; the MMA sums them in fp32. Limit of the scaling:
E8M0 scales up to ``2**65`` (trained weights use about ``2**-10 .. 2**2``).

Two launches per MoE layer, ``T`` tokens with ``K`` experts each (one (token,
expert) pair per grid row), the same outputs as the SIMT kernels: gate_up
(bias and GPT-OSS's clamped SwiGLU fused, ``h`` written as bf16 activations in
the MMA format) and down (bias, times the routing weight, fp32 partials
``[T, K, hidden]`` that :func:`~replicas.kernels.triton_rmsnorm.triton_add_rmsnorm`
sums in a fixed order with the residual).

Triton's CPU interpreter cannot run PTX: with ``PTX=False`` the kernels compute
the same blocks' partial sums with plain Triton operations (for the CPU tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replicas.kernels.moe.mma_format import (
    X_SCALE,
    X_SHIFT,
    mma_asm,
    mma_position,
    mxfp4_activations,
)
from replicas.kernels.moe.mxfp4 import BLOCK_SIZE, check_packed_moe
from replicas.kernels.pdl import pdl_args, pdl_wait

_MMA_ASM = tl.constexpr(mma_asm())
_MMA_CONSTRAINTS = tl.constexpr("=r,=r," + ",".join(["r"] * 24))

_LOAD_ASM = tl.constexpr("""
ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$26];
ld.global.nc.v4.b32 {$4, $5, $6, $7}, [$27];
ld.global.nc.u8 $8, [$28];
ld.global.nc.u8 $9, [$29];
ld.global.v4.b32 {$10, $11, $12, $13}, [$30];
ld.global.v4.b32 {$14, $15, $16, $17}, [$30+16];
ld.global.v4.b32 {$18, $19, $20, $21}, [$30+32];
ld.global.v4.b32 {$22, $23, $24, $25}, [$30+48];
""")
"""One lane's step, all its loads issued together: the 16 packed bytes of its block in row a (``$26``) and
row b (``$27``), the two scales (``$28``, ``$29``), the block's 32 activations (``$30``, 64 bytes). Weights
go through the read-only path (``.nc``); the activations, written by the launch before (which may still be
running when this one starts, under programmatic dependent launch), do not."""
_LOAD_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 26) + ",l,l,l,l,l")

_LOAD_W_ASM = tl.constexpr("""
ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$10];
ld.global.nc.v4.b32 {$4, $5, $6, $7}, [$11];
ld.global.nc.u8 $8, [$12];
ld.global.nc.u8 $9, [$13];
""")
"""A lane's second row pair (``PAIRS = 2``): its block's bytes in rows c (``$10``) and d (``$11``), their scales
(``$12``, ``$13``); the activations are the first pair's."""
_LOAD_W_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 10) + ",l,l,l,l")

_QUAD_SUM_ASM = tl.constexpr("""
{
.reg .f32 t, u;
shfl.sync.bfly.b32 t, $1, 1, 0x1f, 0xffffffff;
add.f32 u, $1, t;
shfl.sync.bfly.b32 t, u, 2, 0x1f, 0xffffffff;
add.f32 $0, u, t;
}
""")
"""The sum over the four lanes of a quad (``t ^ 1``, ``t ^ 2``): a row's partial sums over its blocks."""


@triton.jit
def _thread_ids(NT: tl.constexpr):
    """``[NT]`` int32: each thread's ``%tid.x`` (one element per thread: NT = 32 * num_warps)."""
    return tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r,r", [tl.zeros([NT], tl.int32)], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _lane_load(row_a, row_b, srow_a, srow_b, q, supplier, x_ptr, zero_ptr, i, G: tl.constexpr):
    """Issue step ``i``'s loads for this lane (block ``g = 4 i + q``; past the row's end a valid block is
    re-read and the activations come from the zero buffer, so the block adds nothing)."""
    g = 4 * i + q
    ok = g < G
    gc = tl.minimum(g, G - 1)
    xp = tl.where(supplier & ok, x_ptr + 128 * i, zero_ptr)
    return tl.inline_asm_elementwise(_LOAD_ASM, _LOAD_CONSTRAINTS,
                                     [(row_a + gc * 16).to(tl.int64), (row_b + gc * 16).to(tl.int64),
                                      (srow_a + gc).to(tl.int64), (srow_b + gc).to(tl.int64), xp.to(tl.int64)],
                                     dtype=(tl.int32,) * 26, is_pure=True, pack=1)


@triton.jit
def _lane_load_w(row_c, row_d, srow_c, srow_d, q, i, G: tl.constexpr):
    """Issue step ``i``'s weight loads of this lane's second row pair (as :func:`_lane_load`, no activations)."""
    gc = tl.minimum(4 * i + q, G - 1)
    return tl.inline_asm_elementwise(_LOAD_W_ASM, _LOAD_W_CONSTRAINTS,
                                     [(row_c + gc * 16).to(tl.int64), (row_d + gc * 16).to(tl.int64),
                                      (srow_c + gc).to(tl.int64), (srow_d + gc).to(tl.int64)],
                                     dtype=(tl.int32,) * 10, is_pure=True, pack=1)


@triton.jit
def _lane_math(v, acc_a, acc_b, xv):
    """Step math for one lane and one row pair: 8 MMAs over its loaded block (``v``: the 8 words and 2 scales
    of :func:`_lane_load` or :func:`_lane_load_w`; ``xv``: the :func:`_lane_load` holding the activations),
    the two block sums times their scales ``2**(s - 127)`` (and the ``2**-62`` of the encodings) into the
    fp32 accumulators."""
    c_a, c_b = tl.inline_asm_elementwise(
        _MMA_ASM, _MMA_CONSTRAINTS,
        [v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], xv[10], xv[11], xv[12], xv[13], xv[14], xv[15], xv[16],
         xv[17], xv[18], xv[19], xv[20], xv[21], xv[22], xv[23], xv[24], xv[25]],
        dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    acc_a += c_a * ((v[8] + (126 - X_SHIFT)) << 23).to(tl.float32, bitcast=True)  # 2**(s-127+126-64)
    acc_b += c_b * ((v[9] + (126 - X_SHIFT)) << 23).to(tl.float32, bitcast=True)
    return acc_a, acc_b


@triton.jit
def _lane_rows_dot(row_a, row_b, srow_a, srow_b, row_c, row_d, srow_c, srow_d, q, kw, supplier, x_ptr, zero_ptr,
                   G: tl.constexpr, KW: tl.constexpr, DEPTH: tl.constexpr, PAIRS: tl.constexpr):
    """Inline-PTX path, one element per thread: this lane's rows ``a`` and ``b`` (byte pointers of their
    block 0, scale pointers likewise) · the activations in the MMA format at ``x_ptr`` (times 2**64; this
    lane's block 0; lanes that are not a ``supplier`` of the B operand read ``zero_ptr``), over the steps
    ``kw, kw + KW, ...`` of this lane's warp (``KW`` warps split the row) and the blocks ``4 step + q`` of its
    quad position ``q``; with ``PAIRS = 2`` rows ``c`` and ``d`` as well, sharing the activations. Returns the
    rows' sums over those blocks (fp32, the same in all four lanes of the quad; ``c``, ``d`` zeros when
    ``PAIRS = 1``). Loads run ``DEPTH`` (1 or 2) steps ahead of the MMAs."""
    NS: tl.constexpr = (G + 3) // 4
    NL: tl.constexpr = (NS + KW - 1) // KW
    acc_a = tl.zeros(q.shape, tl.float32)
    acc_b = tl.zeros(q.shape, tl.float32)
    acc_c = tl.zeros(q.shape, tl.float32)
    acc_d = tl.zeros(q.shape, tl.float32)
    cur = _lane_load(row_a, row_b, srow_a, srow_b, q, supplier, x_ptr, zero_ptr, kw, G)
    if PAIRS == 2:
        cur2 = _lane_load_w(row_c, row_d, srow_c, srow_d, q, kw, G)
    if DEPTH == 2 and NL > 1:
        nxt = _lane_load(row_a, row_b, srow_a, srow_b, q, supplier, x_ptr, zero_ptr, KW + kw, G)
        if PAIRS == 2:
            nxt2 = _lane_load_w(row_c, row_d, srow_c, srow_d, q, KW + kw, G)
    for ii in tl.static_range(NL):
        if ii + DEPTH < NL:
            new = _lane_load(row_a, row_b, srow_a, srow_b, q, supplier, x_ptr, zero_ptr, (ii + DEPTH) * KW + kw, G)
            if PAIRS == 2:
                new2 = _lane_load_w(row_c, row_d, srow_c, srow_d, q, (ii + DEPTH) * KW + kw, G)
        acc_a, acc_b = _lane_math(cur, acc_a, acc_b, cur)
        if PAIRS == 2:
            acc_c, acc_d = _lane_math(cur2, acc_c, acc_d, cur)
        if DEPTH == 2:
            if ii + 1 < NL:
                cur = nxt
                if PAIRS == 2:
                    cur2 = nxt2
            if ii + 2 < NL:
                nxt = new
                if PAIRS == 2:
                    nxt2 = new2
        else:
            if ii + 1 < NL:
                cur = new
                if PAIRS == 2:
                    cur2 = new2
    y_a = tl.inline_asm_elementwise(_QUAD_SUM_ASM, "=r,r", [acc_a], dtype=tl.float32, is_pure=True, pack=1)
    y_b = tl.inline_asm_elementwise(_QUAD_SUM_ASM, "=r,r", [acc_b], dtype=tl.float32, is_pure=True, pack=1)
    if PAIRS == 2:
        acc_c = tl.inline_asm_elementwise(_QUAD_SUM_ASM, "=r,r", [acc_c], dtype=tl.float32, is_pure=True, pack=1)
        acc_d = tl.inline_asm_elementwise(_QUAD_SUM_ASM, "=r,r", [acc_d], dtype=tl.float32, is_pure=True, pack=1)
    return y_a, y_b, acc_c, acc_d


@triton.jit
def _unpermuted_x(xa_ptr, g, G: tl.constexpr):
    """Plain-Triton path: activations ``[GB, 16]`` of the even and of the odd codes of blocks ``g``, in code
    order, read from the MMA format (:func:`mma_position`)."""
    j = tl.arange(0, 16)
    pe = mma_position(2 * j)
    po = mma_position(2 * j + 1)
    ok = (g < G)[:, None]
    xe = tl.load(xa_ptr + g[:, None] * 32 + pe[None, :], mask=ok, other=0.0).to(tl.float32)
    xo = tl.load(xa_ptr + g[:, None] * 32 + po[None, :], mask=ok, other=0.0).to(tl.float32)
    return xe, xo


@triton.jit
def _load_step(row_ptr, srow_ptr, row_ok, g0, G: tl.constexpr):
    """Blocks ``g0 .. g0+3`` of the rows: packed bytes ``[R, 4, 16]`` and E8M0 scales ``[R, 4]`` (zeros past
    the row's end)."""
    g = g0 + tl.arange(0, 4)
    c = tl.arange(0, 16)
    b = tl.load(row_ptr[:, None, None] + g[None, :, None] * 16 + c[None, None, :],
                mask=row_ok[:, None, None] & (g < G)[None, :, None], other=0)
    s = tl.load(srow_ptr[:, None] + g[None, :], mask=row_ok[:, None] & (g < G)[None, :], other=0)
    return b, s


@triton.jit
def _step_partials(b, xa_ptr, g0, G: tl.constexpr):
    """Plain-Triton path: ``[R, 4]`` fp32, bytes ``b`` ``[R, 4, 16]`` of blocks ``g0 .. g0+3`` · their
    activations (unscaled: codes times 2**-126, activations times 2**64)."""
    xe, xo = _unpermuted_x(xa_ptr, g0 + tl.arange(0, 4), G)
    ci = b.to(tl.int32)
    lo = (((ci & 7) << 22) | ((ci & 8) << 28)).to(tl.float32, bitcast=True)
    hi = (((ci & 0x70) << 18) | ((ci & 0x80) << 24)).to(tl.float32, bitcast=True)
    return tl.sum(lo * xe[None, :, :] + hi * xo[None, :, :], axis=2)


@triton.jit
def _rows_dot_plain(row_ptr, srow_ptr, row_ok, xa_ptr, G: tl.constexpr):
    """Plain-Triton path: ``[R]`` fp32, packed rows (``row_ptr``/``srow_ptr`` ``[R]`` byte pointers) · the
    activations in the MMA format at ``xa_ptr`` (times 2**64)."""
    NS: tl.constexpr = (G + 3) // 4
    acc = tl.zeros([row_ptr.shape[0], 4], tl.float32)
    b, s = _load_step(row_ptr, srow_ptr, row_ok, 0, G)
    for i in tl.static_range(NS):
        if i + 1 < NS:
            b_next, s_next = _load_step(row_ptr, srow_ptr, row_ok, 4 * (i + 1), G)
        part = _step_partials(b, xa_ptr, 4 * i, G)
        acc += part * ((s.to(tl.int32) + (126 - X_SHIFT)) << 23).to(tl.float32, bitcast=True)  # 2**(s-127+126-64)
        if i + 1 < NS:
            b, s = b_next, s_next
    return tl.sum(acc, axis=1)


@triton.jit
def _lanes(W: tl.constexpr):
    """Per thread (``[32 * W]``, one element each): its warp ``kw`` (which steps of the row it takes), quad
    position ``q = lane % 4`` (which block of a step), quad ``r8 = lane // 4`` (which rows) and whether it
    supplies the MMA's B operand (``r8 == 2 q``)."""
    tid = _thread_ids(32 * W)
    lane = tid % 32
    q = lane % 4
    r8 = lane // 4
    return tid // 32, q, r8, r8 == 2 * q


@triton.jit
def _warp_sum(y, W: tl.constexpr):
    """``[32 * W]`` per-thread values → ``[32]``: element ``l`` sums lane ``l`` of every warp (the warps
    split the row's blocks). Element ``i`` of a ``[32 * W]`` tensor lives in thread ``i``."""
    return tl.sum(tl.reshape(y, [W, 32]), axis=0)


@triton.jit
def _swiglu_store(gate, up, j, keep, bias_ptr, ha_ptr, INTER, alpha, limit):
    """Bias, GPT-OSS's clamped SwiGLU, ``h[j]`` stored in the MMA activation format (bf16, times 2**64, at
    :func:`mma_position`)."""
    jc = tl.minimum(j, INTER - 1)
    gate = tl.minimum(gate + tl.load(bias_ptr + 2 * jc).to(tl.float32), limit)
    up = tl.minimum(tl.maximum(up + tl.load(bias_ptr + 2 * jc + 1).to(tl.float32), -limit), limit)
    h = (up + 1.0) * gate * tl.sigmoid(gate * alpha) * X_SCALE
    tl.store(ha_ptr + mma_position(j), h.to(tl.bfloat16), mask=keep & (j < INTER))


@triton.jit
def _gate_up_tc_kernel(
    xa_ptr, ids_ptr, blocks_ptr, scales_ptr, bias_ptr, ha_ptr, zero_ptr,
    stride_be, stride_br, stride_se, stride_sr, stride_bias, stride_xa, stride_ha,
    INTER, alpha, limit,
    K: tl.constexpr, G: tl.constexpr, W: tl.constexpr, DEPTH: tl.constexpr, PAIRS: tl.constexpr,
    PTX: tl.constexpr, PDL: tl.constexpr,
):
    """Grid ``(pairs, cdiv(I, 8 PAIRS))``: ``h[pair, j] = swiglu(W_gu[e] x + b)`` for ``8 PAIRS`` outputs ``j``
    (rows ``2j``, gate, and ``2j + 1``, up), written in the MMA activation format (bf16, times 2**64, code
    pairs permuted). The ``W`` warps split the rows' blocks."""
    pair = tl.program_id(0)
    token = pair // K
    pdl_wait(PDL)  # the expert ids come from the launch just before
    e = tl.load(ids_ptr + pair).to(tl.int64)
    blocks = blocks_ptr + e * stride_be
    scales = scales_ptr + e * stride_se
    bias = bias_ptr + e * stride_bias
    x_row = xa_ptr + token * stride_xa
    h_row = ha_ptr + pair * stride_ha
    j0 = tl.program_id(1) * (8 * PAIRS)
    if PTX:
        kw, q, r8, supplier = _lanes(W)
        ja = tl.minimum(j0 + r8, INTER - 1).to(tl.int64)  # lane rows: gate 2j, up 2j + 1 (and j + 8)
        jb = tl.minimum(j0 + 8 + r8, INTER - 1).to(tl.int64)
        gate, up, gate2, up2 = _lane_rows_dot(
            blocks + 2 * ja * stride_br, blocks + (2 * ja + 1) * stride_br, scales + 2 * ja * stride_sr,
            scales + (2 * ja + 1) * stride_sr, blocks + 2 * jb * stride_br, blocks + (2 * jb + 1) * stride_br,
            scales + 2 * jb * stride_sr, scales + (2 * jb + 1) * stride_sr,
            q, kw, supplier, x_row + q * 32, zero_ptr, G, W, DEPTH, PAIRS)
        lane = tl.arange(0, 32)
        j = j0 + lane // 4
        _swiglu_store(_warp_sum(gate, W), _warp_sum(up, W), j, lane % 4 == 0, bias, h_row, INTER, alpha, limit)
        if PAIRS == 2:
            _swiglu_store(_warp_sum(gate2, W), _warp_sum(up2, W), j + 8, lane % 4 == 0, bias, h_row, INTER,
                          alpha, limit)
    else:
        rows = 2 * j0 + tl.arange(0, 16 * PAIRS)  # gate 2j, up 2j + 1, interleaved
        row_ok = rows < 2 * INTER
        y = _rows_dot_plain(blocks + rows.to(tl.int64) * stride_br, scales + rows.to(tl.int64) * stride_sr,
                            row_ok, x_row, G)
        gate, up = tl.split(tl.reshape(y, [8 * PAIRS, 2]))
        j = j0 + tl.arange(0, 8 * PAIRS)
        _swiglu_store(gate, up, j, j < INTER, bias, h_row, INTER, alpha, limit)


@triton.jit
def _down_store(y, r, keep, w, bias, out, HIDDEN):
    """``out[r] = w * (y + bias[r])`` where ``keep`` and ``r < HIDDEN``."""
    y += tl.load(bias + tl.minimum(r, HIDDEN - 1)).to(tl.float32)
    tl.store(out + r, w * y, mask=keep & (r < HIDDEN))


@triton.jit
def _down_tc_kernel(
    ha_ptr, ids_ptr, w_ptr, blocks_ptr, scales_ptr, bias_ptr, part_ptr, zero_ptr,
    stride_be, stride_br, stride_se, stride_sr, stride_bias, stride_ha, HIDDEN,
    G: tl.constexpr, W: tl.constexpr, DEPTH: tl.constexpr, PAIRS: tl.constexpr, PTX: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid ``(pairs, cdiv(hidden, 16 PAIRS))``: ``part[pair, r] = w_pair * (W_d[e] h_pair + b)[r]`` for
    ``16 PAIRS`` rows; the ``W`` warps split the rows' blocks."""
    pair = tl.program_id(0)
    e = tl.load(ids_ptr + pair).to(tl.int64)  # routing: two launches back (see replicas.kernels.pdl)
    w = tl.load(w_ptr + pair).to(tl.float32)
    pdl_wait(PDL)
    blocks = blocks_ptr + e * stride_be
    scales = scales_ptr + e * stride_se
    x_row = ha_ptr + pair * stride_ha
    bias = bias_ptr + e * stride_bias
    out = part_ptr + pair * HIDDEN
    r0 = tl.program_id(1) * (16 * PAIRS)
    if PTX:
        kw, q, r8, supplier = _lanes(W)
        ca = tl.minimum(r0 + r8, HIDDEN - 1).to(tl.int64)  # lane rows a, a + 8 (and a + 16, a + 24)
        cb = tl.minimum(r0 + r8 + 8, HIDDEN - 1).to(tl.int64)
        cc = tl.minimum(r0 + r8 + 16, HIDDEN - 1).to(tl.int64)
        cd = tl.minimum(r0 + r8 + 24, HIDDEN - 1).to(tl.int64)
        y_a, y_b, y_c, y_d = _lane_rows_dot(
            blocks + ca * stride_br, blocks + cb * stride_br, scales + ca * stride_sr, scales + cb * stride_sr,
            blocks + cc * stride_br, blocks + cd * stride_br, scales + cc * stride_sr, scales + cd * stride_sr,
            q, kw, supplier, x_row + q * 32, zero_ptr, G, W, DEPTH, PAIRS)
        lane = tl.arange(0, 32)
        r = r0 + lane // 4
        keep = lane % 4 == 0
        _down_store(_warp_sum(y_a, W), r, keep, w, bias, out, HIDDEN)
        _down_store(_warp_sum(y_b, W), r + 8, keep, w, bias, out, HIDDEN)
        if PAIRS == 2:
            _down_store(_warp_sum(y_c, W), r + 16, keep, w, bias, out, HIDDEN)
            _down_store(_warp_sum(y_d, W), r + 24, keep, w, bias, out, HIDDEN)
    else:
        r = r0 + tl.arange(0, 16 * PAIRS)
        y = _rows_dot_plain(blocks + r.to(tl.int64) * stride_br, scales + r.to(tl.int64) * stride_sr, r < HIDDEN,
                            x_row, G)
        _down_store(y, r, r < HIDDEN, w, bias, out, HIDDEN)


_ZEROS: dict[torch.device, torch.Tensor] = {}


def _zeros(device: torch.device) -> torch.Tensor:
    """64 zero bytes on ``device``: where the MMA's non-supplying lanes read their activations."""
    if device not in _ZEROS:
        _ZEROS[device] = torch.zeros(32, dtype=torch.bfloat16, device=device)
    return _ZEROS[device]


def triton_moe_tc(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    gate_up_blocks: torch.Tensor, gate_up_scales: torch.Tensor, gate_up_bias: torch.Tensor,
    down_blocks: torch.Tensor, down_scales: torch.Tensor, down_bias: torch.Tensor,
    alpha: float, limit: float, x_mxfp4: torch.Tensor | None = None, num_warps: int = 4,
    down_num_warps: int | None = 8, depth: int = 1, down_depth: int | None = 2, pairs: int = 1,
    down_pairs: int | None = 2, ptx: bool | None = None, pdl: bool = True,
) -> torch.Tensor:
    """Per routed expert, its weighted output: ``[T, K, hidden]`` fp32 (two launches).

    Args:
        x: ``[T, hidden]`` activations (bf16 or fp16; rounded to bf16); weights: ``[T, K]`` routing weights;
            ids: ``[T, K]`` int expert ids (on the device: no host sync, capturable).
        gate_up_blocks: uint8 ``[E, 2I, hidden/32, 16]``, gate_up_scales: uint8 ``[E, 2I, hidden/32]``,
            gate_up_bias ``[E, 2I]`` (rows interleaved: ``2j`` gate, ``2j+1`` up).
        down_blocks: uint8 ``[E, hidden, I/32, 16]``, down_scales: uint8 ``[E, hidden, I/32]``,
            down_bias ``[E, hidden]``.
        alpha, limit: the clamped SwiGLU's constants (GPT-OSS: 1.702, 7.0).
        x_mxfp4: ``x`` already in the MMA format (:func:`mxfp4_activations`), e.g. written by the
            add+RMSNorm launch that produced ``x``; computed here (torch ops) when None.
        num_warps: per program (16 rows); the warps split the rows' 32-value blocks. down_num_warps: the
            down launch's (None: ``num_warps``). Defaults of all tiles: the best that ``python -m
            benchmarks.kernels --kernels triton_tc`` found on an H200 at gpt-oss-120b's shape (docs/decisions/0018-bulk-moe-grid-and-tiles.md).
        depth: steps of loads in flight ahead of the MMAs (1 or 2); down_depth: the down launch's (None:
            ``depth``).
        pairs: row pairs per lane (1 or 2: 16 or 32 rows per program, the second pair sharing the first's
            activations); down_pairs: the down launch's (None: ``pairs``).
        ptx: the inline-PTX tensor-core path (default: on CUDA); False runs plain Triton (interpreter).

    Returns:
        ``[T, K, hidden]`` fp32; ``x + out.sum(1)`` (in order) is the MoE layer with its residual.

    Raises:
        ValueError: packed tensors not contiguous uint8 ``[..., G, 16]``, or widths not multiples of 32.
    """
    t, hidden, k, inter = check_packed_moe(x, ids, gate_up_blocks, down_blocks)
    if ptx is None:
        ptx = x.is_cuda and not torch.version.hip
    tiles = {"num_warps": num_warps, "down_num_warps": down_num_warps or num_warps, "depth": depth,
             "down_depth": down_depth or depth, "pairs": pairs, "down_pairs": down_pairs or pairs}
    if x_mxfp4 is None:
        x_mxfp4 = mxfp4_activations(x)
    pairs_n = t * k  # (token, expert) pairs
    ids, weights = ids.contiguous(), weights.contiguous()
    zero = _zeros(x.device)
    h = torch.empty(pairs_n, inter, dtype=torch.bfloat16, device=x.device)
    _gate_up_tc_kernel[(pairs_n, triton.cdiv(inter, 8 * tiles["pairs"]))](
        x_mxfp4, ids, gate_up_blocks, gate_up_scales, gate_up_bias, h, zero,
        gate_up_blocks.stride(0), gate_up_blocks.stride(1), gate_up_scales.stride(0), gate_up_scales.stride(1),
        gate_up_bias.stride(0), x_mxfp4.stride(0), h.stride(0), inter, alpha, limit,
        K=k, G=hidden // BLOCK_SIZE, W=tiles["num_warps"], DEPTH=tiles["depth"], PAIRS=tiles["pairs"], PTX=ptx,
        num_warps=tiles["num_warps"], **pdl_args(x, pdl),
    )
    out = torch.empty(t, k, hidden, dtype=torch.float32, device=x.device)
    _down_tc_kernel[(pairs_n, triton.cdiv(hidden, 16 * tiles["down_pairs"]))](
        h, ids, weights, down_blocks, down_scales, down_bias, out, zero,
        down_blocks.stride(0), down_blocks.stride(1), down_scales.stride(0), down_scales.stride(1),
        down_bias.stride(0), h.stride(0), hidden,
        G=inter // BLOCK_SIZE, W=tiles["down_num_warps"], DEPTH=tiles["down_depth"], PAIRS=tiles["down_pairs"],
        PTX=ptx, num_warps=tiles["down_num_warps"], **pdl_args(x, pdl),
    )
    return out

"""Grouped MXFP4 MoE GEMMs on the tensor cores: prefill and batched decode of GPT-OSS's experts.

For ``T`` tokens routed to ``K`` experts each, the ``P = T * K`` (token, expert)
pairs are grouped by expert on the device (:func:`group_by_expert`: a stable
sort of the expert ids, per-expert offsets, and a map from M-blocks of
``BLOCK_M`` sorted pairs to their expert), so that one launch multiplies every
expert's rows by that expert's weights (a ragged grouped GEMM, as in
MegaBlocks, Gale et al. 2023, and vLLM's ``fused_moe``). Nothing is copied to
the host: the grid is the static upper bound ``cdiv(P, BLOCK_M) + min(E, P)``
of M-blocks, and programs past the last used block exit at once, so the same
launches are CUDA-graph capturable at a fixed ``T``.

Two launches per MoE layer:

1. gate_up: ``h = clamped_swiglu(x W_gu[e]^T + b_gu[e])`` ``[P, I]`` (sorted
   pair order) in the activations' dtype; the bias and GPT-OSS's clamped SwiGLU
   (alpha 1.702, limit 7.0, gate and up rows interleaved: output column ``2j``
   is gate ``j``, ``2j + 1`` up ``j``; transformers' ``GptOssExperts``) run in
   the epilogue on the fp32 accumulator.
2. down: ``y = (h W_d[e]^T + b_d[e]) * routing_weight`` written in fp32 per
   pair, ``[T, K, hidden]``: the caller sums the ``K`` partials in a fixed
   order (no atomics: deterministic), e.g. fused with the residual add and the
   next RMSNorm.

Weights stay packed MXFP4 (OCP Microscaling Formats v1.0, §5: 32 E2M1 codes
share one E8M0 scale) and are decoded in the kernel, one 32-bit word (8 codes,
code ``c`` in bits ``4c..4c+3``) at a time, from either layout the model holds:

* the checkpoint's (``*_blocks`` uint8 ``[E, rows, G, 16]``, low nibble first):
  each code's magnitude bits ``e1 e0 m`` are moved onto fp32's lowest exponent
  bits and top mantissa bit, its sign onto bit 31, which reads as the E2M1 value
  times ``2**-126`` (subnormal for the codes 0 and 0.5: exact);
* :mod:`replicas.kernels.moe.decode_layout`'s bit layout (the experts are
  repacked into it at load on Hopper): four masks and shifts per word give
  four bf16x2 code pairs ``(p, p + 4)``, each half the value times ``2**-126``,
  widened to fp32 by a shift or a mask.

Then one multiply by ``2**(s - 65)`` (the E8M0 scale ``2**(s - 127)`` with the
``2**126`` put back, and ``2**-64`` more so that the factor is a normal fp32
number for every code ``s <= 192``; the accumulator is multiplied by ``2**64``
once at the end) and a rounding to the activations' dtype. Both are exact (a
power of two; an MXFP4 value has two significand bits) for every scale code
``s >= 66``, i.e. down to weights of ``2**-62``; GPT-OSS's codes sit near 120.
The tensor cores (``tl.dot``; every dimension at least 16) multiply bf16 (or,
for fp32 models, IEEE fp32) operands with fp32 accumulation.

Each K step of ``BLOCK_K`` inputs decodes one ``[BLOCK_N, BLOCK_K]`` weight tile
in registers, in element order (the eight codes of each word joined), and makes
it the *left* operand of a single ``tl.dot`` against ``[BLOCK_K, BLOCK_M]``
activations (on Hopper a wgmma takes its left operand from registers; the
activations go through shared memory by ``cp.async``, pipelined, and each step's
MMA overlaps the next step's decode). For bf16 on the GPU with the decode layout,
each code pair is scaled by one ``mul.rn.bf16x2`` on its bf16x2 pattern (the
factor ``2**(s - 65)`` is a normal bf16, so the same exactness holds) instead of
two fp32 widenings, two multiplies and a rounding. Earlier variants (eight dots
per K step against activations permuted per chunk, each dot waited for; weights
on the right) and what they measured are in ``docs/decisions/0022-grouped-gemm-one-dot-per-k-step.md``.

Reference: :func:`replicas.kernels.moe.moe_reference` (each routed expert
dequantized, dense GEMMs, the same math as transformers' ``GptOssExperts``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from replicas.kernels.moe import decode_layout as layout

_PAIR_MASK = tl.constexpr(layout.PAIR_MASK)
_PAIR3_MASK = tl.constexpr(layout.PAIR3_MASK)
_SHIFT1 = tl.constexpr(layout.PAIR_SHIFTS[1])
_SHIFT2 = tl.constexpr(layout.PAIR_SHIFTS[2])
_MAG3_A = tl.constexpr(layout.PAIR3_MAGNITUDE_SHIFTS[0])
_MAG3_B = tl.constexpr(layout.PAIR3_MAGNITUDE_SHIFTS[1])
_SIGN3 = tl.constexpr(layout.PAIR3_SIGN_SHIFT)

VALUES_PER_BLOCK = 32
"""E2M1 values sharing one E8M0 scale (OCP MX v1.0, §5)."""

ACC_SCALE = tl.constexpr(18446744073709551616.0)
"""``2**64``: the decoded weights carry ``2**-64`` (see the module docstring); the accumulators get it back."""


@dataclass(frozen=True)
class TileConfig:
    """One launch's tile shape: ``BLOCK_M`` sorted pairs x ``BLOCK_N`` output columns (weight rows),
    ``BLOCK_K`` inputs per step (a power of two, at least 32), ``num_warps``, ``num_stages`` (software
    pipelining)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


TILES = {m: TileConfig(m, 128, 64, 4, 4) for m in (16, 32, 64, 128)}
"""Tile shape per ``BLOCK_M`` (chosen by :func:`pick_block_m` from the pairs per expert): ``BLOCK_M`` pairs
per program, ``block_n`` weight rows per program (the left operand), ``block_k`` inputs per K step (a power of
two, at least 32: one scale group), four pipeline stages. One shape for every height and both kernels: in the
H200 sweep (``docs/decisions/0022-grouped-gemm-one-dot-per-k-step.md``) it was within 5% of the best tile of
each kernel at 64 to 8,192 tokens, and wider K steps spill registers at ``BLOCK_M`` 64 and 128."""



def pick_block_m(num_pairs: int, num_experts: int) -> int:
    """``BLOCK_M``: a power of two (16..128: ``tl.dot`` needs 16, past 128 the tile no longer fits the
    registers) at least the mean pairs per expert plus two standard deviations of a Poisson count
    (``m + 2 sqrt(m)``), so that most experts fit one M-block and their weights are decoded once."""
    mean = num_pairs / max(1, num_experts)
    return min(128, max(16, triton.next_power_of_2(math.ceil(mean + 2 * math.sqrt(mean)))))


def token_counts_per_block_m(num_experts: int, top_k: int, min_tokens: int, max_tokens: int) -> dict[int, int]:
    """The smallest token count in ``[min_tokens, max_tokens]`` that :func:`pick_block_m` gives each M-block
    height (``{block_m: tokens}``; a height no count in the range reaches is left out). Each height is its own
    compiled kernel: a warm-up that runs these counts compiles every one before serving."""
    out: dict[int, int] = {}
    for t in range(max(1, min_tokens), max_tokens + 1):
        block_m = pick_block_m(t * top_k, num_experts)
        out.setdefault(block_m, t)
        if block_m == max(TILES):  # heights only grow with t
            break
    return out


def tile_config(block_m: int) -> TileConfig:
    """The tile of :data:`TILES` for an M-block height."""
    return TILES[block_m]


@dataclass
class ExpertGrouping:
    """The ``P`` (token, expert) pairs sorted by expert, on the device (:func:`group_by_expert`).

    Attributes:
        order: ``[P]`` int32 pair indices (``token * K + slot``), grouped by expert, token order within one.
        expert_start: ``[E + 1]`` int32 offsets of each expert's pairs in ``order``.
        block_expert: ``[max_blocks]`` int32 expert of each ``BLOCK_M``-row block (``E``: unused block).
        block_row: ``[max_blocks]`` int32 first row of each block in ``order``.
        block_m: rows per block; max_blocks: the grid's static bound ``cdiv(P, BLOCK_M) + min(E, P)``.
    """

    order: torch.Tensor
    expert_start: torch.Tensor
    block_expert: torch.Tensor
    block_row: torch.Tensor
    block_m: int
    max_blocks: int


def group_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertGrouping:
    """Group the pairs of ``ids`` ``[T, K]`` (int, expert ids) by expert, with device ops only (no host sync;
    capturable). Counting is an integer scatter-add and the sort is stable: deterministic."""
    flat = ids.reshape(-1)
    p = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int64))
    order = torch.sort(flat, stable=True).indices.to(torch.int32)
    expert_start = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    torch.cumsum(counts, 0, out=expert_start[1:])
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)  # [E] inclusive
    max_blocks = -(-p // block_m) + min(num_experts, p)
    b = torch.arange(max_blocks, device=dev)
    block_expert = torch.searchsorted(block_end, b, right=True)  # [max_blocks]; E past the last block
    e = block_expert.clamp(max=num_experts - 1)
    block_row = expert_start[e] + (b - (block_end[e] - blocks[e])) * block_m
    return ExpertGrouping(order, expert_start.to(torch.int32), block_expert.to(torch.int32),
                          block_row.to(torch.int32), block_m, max_blocks)


GROUP_CHUNK = 64
"""Pairs per program of :func:`triton_group_by_expert` (a ``[GROUP_CHUNK, E]`` one-hot tile each).

Its three kernels take the pair count (and the counts derived from it) unspecialized (``do_not_specialize``):
Triton would otherwise compile a variant per divisibility by 16 of each of them, and a serving step of a new
token count (a prefill chunk beside a few decodes) would pay that compilation inside a request."""


@triton.jit(do_not_specialize=["P"])
def _count_kernel(ids_ptr, counts_ptr, P, E, C: tl.constexpr, EP: tl.constexpr):
    """Grid ``(chunks,)``: ``counts[chunk, e]`` = pairs of the chunk routed to expert ``e``."""
    c = tl.program_id(0)
    rows = c * C + tl.arange(0, C)
    cols = tl.arange(0, EP)
    e = tl.load(ids_ptr + rows, mask=rows < P, other=EP).to(tl.int32)
    hot = (e[:, None] == cols[None, :]).to(tl.int32)
    tl.store(counts_ptr + c * EP + cols, tl.sum(hot, 0))


@triton.jit(do_not_specialize=["chunks", "max_blocks"])
def _offsets_kernel(counts_ptr, expert_start_ptr, block_expert_ptr, block_row_ptr, chunks, E, max_blocks,
                    BLOCK_M: tl.constexpr, EP: tl.constexpr, CB: tl.constexpr, BB: tl.constexpr):
    """One program: per-expert totals, ``expert_start``, each chunk's first slot per expert (``counts``
    rewritten in place to absolute offsets: ``expert_start[e]`` + the pairs of ``e`` in earlier chunks), and
    the block map (as :func:`group_by_expert`: blocks past the last hold ``E``). ``counts`` is read ``CB``
    chunks at a time."""
    cols = tl.arange(0, EP)
    crow = tl.arange(0, CB)
    total = tl.zeros([EP], tl.int32)
    for c0 in range(0, chunks, CB):
        r = c0 + crow
        total += tl.sum(tl.load(counts_ptr + r[:, None] * EP + cols[None, :], mask=(r < chunks)[:, None], other=0), 0)
    incl = tl.cumsum(total, 0)
    start = incl - total
    tl.store(expert_start_ptr + cols + 1, incl, mask=cols < E)
    tl.store(expert_start_ptr + cols, start, mask=cols == 0)
    run = start
    for c0 in range(0, chunks, CB):
        r = c0 + crow
        ptrs = counts_ptr + r[:, None] * EP + cols[None, :]
        ok = (r < chunks)[:, None]
        tile = tl.load(ptrs, mask=ok, other=0)
        tl.store(ptrs, run[None, :] + tl.cumsum(tile, 0) - tile, mask=ok)
        run += tl.sum(tile, 0)
    blocks = tl.where(cols < E, (total + BLOCK_M - 1) // BLOCK_M, 0)
    block_end = tl.cumsum(blocks, 0)
    first_row = start - (block_end - blocks) * BLOCK_M  # row of block b of expert e: first_row[e] + b * BLOCK_M
    last = E - 1
    for b0 in range(0, max_blocks, BB):
        b = b0 + tl.arange(0, BB)
        done = (block_end[None, :] <= b[:, None]) & (cols < E)[None, :]
        be = tl.sum(done.to(tl.int32), 1)  # searchsorted(block_end, b, right=True)
        pick = cols[None, :] == tl.minimum(be, last)[:, None]
        row = tl.sum(tl.where(pick, first_row[None, :], 0), 1) + b * BLOCK_M
        tl.store(block_expert_ptr + b, be, mask=b < max_blocks)
        tl.store(block_row_ptr + b, row, mask=b < max_blocks)


@triton.jit(do_not_specialize=["P"])
def _place_kernel(ids_ptr, offsets_ptr, order_ptr, P, C: tl.constexpr, EP: tl.constexpr):
    """Grid ``(chunks,)``: pair ``p``'s place in ``order`` = its chunk's offset for its expert + the pairs of
    that expert before it in the chunk (a stable placement)."""
    c = tl.program_id(0)
    rows = c * C + tl.arange(0, C)
    cols = tl.arange(0, EP)
    ok = rows < P
    e = tl.load(ids_ptr + rows, mask=ok, other=EP).to(tl.int32)
    hot = e[:, None] == cols[None, :]
    before = tl.cumsum(hot.to(tl.int32), 0) - 1  # [C, EP]: earlier pairs of each column's expert, inclusive - 1
    off = tl.load(offsets_ptr + c * EP + cols)
    dest = tl.sum(tl.where(hot, before + off[None, :], 0), 1)
    tl.store(order_ptr + dest, rows, mask=ok)


def triton_group_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertGrouping:
    """:func:`group_by_expert` in three small Triton launches instead of about twenty torch ones (counts per
    chunk of :data:`GROUP_CHUNK` pairs; one program for the offsets and the block map; the stable placement),
    with the same result (no atomics: deterministic). No host sync; capturable.

    Raises:
        ValueError: ``ids`` is not ``[T, K]`` integers, or ``num_experts`` < 1."""
    if ids.dim() != 2 or ids.dtype.is_floating_point or num_experts < 1:
        raise ValueError(f"expected integer expert ids [T, K] and num_experts >= 1, got {ids.dtype} "
                         f"{tuple(ids.shape)}, {num_experts}")
    flat = ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    p = flat.numel()
    dev = flat.device
    ep = triton.next_power_of_2(num_experts)
    chunks = max(1, triton.cdiv(p, GROUP_CHUNK))
    max_blocks = -(-p // block_m) + min(num_experts, p)
    counts = torch.empty(chunks, ep, dtype=torch.int32, device=dev)
    order = torch.empty(p, dtype=torch.int32, device=dev)
    expert_start = torch.empty(num_experts + 1, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max(max_blocks, 1), dtype=torch.int32, device=dev)
    block_row = torch.empty(max(max_blocks, 1), dtype=torch.int32, device=dev)
    _count_kernel[(chunks,)](flat, counts, p, num_experts, C=GROUP_CHUNK, EP=ep, num_warps=4)
    _offsets_kernel[(1,)](counts, expert_start, block_expert, block_row, chunks, num_experts, max_blocks,
                          BLOCK_M=block_m, EP=ep, CB=32, BB=64, num_warps=4)
    _place_kernel[(chunks,)](flat, counts, order, p, C=GROUP_CHUNK, EP=ep, num_warps=4)
    return ExpertGrouping(order, expert_start, block_expert[:max_blocks], block_row[:max_blocks], block_m, max_blocks)


@triton.jit
def _code_f32(w, c: tl.constexpr):
    """Code ``c`` of uint32 words ``w`` (checkpoint layout: bits ``4c..4c+3``) → fp32, the E2M1 value x 2**-126."""
    mag = ((w >> (4 * c)) & 7) << 22
    sign = ((w >> (4 * c)) & 8) << 28
    return (mag | sign).to(tl.float32, bitcast=True)


@triton.jit
def _pair_patterns(w):
    """Decode-layout words (uint32) → their four bf16x2 code-pair patterns ``(p, p + 4)``, ``p = 0..3``
    (:mod:`replicas.kernels.moe.decode_layout`: a mask, two shift-and-masks, and pair 3's gather)."""
    v = w & _PAIR3_MASK
    return (w & _PAIR_MASK, (w << _SHIFT1) & _PAIR_MASK, (w << _SHIFT2) & _PAIR_MASK,
            ((v >> _MAG3_A) | (v >> _MAG3_B) | (v << _SIGN3)) & _PAIR_MASK)


@triton.jit
def _pair_f32(pair):
    """bf16x2 code-pair patterns (uint32) → (low code, high code) fp32, each the value x 2**-126."""
    return (pair << 16).to(tl.float32, bitcast=True), (pair & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _codes(w, REPACKED: tl.constexpr):
    """uint32 words ``[R, W]`` → the 8 codes of each word as 8 fp32 ``[R, W]`` tensors (code ``c`` =
    element ``8 w + c``), each the E2M1 value x 2**-126."""
    if REPACKED:
        p0, p1, p2, p3 = _pair_patterns(w)
        c0, c4 = _pair_f32(p0)
        c1, c5 = _pair_f32(p1)
        c2, c6 = _pair_f32(p2)
        c3, c7 = _pair_f32(p3)
    else:
        c0 = _code_f32(w, 0)
        c1 = _code_f32(w, 1)
        c2 = _code_f32(w, 2)
        c3 = _code_f32(w, 3)
        c4 = _code_f32(w, 4)
        c5 = _code_f32(w, 5)
        c6 = _code_f32(w, 6)
        c7 = _code_f32(w, 7)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _scaled_pair_bf16(pair, scale2):
    """bf16x2 code-pair patterns (uint32, each half the E2M1 value x 2**-126) times ``scale2`` (uint32, a bf16
    power of two in both halves) with one ``mul.rn.bf16x2`` (PTX ISA, half-precision arithmetic) → (low code,
    high code) bf16. Exact for the scale range of the module docstring; GPU only (the interpreter cannot run
    inline PTX)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t; mul.rn.bf16x2 t, $2, $3; mov.b32 {$0, $1}, t; }",
        "=h,=h,r,r", [pair, scale2], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)


@triton.jit
def _per_word(x, BLOCK_N: tl.constexpr, G: tl.constexpr):
    """``[BLOCK_N, G]`` per-scale-group values → ``[BLOCK_N, 4 G]``, one per packed word (4 words share a scale)."""
    return tl.reshape(tl.broadcast_to(x[:, :, None], [BLOCK_N, G, 4]), [BLOCK_N, 4 * G])


@triton.jit
def _weight_tile(w_ptr, s_ptr, row, n_ok, k0, KDIM: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_N: tl.constexpr, REPACKED: tl.constexpr, BF16X2: tl.constexpr, dt: tl.constexpr):
    """Weight rows ``row`` ``[BLOCK_N]`` (int64, ``expert * N + n``), inputs ``k0 .. k0 + BLOCK_K`` decoded to
    ``[BLOCK_N, BLOCK_K]`` in ``dt``, element order, times ``2**-64`` (the module docstring). ``BF16X2``
    (decode layout, bf16, GPU): each code pair scaled by one bf16x2 multiply; else each code widened to fp32,
    scaled, rounded. The scales are loaded once per 32 inputs and broadcast to the 4 words they cover."""
    WORDS: tl.constexpr = BLOCK_K // 8
    G: tl.constexpr = BLOCK_K // 32
    GROUPS: tl.constexpr = KDIM // 32
    kw = k0 // 8 + tl.arange(0, WORDS)
    ok = n_ok[:, None] & ((kw * 8) < KDIM)[None, :]
    wd = tl.load(w_ptr + row[:, None] * (KDIM // 8) + kw[None, :], mask=ok, other=0).to(tl.uint32, bitcast=True)
    kg = k0 // 32 + tl.arange(0, G)
    sg = tl.load(s_ptr + row[:, None] * GROUPS + kg[None, :], mask=n_ok[:, None] & (kg < GROUPS)[None, :],
                 other=127)
    if BF16X2:
        half = (sg.to(tl.uint32) + (127 - 65)) << 7  # bf16 2**(s - 65)
        f2 = _per_word(half | (half << 16), BLOCK_N, G)
        p0, p1, p2, p3 = _pair_patterns(wd)
        c0, c4 = _scaled_pair_bf16(p0, f2)
        c1, c5 = _scaled_pair_bf16(p1, f2)
        c2, c6 = _scaled_pair_bf16(p2, f2)
        c3, c7 = _scaled_pair_bf16(p3, f2)
    else:
        f = _per_word(((sg.to(tl.int32) + (127 - 65)) << 23).to(tl.float32, bitcast=True), BLOCK_N, G)  # 2**(s-65)
        d0, d1, d2, d3, d4, d5, d6, d7 = _codes(wd, REPACKED)
        c0, c1, c2, c3 = (d0 * f).to(dt), (d1 * f).to(dt), (d2 * f).to(dt), (d3 * f).to(dt)
        c4, c5, c6, c7 = (d4 * f).to(dt), (d5 * f).to(dt), (d6 * f).to(dt), (d7 * f).to(dt)
    # element 8 w + c: the last three joined axes are bits 2, 1, 0 of c
    tile = tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7)))
    return tl.reshape(tile, [BLOCK_N, BLOCK_K])


@triton.jit
def _mainloop(acc, a_ptr, a_row, a_ok, w_ptr, s_ptr, e, n, n_ok, N, KDIM: tl.constexpr, BLOCK_K: tl.constexpr,
              REPACKED: tl.constexpr, BF16X2: tl.constexpr, PRECISION: tl.constexpr):
    """``acc [BLOCK_N, BLOCK_M] += W[e][n, :] @ A[rows, :]^T``: per K step one weight tile decoded in registers
    (:func:`_weight_tile`) as the *left* operand of one ``tl.dot`` (on Hopper a wgmma reads it from registers)
    against ``[BLOCK_K, BLOCK_M]`` activations, which the compiler stages through shared memory with
    ``cp.async`` and overlaps with the previous step's MMA.

    ``a_row`` ``[BLOCK_M]`` int64 element offsets of the activation rows (row width ``KDIM``), ``a_ok`` their
    mask."""
    row = e.to(tl.int64) * N + n
    dt: tl.constexpr = a_ptr.dtype.element_ty
    BLOCK_N: tl.constexpr = acc.shape[0]
    kk = tl.arange(0, BLOCK_K)
    for k0 in range(0, KDIM, BLOCK_K):
        w = _weight_tile(w_ptr, s_ptr, row, n_ok, k0, KDIM, BLOCK_K, BLOCK_N, REPACKED, BF16X2, dt)
        k = k0 + kk
        a = tl.load(a_ptr + a_row[None, :] + k[:, None], mask=a_ok[None, :] & (k < KDIM)[:, None], other=0.0)
        acc = tl.dot(w, a, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _gate_up_kernel(x_ptr, order_ptr, block_expert_ptr, block_row_ptr, expert_start_ptr, w_ptr, s_ptr,
                    b_ptr, h_ptr, alpha, limit, stride_x, stride_h, N, E, TOP_K: tl.constexpr,
                    KDIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, REPACKED: tl.constexpr, BF16X2: tl.constexpr,
                    PRECISION: tl.constexpr):
    """Grid ``(max_blocks, cdiv(2I, BLOCK_N))``: ``h[rows, cols] = swiglu(x[token(rows)] W^T + b)``, ``N = 2I``,
    weights on the left (:func:`_mainloop`)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= E:
        return
    row0 = tl.load(block_row_ptr + pid_m)
    row_end = tl.load(expert_start_ptr + e + 1)
    rows = row0 + tl.arange(0, BLOCK_M)
    r_ok = rows < row_end
    pair = tl.load(order_ptr + rows, mask=r_ok, other=0)
    tok = (pair // TOP_K).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc = _mainloop(acc, x_ptr, tok * stride_x, r_ok, w_ptr, s_ptr, e, n, n_ok, N, KDIM, BLOCK_K, REPACKED, BF16X2,
                    PRECISION)
    acc = acc * ACC_SCALE + tl.load(b_ptr + e.to(tl.int64) * N + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    gate, up = tl.split(tl.reshape(tl.trans(acc), [BLOCK_M, BLOCK_N // 2, 2]))
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    h = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    tl.store(h_ptr + rows.to(tl.int64)[:, None] * stride_h + cols[None, :], h.to(h_ptr.dtype.element_ty),
             mask=r_ok[:, None] & (cols < N // 2)[None, :])


@triton.jit
def _down_kernel(h_ptr, order_ptr, block_expert_ptr, block_row_ptr, expert_start_ptr, w_ptr, s_ptr, b_ptr,
                 rw_ptr, y_ptr, stride_h, N, E, KDIM: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, REPACKED: tl.constexpr, BF16X2: tl.constexpr,
                 PRECISION: tl.constexpr):
    """Grid ``(max_blocks, cdiv(hidden, BLOCK_N))``: ``y[pair] = (h[rows] W^T + b) * route_weight[pair]`` fp32,
    ``N = hidden``, ``KDIM = I``, weights on the left."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= E:
        return
    row0 = tl.load(block_row_ptr + pid_m)
    row_end = tl.load(expert_start_ptr + e + 1)
    rows = row0 + tl.arange(0, BLOCK_M)
    r_ok = rows < row_end
    pair = tl.load(order_ptr + rows, mask=r_ok, other=0).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc = _mainloop(acc, h_ptr, rows.to(tl.int64) * stride_h, r_ok, w_ptr, s_ptr, e, n, n_ok, N, KDIM, BLOCK_K,
                    REPACKED, BF16X2, PRECISION)
    acc = acc * ACC_SCALE + tl.load(b_ptr + e.to(tl.int64) * N + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    rw = tl.load(rw_ptr + pair, mask=r_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + pair[None, :] * N + n[:, None], acc * rw[None, :], mask=n_ok[:, None] & r_ok[None, :])


_ONE_STAGE: set[tuple[str, int]] = set()
"""(kernel, BLOCK_M) whose tile did not fit the GPU's shared memory with :class:`TileConfig`'s stages: launched
with one stage from then on."""


def _launch(kernel, grid, args: tuple, block_m: int, cfg: TileConfig, **meta) -> None:
    """``kernel[grid](*args, **meta)`` with ``cfg``'s warps and stages; a tile that runs out of shared memory
    (``OutOfResources`` at compile time) is retried, and then always run, without software pipelining."""
    key = (kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel), block_m)
    stages = 1 if key in _ONE_STAGE else cfg.num_stages
    try:
        kernel[grid](*args, **meta, num_warps=cfg.num_warps, num_stages=stages)
    except OutOfResources:
        if stages == 1:
            raise
        _ONE_STAGE.add(key)
        kernel[grid](*args, **meta, num_warps=cfg.num_warps, num_stages=1)


def _words(blocks: torch.Tensor) -> torch.Tensor:
    if blocks.dtype != torch.uint8 or blocks.shape[-1] != 16 or not blocks.is_contiguous():
        raise ValueError(f"expected contiguous uint8 MXFP4 blocks [E, rows, G, 16], got {blocks.dtype} "
                         f"{tuple(blocks.shape)}")
    return blocks.view(torch.int32)


def grouped_moe_partials(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    gate_up_blocks: torch.Tensor, gate_up_scales: torch.Tensor, gate_up_bias: torch.Tensor,
    down_blocks: torch.Tensor, down_scales: torch.Tensor, down_bias: torch.Tensor,
    alpha: float, limit: float, *, repacked: bool = False, grouping: ExpertGrouping | None = None,
    block_m: int | None = None, tile: TileConfig | None = None,
) -> torch.Tensor:
    """Every pair's weighted expert output: ``[T, K, hidden]`` fp32, ``sum(1)`` of which is the MoE layer.

    Args:
        x: ``[T, hidden]`` bf16/fp16/fp32 activations (rows contiguous).
        weights, ids: routing ``[T, K]`` (weights in any float dtype, ids int).
        gate_up_blocks / gate_up_scales: uint8 ``[E, 2I, hidden/32, 16]`` / ``[E, 2I, hidden/32]``;
            gate_up_bias ``[E, 2I]``. down_blocks / down_scales: uint8 ``[E, hidden, I/32, 16]`` /
            ``[E, hidden, I/32]``; down_bias ``[E, hidden]``.
        alpha, limit: the clamped SwiGLU's constants (GPT-OSS: 1.702, 7.0).
        repacked: the blocks are in :mod:`replicas.kernels.moe.decode_layout`'s layout.
        grouping: :func:`triton_group_by_expert` (or :func:`group_by_expert`) of ``ids`` when the caller
            has it; else built here with :func:`triton_group_by_expert`.
        block_m: the M-block height (a key of :data:`TILES`); None: :func:`pick_block_m` from the pair count.
            A fixed height makes every pair's row bitwise independent of the other pairs (one tile shape and
            instruction whatever the token count: ``docs/exactness.md``).
        tile: a tile other than :data:`TILES`' (a benchmark's sweep passes one; serving never does); its
            ``block_m`` is the M-block height.

    Returns:
        ``[T, K, hidden]`` fp32 partials (pair ``(t, k)``: ``weights[t, k] * expert_{ids[t, k]}(x[t])``).

    Raises:
        ValueError: packed tensors not contiguous uint8 ``[..., 16]``, or widths not multiples of 32.
    """
    t, hidden = x.shape
    top_k = ids.shape[1]
    num_experts, two_i = gate_up_blocks.shape[:2]
    inter = two_i // 2
    if hidden % VALUES_PER_BLOCK or inter % VALUES_PER_BLOCK:
        raise ValueError(f"hidden ({hidden}) and expert width ({inter}) must be multiples of {VALUES_PER_BLOCK}")
    gu_words, d_words = _words(gate_up_blocks), _words(down_blocks)
    x = x.contiguous()
    p = t * top_k
    y = torch.empty(t, top_k, hidden, dtype=torch.float32, device=x.device)
    if p == 0:
        return y
    if tile is not None:
        block_m = tile.block_m
    if grouping is not None:
        block_m = grouping.block_m
    elif block_m is None:
        block_m = pick_block_m(p, num_experts)
    g = grouping or triton_group_by_expert(ids, num_experts, block_m)
    precision = "ieee" if x.dtype == torch.float32 else None
    cfg = tile if tile is not None else tile_config(block_m)
    bk = cfg.block_k
    h = torch.empty(p, inter, dtype=x.dtype, device=x.device)
    bf16x2 = bool(repacked and x.is_cuda and x.dtype == torch.bfloat16)
    _launch(_gate_up_kernel, (g.max_blocks, triton.cdiv(two_i, cfg.block_n)),
            (x, g.order, g.block_expert, g.block_row, g.expert_start, gu_words, gate_up_scales, gate_up_bias,
             h, float(alpha), float(limit), x.stride(0), h.stride(0), two_i, num_experts), block_m, cfg,
            TOP_K=top_k, KDIM=hidden, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk, REPACKED=repacked,
            BF16X2=bf16x2, PRECISION=precision)
    _launch(_down_kernel, (g.max_blocks, triton.cdiv(hidden, cfg.block_n)),
            (h, g.order, g.block_expert, g.block_row, g.expert_start, d_words, down_scales, down_bias,
             weights.reshape(-1).contiguous(), y, h.stride(0), hidden, num_experts), block_m, cfg,
            KDIM=inter, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk, REPACKED=repacked, BF16X2=bf16x2,
            PRECISION=precision)
    return y


def grouped_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, *packed, repacked: bool = False,
                residual: torch.Tensor | None = None, tile: TileConfig | None = None) -> torch.Tensor:
    """The MoE layer ``[T, hidden]`` in ``x.dtype``: :func:`grouped_moe_partials` summed over the ``K`` experts
    in slot order (fp32), plus ``residual`` when given. ``packed``: the six packed tensors, alpha, limit;
    ``tile``: as :func:`grouped_moe_partials`."""
    out = grouped_moe_partials(x, weights, ids, *packed, repacked=repacked, tile=tile).sum(1)
    if residual is not None:
        out = out + residual.float()
    return out.to(x.dtype)


def expert_bytes(num_experts_read: int, hidden: int, inter: int) -> int:
    """Packed bytes of ``num_experts_read`` experts' two matrices (4.25 bits per weight) plus bf16 biases."""
    per = (2 * inter * hidden + hidden * inter) * 17 // 32 + (2 * inter + hidden) * 2
    return num_experts_read * per


def _packed_of(experts) -> tuple:
    return (experts.gate_up_proj_blocks, experts.gate_up_proj_scales, experts.gate_up_proj_bias,
            experts.down_proj_blocks, experts.down_proj_scales, experts.down_proj_bias, experts.alpha, experts.limit)


def experts_partials(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts,
                     block_m: int | None = None) -> torch.Tensor:
    """:func:`grouped_moe_partials` for an experts module with GPT-OSS's buffer names (``*_blocks``,
    ``*_scales``, ``*_bias``, ``alpha``, ``limit``; ``decode_layout`` True when repacked at load)."""
    return grouped_moe_partials(x, weights, ids, *_packed_of(experts), repacked=getattr(experts, "decode_layout", False),
                                block_m=block_m)


def experts_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts,
                tile: TileConfig | None = None) -> torch.Tensor:
    """:func:`grouped_moe` for an experts module (see :func:`experts_partials`): ``[T, hidden]`` in ``x.dtype``."""
    return grouped_moe(x, weights, ids, *_packed_of(experts), repacked=getattr(experts, "decode_layout", False),
                       tile=tile)

"""The tensor-core MoE kernels' shared formats: the MMA activation format and the E2M1-decoding PTX.

The decode backends ``triton_tc`` (:mod:`.triton_tc`) and ``hopper_bulk`` (:mod:`.hopper_bulk`) decode
E2M1 codes two at a time into bf16 pairs and multiply them on the tensor cores (``mma.m16n8k16``); both
read activations in one format, written by the kernel that produces them (the add+RMSNorm before the MoE,
:func:`~replicas.kernels.triton_rmsnorm.triton_add_rmsnorm`, the router, or the gate_up kernel for the
down kernel). This module holds that format and the decoding PTX, so that no backend imports another:

- :data:`X_SHIFT` / :data:`X_SCALE`: activations are stored times ``2**64`` (exact in bf16);
- :func:`mma_position`: where value ``j`` of a row sits (within every 8 values, the order
  ``0, 4, 1, 5, 2, 6, 3, 7``), in Triton; :func:`mxfp4_activations`: the same in torch (the reference);
- :func:`mma_asm`: the PTX of one lane's step (decode + 8 MMAs), for Triton's inline asm and CUDA C++.

See :mod:`.triton_tc`'s module docstring for the fragment layout and the bit tricks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

X_SHIFT = tl.constexpr(64)
"""The activations are stored times ``2**X_SHIFT`` (exact in bf16: a power of two)."""
X_SCALE = tl.constexpr(float(2 ** X_SHIFT.value))


def mma_asm(ref: str = "$", chains: int = 1, repacked: bool = False) -> str:
    """PTX for one lane and one step: 8 packed words (``$2..$5`` row a, ``$6..$9`` row b: its 32-value block
    of each row) and the block's 32 activations as 16 bf16 pairs (``$10..$25``; zeros in lanes that supply no
    B operand); 16 code pairs decoded per row, 8 MMAs; ``$0`` / ``$1``: the two rows' block partial sums
    (unscaled). ``ref``: the operand prefix (``$`` for Triton's inline asm, ``%`` for CUDA C++'s).
    ``chains``: 1 or 2 independent accumulator chains (2 halves the MMAs' dependent latency).

    A code pair ``(p, p + 4)`` of a word (bits ``4p..4p+3`` and ``4p+16..4p+19``; pairs 2 and 3 are read from
    the word shifted right by 8) is decoded in three instructions: mask its two nibbles; multiply by
    ``2**a + 2**b``, which places a copy of each nibble so that its magnitude bits land on bf16 bits 8..6 and
    another so that its sign lands on bit 15 (the copies do not overlap, so the product is their OR); mask
    those bits. The multiplications (and the shift, a ``mul.hi``) run on the FMA pipe, leaving two ``lop3``
    per pair on the integer ALU pipe, which issues at half rate on Hopper.

    ``repacked``: the words are in :mod:`replicas.kernels.moe.decode_layout`'s layout (pair 0 one
    instruction, pairs 1 and 2 two, pair 3 four)."""
    acc = ["c", "d"][:chains]
    lines = ["{", ".reg .b32 a<4>, m, t, h<8>;", ".reg .f32 " + ", ".join(f"{c}<4>" for c in acc) + ";"]
    lines += [f"mov.b32 {c}{i}, 0f00000000;" for c in acc for i in range(4)]
    if not repacked:
        lines += [f"mul.hi.u32 h{i}, {ref}{2 + i}, 0x1000000;" for i in range(8)]  # the words shifted right by 8

    def pair(dst, word, p):
        return _code_pair(dst, f"{ref}{2 + word}", f"h{word}", p, repacked)

    for i in range(8):  # MMA i: word i // 2, pairs (0, 1) or (2, 3) as k-columns (2q, 2q+1) and (2q+8, 2q+9)
        w, p0 = i // 2, 2 * (i % 2)
        for reg, word, p in (("a0", w, p0), ("a2", w, p0 + 1), ("a1", 4 + w, p0), ("a3", 4 + w, p0 + 1)):
            lines += pair(reg, word, p)
        c = acc[i % chains]
        lines.append(f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{c}0, {c}1, {c}2, {c}3}}, "
                     f"{{a0, a1, a2, a3}}, {{{ref}{10 + 4 * w + p0}, {ref}{10 + 4 * w + p0 + 1}}}, "
                     f"{{{c}0, {c}1, {c}2, {c}3}};")
    if chains == 2:
        lines += ["add.f32 c0, c0, d0;", "add.f32 c2, c2, d2;"]
    lines += [f"mov.b32 {ref}0, c0;", f"mov.b32 {ref}1, c2;", "}"]
    return "\n".join(lines)


_CHECKPOINT_PAIR_FORMS = ((0x000F000F, (1 << 6) + (1 << 12)), (0x00F000F0, (1 << 2) + (1 << 8)))
"""Code pair ``p' = p % 2`` of a checkpoint-layout word (pairs 2 and 3 of the word shifted right by 8): nibble
mask, multiplier (magnitude shift plus sign shift)."""


def _code_pair(dst: str, word: str, shifted: str, p: int, repacked: bool) -> list[str]:
    """PTX decoding code pair ``p`` of ``word`` into the bf16x2 register ``dst``; ``shifted``: the register
    holding ``word >> 8`` (read for pairs 2 and 3 of the checkpoint layout). Temporaries ``m``, ``t``."""
    if repacked:
        return _repacked_pair(dst, word, p)
    mask, mult = _CHECKPOINT_PAIR_FORMS[p % 2]
    src = word if p < 2 else shifted
    return [f"and.b32 m, {src}, {mask:#010x};", f"mul.lo.u32 t, m, {mult:#x};", f"and.b32 {dst}, t, 0x81C081C0;"]


def decode_asm(high: bool, repacked: bool = False) -> str:
    """PTX (CUDA C++ operands) decoding one MMA's A operand: ``%4`` row a's packed word, ``%5`` row b's (the
    same word of both rows); ``%0..%3`` the MMA's A registers, in :func:`mma_asm`'s order (row a's pair
    ``p0``, row b's ``p0``, row a's ``p0 + 1``, row b's ``p0 + 1``) for ``p0`` 2 when ``high``, else 0.
    The same instructions as :func:`mma_asm`'s decoding, without the MMAs, so that a kernel can decode a
    step once and multiply it by several activation rows."""
    p0 = 2 if high else 0
    lines = ["{", ".reg .b32 m, t, ha, hb;"]
    if high and not repacked:
        lines += ["mul.hi.u32 ha, %4, 0x1000000;", "mul.hi.u32 hb, %5, 0x1000000;"]
    for dst, word, shifted, p in (("%0", "%4", "ha", p0), ("%2", "%4", "ha", p0 + 1), ("%1", "%5", "hb", p0),
                                  ("%3", "%5", "hb", p0 + 1)):
        lines += _code_pair(dst, word, shifted, p, repacked)
    return "\n".join(lines + ["}"])


def _repacked_pair(dst: str, word: str, p: int) -> list[str]:
    """PTX decoding code pair ``p`` of a word in :mod:`replicas.kernels.moe.decode_layout`'s layout into the
    bf16x2 register ``dst`` (temporaries ``m``, ``t``, ``a<4>`` untouched but ``dst``)."""
    from replicas.kernels.moe import decode_layout as layout

    if p == 0:
        return [f"and.b32 {dst}, {word}, {layout.PAIR_MASK:#010x};"]
    if p < 3:
        return [f"shl.b32 t, {word}, {layout.PAIR_SHIFTS[p]};", f"and.b32 {dst}, t, {layout.PAIR_MASK:#010x};"]
    return [f"and.b32 m, {word}, {layout.PAIR3_MASK:#010x};",
            f"mul.hi.u32 t, m, {layout.PAIR3_HI_MULTIPLIER:#x};",
            f"shl.b32 m, m, {layout.PAIR3_SIGN_SHIFT};",
            f"lop3.b32 {dst}, t, m, {layout.PAIR_MASK:#010x}, 0xA8;"]  # (t | m) & mask


@triton.jit
def mma_position(j):
    """Where value ``j`` of a row sits in the MMA activation format: within every 8 values the order
    ``0, 4, 1, 5, 2, 6, 3, 7`` (the decoder's code pairs), i.e. ``8(j//8) + 2(j%4) + (j%8)//4``."""
    return 8 * (j // 8) + 2 * (j % 4) + (j % 8) // 4


def mxfp4_activations(x: torch.Tensor) -> torch.Tensor:
    """Activations ``x`` ``[T, n]`` → the MMA format ``[T, n]`` bf16: times ``2**64``, within every 8 values
    the order ``0, 4, 1, 5, 2, 6, 3, 7`` (the decoder's code pairs).

    Torch reference of what :func:`~replicas.kernels.triton_rmsnorm.triton_add_rmsnorm` writes with
    ``mxfp4_out``; ``n`` must be a multiple of 8."""
    t, n = x.shape
    y = (x.float() * X_SCALE.value).view(t, n // 8, 2, 4).transpose(2, 3).reshape(t, n)
    return y.to(torch.bfloat16)

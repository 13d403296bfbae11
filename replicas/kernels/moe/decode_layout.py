"""A bit layout of packed MXFP4 words that the tensor-core decode kernels turn into bf16 pairs cheaply.

The tensor-core MoE kernels (:func:`~replicas.kernels.moe.mma_format.mma_asm`)
decode a 32-bit word of 8 E2M1 codes (code ``j`` in bits ``4j..4j+3``, low
nibble first, as stored in the checkpoint) as four *code pairs* ``(p, p + 4)``,
each into one bf16x2 register: magnitude bits ``e1 e0 m`` of the low code on
bits 8..6 and its sign on bit 15, the high code on 24..22 and 31 (the value
times ``2**-126``). From the checkpoint's layout that costs three instructions
per pair. This module permutes the 32 bits of every word once, at load time,
so that:

* pair 0 already sits on those bits: one mask;
* pair 1 sits 3 bits lower, pair 2 6 bits lower: a shift and a mask each;
* pair 3 fills the 8 bits left over (code 3: sign 11, e1 10, e0 14, m 13;
  code 7: sign 27, e1 26, e0 30, m 29): mask ``0x6C006C00``, then
  ``(mul.hi(v, 2**30 + 2**25) | v << 4) & 0x81C081C0`` (right shifts 2 and 7
  bring the magnitude bits down, a left shift of 4 the signs up; the copies
  never overlap, so the multiplication has no carries).

5 integer-ALU and 4 FMA-pipe instructions per word instead of 8 and 5 (on
Hopper the integer ALU pipe issues a warp instruction every other cycle, and it
bounds the decoding: ``docs/decisions/0017-decode-layout-repack.md``). Only the bits inside a
word move, so rows, blocks, scales and the activations' order are unchanged.
The layout was found by exhaustive search over the 8! placements of pair 3.

Used by the ``hopper_bulk`` MoE backend when the engine config's ``moe_repack`` holds (the default):
:meth:`replicas.kernels.moe.MoE.prepare` repacks a loaded model's experts once, in place
(``docs/decisions/0017-decode-layout-repack.md`` has what it buys).
"""

from __future__ import annotations

import torch

PAIR_SHIFTS = (0, 3, 6)
"""Pairs 0, 1, 2 are stored this many bits below their bf16 positions (decoded by a left shift)."""

PAIR_MASK = 0x81C081C0
"""The bf16x2 bits a code pair occupies once decoded: signs 31 and 15, magnitudes 24..22 and 8..6."""

PAIR3_MASK = 0x6C006C00
"""Where pair 3 is stored (bits 10, 11, 13, 14, 26, 27, 29, 30)."""

PAIR3_MAGNITUDE_SHIFTS = (2, 7)
"""Pair 3's magnitude bits are stored this many bits above their bf16 positions (decoded by right shifts)."""

PAIR3_HI_MULTIPLIER = sum(1 << (32 - s) for s in PAIR3_MAGNITUDE_SHIFTS)
"""``mul.hi`` by this shifts right by both :data:`PAIR3_MAGNITUDE_SHIFTS` at once (``2**30 + 2**25``)."""

PAIR3_SIGN_SHIFT = 4
"""Pair 3's signs are stored this many bits below their bf16 positions."""

_BF16 = {"s": 15, "e1": 8, "e0": 7, "m": 6}  # a low code's bits once decoded; a high code's are 16 higher
_NIBBLE = {"m": 0, "e0": 1, "e1": 2, "s": 3}  # a code's bits in its checkpoint nibble
_PAIR3 = {3: {"s": 11, "e1": 10, "e0": 14, "m": 13}, 7: {"s": 27, "e1": 26, "e0": 30, "m": 29}}


def _placement() -> dict[int, int]:
    """Source bit (checkpoint word) → destination bit (decode layout), all 32."""
    out = {}
    for code in range(8):
        pair, high = code % 4, code >= 4
        for bit, nib in _NIBBLE.items():
            if pair < 3:
                dst = _BF16[bit] + 16 * high - PAIR_SHIFTS[pair]
            else:
                dst = _PAIR3[code][bit]
            out[4 * code + nib] = dst
    assert sorted(out.values()) == list(range(32))
    return out


PLACEMENT = _placement()
"""Checkpoint bit → decode-layout bit of every word."""


def _permute(words: torch.Tensor, table: dict[int, int]) -> torch.Tensor:
    """Bits of int64 ``words`` (values in [0, 2**32)) moved by ``table``; grouped by distance (one shift and
    one mask per distance)."""
    out = torch.zeros_like(words)
    by_shift: dict[int, int] = {}
    for src, dst in table.items():
        by_shift[dst - src] = by_shift.get(dst - src, 0) | (1 << src)
    for shift, mask in by_shift.items():
        moved = words & mask
        out |= moved << shift if shift >= 0 else moved >> -shift
    return out


def _apply(blocks: torch.Tensor, table: dict[int, int], chunk_rows: int) -> None:
    if blocks.dtype != torch.uint8 or blocks.shape[-1] != 16 or not blocks.is_contiguous():
        raise ValueError(f"expected contiguous uint8 [..., G, 16] MXFP4 blocks, got {blocks.dtype} "
                         f"{tuple(blocks.shape)}")
    flat = blocks.view(-1, 16)
    for start in range(0, flat.shape[0], chunk_rows):
        part = flat[start:start + chunk_rows]
        words = part.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        moved = _permute(words, table)
        moved = torch.where(moved >= 1 << 31, moved - (1 << 32), moved).to(torch.int32)  # two's complement
        part.copy_(moved.view(torch.uint8).view(part.shape))


def repack_(blocks: torch.Tensor, chunk_rows: int = 1 << 22) -> torch.Tensor:
    """Permute, in place, the bits of every 32-bit word of packed MXFP4 ``blocks`` (uint8 ``[..., G, 16]``,
    contiguous, little-endian words) from the checkpoint layout to the decode layout; returns ``blocks``.
    Works ``chunk_rows`` 16-byte blocks at a time (int64 temporaries of 4x that size).

    Raises:
        ValueError: not contiguous uint8 ``[..., 16]``.
    """
    _apply(blocks, PLACEMENT, chunk_rows)
    return blocks


def unpack_(blocks: torch.Tensor, chunk_rows: int = 1 << 22) -> torch.Tensor:
    """The inverse of :func:`repack_`, in place; returns ``blocks``."""
    _apply(blocks, {dst: src for src, dst in PLACEMENT.items()}, chunk_rows)
    return blocks


def unpacked(blocks: torch.Tensor) -> torch.Tensor:
    """A copy of decode-layout ``blocks`` in the checkpoint layout (for the paths that dequantize)."""
    return unpack_(blocks.clone())

"""Triton kernel: MXFP4 → bf16/fp16/fp32 dequantization in one pass (GPT-OSS prefill experts).

The prefill path (:func:`replicas.kernels.moe.moe_reference`) dequantizes each
routed expert once and runs dense GEMMs. In torch that is a lookup, a stack, an
``ldexp`` and a cast, each a full pass over the expert (about ten passes of
bf16 traffic). Here one launch reads the packed bytes and scales and writes the
values: E2M1 codes become fp32 bit patterns (the E2M1 value times ``2**-126``,
see :mod:`replicas.kernels.moe.triton_fp32`), then one multiply by the exact
power of two ``2**(s - 127 + 126)``, split as ``2**63 * 2**(s - 64)`` so that
neither factor overflows fp32. Exact, like the torch reference
(:func:`replicas.kernels.moe.mxfp4.dequantize_mxfp4`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replicas.kernels.moe import decode_layout as layout
from replicas.kernels.moe.e2m1 import e2m1_bits
from replicas.kernels.moe.mxfp4 import BLOCK_SIZE, BYTES_PER_BLOCK

_PAIR_MASK = tl.constexpr(layout.PAIR_MASK)
_PAIR3_MASK = tl.constexpr(layout.PAIR3_MASK)
_SHIFT1 = tl.constexpr(layout.PAIR_SHIFTS[1])
_SHIFT2 = tl.constexpr(layout.PAIR_SHIFTS[2])
_MAG3_A = tl.constexpr(layout.PAIR3_MAGNITUDE_SHIFTS[0])
_MAG3_B = tl.constexpr(layout.PAIR3_MAGNITUDE_SHIFTS[1])
_SIGN3 = tl.constexpr(layout.PAIR3_SIGN_SHIFT)


@triton.jit
def _pair_values(pair):
    """bf16x2 code-pair patterns (uint32) → ``[..., 2]`` fp32: the low code, the high code (a bf16 pattern
    shifted up 16 bits is the fp32 one)."""
    return tl.join((pair << 16).to(tl.float32, bitcast=True), (pair & 0xFFFF0000).to(tl.float32, bitcast=True))


@triton.jit
def _repacked_bits(w):
    """Words ``[BLOCKS, 4]`` uint32 in :mod:`replicas.kernels.moe.decode_layout`'s layout → ``[BLOCKS, 32]``
    fp32 E2M1 values times ``2**-126``, in element order (the decode kernels' pair decoding; pair 3's
    ``mul.hi`` written as its two right shifts)."""
    v = w & _PAIR3_MASK
    a0 = _pair_values(w & _PAIR_MASK)  # codes 0 and 4 of each word
    a1 = _pair_values((w << _SHIFT1) & _PAIR_MASK)
    a2 = _pair_values((w << _SHIFT2) & _PAIR_MASK)
    a3 = _pair_values(((v >> _MAG3_A) | (v >> _MAG3_B) | (v << _SIGN3)) & _PAIR_MASK)
    # element e = 4 i2 + 2 i1 + i0 of a word: i2 from a_p's own pair axis, then i1, then i0 from the joins
    return tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, a3)), [w.shape[0], 32])


@triton.jit
def _dequant_kernel(b_ptr, w_ptr, s_ptr, out_ptr, NB, BLOCKS: tl.constexpr, PTX: tl.constexpr,
                    REPACKED: tl.constexpr):
    """Grid ``(cdiv(NB, BLOCKS),)`` over the ``NB`` 32-value blocks: ``out[blk, 0:32]`` in ``out``'s dtype.
    ``REPACKED``: read the blocks as 32-bit words (``w_ptr``) in the decode layout."""
    blk = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    ok = blk < NB
    s = tl.load(s_ptr + blk, mask=ok, other=127).to(tl.int32)
    scale = ((s + (127 - 64)) << 23).to(tl.float32, bitcast=True)[:, None]  # 2**(s-64)
    if REPACKED:
        w = tl.load(w_ptr + blk.to(tl.int64)[:, None] * 4 + tl.arange(0, 4)[None, :], mask=ok[:, None], other=0)
        vals = (_repacked_bits(w.to(tl.uint32, bitcast=True)) * 9223372036854775808.0) * scale
    else:
        c = tl.arange(0, 16)
        b = tl.load(b_ptr + blk.to(tl.int64)[:, None] * 16 + c[None, :], mask=ok[:, None], other=0)
        lo, hi = e2m1_bits(b, PTX)
        lo = (lo * 9223372036854775808.0) * scale  # (v * 2**-126 * 2**63) * 2**(s-64), in this order: no overflow
        hi = (hi * 9223372036854775808.0) * scale
        vals = tl.reshape(tl.join(lo, hi), [BLOCKS, 32])  # elements 2j, 2j+1
    tl.store(out_ptr + blk.to(tl.int64)[:, None] * 32 + tl.arange(0, 32)[None, :],
             vals.to(out_ptr.dtype.element_ty), mask=ok[:, None])


def triton_dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                            dtype: torch.dtype = torch.bfloat16, ptx: bool | None = None,
                            repacked: bool = False) -> torch.Tensor:
    """``dequantize_mxfp4`` in one launch: uint8 ``blocks`` ``[..., rows, G, 16]`` and ``scales``
    ``[..., rows, G]`` → ``[..., rows, G * 32]`` in ``dtype`` (exact).

    ``ptx``: inline-PTX decoding (default on CUDA; Triton's CPU interpreter needs False).
    ``repacked``: ``blocks`` are in :mod:`replicas.kernels.moe.decode_layout`'s bit layout.

    Raises:
        ValueError: not uint8, not contiguous, or the shapes do not pair up.
    """
    if (blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[-1] != BYTES_PER_BLOCK
            or blocks.shape[:-1] != scales.shape or not blocks.is_contiguous() or not scales.is_contiguous()):
        raise ValueError(f"expected contiguous uint8 blocks [..., G, {BYTES_PER_BLOCK}] and scales [..., G], got "
                         f"{blocks.dtype} {tuple(blocks.shape)} and {scales.dtype} {tuple(scales.shape)}")
    if ptx is None:
        ptx = blocks.is_cuda and not torch.version.hip
    out = torch.empty(*scales.shape[:-1], scales.shape[-1] * BLOCK_SIZE, dtype=dtype, device=blocks.device)
    nb = scales.numel()
    per_program = 64
    _dequant_kernel[(triton.cdiv(nb, per_program),)](blocks, blocks.view(torch.int32), scales, out, nb,
                                                      BLOCKS=per_program, PTX=ptx, REPACKED=repacked, num_warps=4)
    return out

"""MXFP4 weights: the packed format of GPT-OSS expert matrices, and its (de)quantization.

Format (OCP Microscaling Formats (MX) v1.0, §5 "MXFP4"; the byte layout is the
HF checkpoint's, as read by transformers' ``integrations/mxfp4.py``
``_convert_moe_packed_tensors``):

* a block of ``BLOCK_SIZE`` = 32 consecutive values along a matrix row (the
  *input* dimension) shares one scale;
* ``*_blocks``: uint8 ``[..., rows, G, 16]`` with ``G = cols / 32``; each byte
  holds two FP4 E2M1 codes, the **low nibble first** (element ``2j`` of a block
  is ``byte[j] & 0x0F``, element ``2j + 1`` is ``byte[j] >> 4``);
* ``*_scales``: uint8 ``[..., rows, G]``, E8M0 exponents with bias 127 (the
  block's scale is ``2 ** (code - 127)``; code 255 is NaN and never valid);
* E2M1 code ``c``: sign bit ``c & 8``, magnitude ``E2M1_MAGNITUDES[c & 7]``.

``rows`` is the output dimension: dequantizing ``[rows, G, 16]`` gives the
``nn.Linear``-layout weight ``[out, in]`` (transformers' GPT-OSS parameters are
the transpose, ``[in, out]``).

Memory: packed MXFP4 costs 4.25 bits per value (4 bits + 8 bits per 32), i.e.
17/64 of a bf16 copy.
"""

from __future__ import annotations

import torch

BLOCK_SIZE = 32
"""Values sharing one E8M0 scale (OCP MX v1.0, §5: k = 32 for every concrete MX format)."""

BYTES_PER_BLOCK = BLOCK_SIZE // 2
"""Packed bytes per block: two 4-bit codes per byte."""

SCALE_BIAS = 127
"""E8M0 exponent bias (OCP MX v1.0, §5.4.1); code 255 encodes NaN."""

E8M0_NAN = 255

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Magnitudes of E2M1 codes 0..7 (OCP MX v1.0, §5.3.3: 1 sign, 2 exponent (bias 1), 1 mantissa bit).
Codes 8..15 are the same magnitudes negated (transformers' ``FP4_VALUES``)."""

E2M1_EMAX = 2
"""Exponent of E2M1's largest normal, 6 = 1.5 * 2**2 (``emax_elem`` of OCP MX v1.0, §6.3)."""

_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
"""Rounding thresholds between consecutive E2M1 magnitudes."""


class MXFP4Error(ValueError):
    """A packed MXFP4 tensor pair is malformed; the message names the tensor."""


def e2m1_values(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 E2M1 code values, ``[16]`` fp32, indexed by code (``+0.0 .. +6.0, -0.0 .. -6.0``)."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat((mags, -mags))


def check_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, name: str = "mxfp4",
    shape: tuple[int, ...] | None = None,
) -> None:
    """Validate a ``(blocks, scales)`` pair, raising :class:`MXFP4Error` naming ``name``.

    Args:
        blocks: expected uint8 ``[..., rows, G, 16]``.
        scales: expected uint8 ``[..., rows, G]``.
        name: the tensors' name prefix for messages (e.g. ``model.layers.0.mlp.experts.down_proj``).
        shape: if given, the logical (dequantized) shape ``[..., rows, cols]`` the pair must encode.

    Checks dtypes, the 16-byte block width, that blocks and scales agree, the
    logical shape, and that no scale is the E8M0 NaN code 255 (a corrupt file).
    """
    if blocks.dtype != torch.uint8:
        raise MXFP4Error(f"{name}_blocks: dtype {blocks.dtype}, expected torch.uint8 (two E2M1 codes per byte)")
    if scales.dtype != torch.uint8:
        raise MXFP4Error(f"{name}_scales: dtype {scales.dtype}, expected torch.uint8 (E8M0 exponents)")
    if blocks.dim() < 2 or blocks.shape[-1] != BYTES_PER_BLOCK:
        raise MXFP4Error(
            f"{name}_blocks: shape {tuple(blocks.shape)}, expected [..., rows, G, {BYTES_PER_BLOCK}] "
            f"({BLOCK_SIZE} values per block, 2 per byte)"
        )
    if blocks.shape[:-1] != scales.shape:
        raise MXFP4Error(
            f"{name}_scales: shape {tuple(scales.shape)} does not match {name}_blocks "
            f"{tuple(blocks.shape)} (expected {tuple(blocks.shape[:-1])})"
        )
    if shape is not None:
        logical = (*blocks.shape[:-2], blocks.shape[-2] * BLOCK_SIZE)
        if logical != tuple(shape):
            raise MXFP4Error(
                f"{name}_blocks: shape {tuple(blocks.shape)} encodes a {logical} matrix, expected {tuple(shape)}"
            )
    if scales.numel() and bool((scales == E8M0_NAN).any()):
        raise MXFP4Error(f"{name}_scales: contains the E8M0 NaN code {E8M0_NAN} (corrupt checkpoint?)")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Unpack MXFP4 to a dense tensor.

    Args:
        blocks: uint8 ``[..., rows, G, 16]``, low nibble first.
        scales: uint8 ``[..., rows, G]``, E8M0 with bias 127.
        dtype: output dtype.

    Returns:
        ``[..., rows, G * 32]`` in ``dtype`` on ``blocks.device``:
        ``value = E2M1(code) * 2 ** (scale - 127)``, exact in fp32 and bf16
        (an E2M1 value times a power of two needs 2 significand bits).

    Raises:
        MXFP4Error: malformed pair (see :func:`check_mxfp4`).
    """
    check_mxfp4(blocks, scales)
    lut = e2m1_values(blocks.device)
    lo = lut[(blocks & 0x0F).long()]  # [..., rows, G, 16] elements 0, 2, 4, ...
    hi = lut[(blocks >> 4).long()]  # elements 1, 3, 5, ...
    values = torch.stack((lo, hi), dim=-1).flatten(-2)  # [..., rows, G, 32]
    values = torch.ldexp(values, (scales.to(torch.int32) - SCALE_BIAS).unsqueeze(-1))
    return values.flatten(-2).to(dtype)


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize along the last dimension to MXFP4 (the inverse of :func:`dequantize_mxfp4`).

    Per block of 32 (OCP MX v1.0, §6.3): shared exponent
    ``e = floor(log2(max |x|)) - E2M1_EMAX`` (clamped to E8M0's [-127, 127];
    an all-zero block gets -127), then each ``x / 2**e`` is rounded to the
    nearest E2M1 value, ties to even code, saturating at +-6. The sign of
    ``-0.0`` is kept.

    Error bound per element, with ``X = 2**e``: ``|x - q| <= X/4`` when
    ``|x|/X < 2``, ``X/2`` below 4, ``X`` up to 6, and ``|x| - 6X`` (< 2X, and
    < ``max|x|``/3) for the saturated tail in (6X, 8X).

    Args:
        x: floating ``[..., cols]``, ``cols % 32 == 0``, finite.

    Returns:
        ``(blocks uint8 [..., cols/32, 16], scales uint8 [..., cols/32])``.

    Raises:
        MXFP4Error: ``cols`` not a multiple of 32, or non-finite values.
    """
    if not x.is_floating_point() or x.dim() < 1 or x.shape[-1] % BLOCK_SIZE:
        raise MXFP4Error(
            f"quantize_mxfp4: expected a floating tensor [..., cols] with cols % {BLOCK_SIZE} == 0, "
            f"got {x.dtype} {tuple(x.shape)}"
        )
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)  # [..., G, 32]
    if not bool(torch.isfinite(xb).all()):
        raise MXFP4Error("quantize_mxfp4: input has NaN or infinite values")
    amax = xb.abs().amax(dim=-1)  # [..., G]
    _, exponent = torch.frexp(amax)  # amax = m * 2**exponent, m in [0.5, 1): floor(log2 amax) = exponent - 1
    shared = torch.where(amax > 0, exponent - 1 - E2M1_EMAX, -SCALE_BIAS).clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = torch.ldexp(xb, -shared.unsqueeze(-1))  # exact: division by a power of two
    mag = scaled.abs()
    mids = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=x.device)
    code = torch.bucketize(mag, mids)  # midpoints strictly below mag: the nearest code, ties to the lower
    at_tie = (code < len(_MIDPOINTS)) & (mag == mids[code.clamp(max=len(_MIDPOINTS) - 1)]) & (code % 2 == 1)
    code = code + at_tie.long()  # ties to the even code
    code = code | (torch.signbit(scaled).long() << 3)  # [..., G, 32] codes 0..15
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)  # low nibble = even element
    return packed, (shared + SCALE_BIAS).to(torch.uint8)


def packed_nbytes(rows: int, cols: int) -> int:
    """Bytes of the packed pair for a ``[rows, cols]`` matrix: ``rows * cols / 2 + rows * cols / 32``."""
    return rows * cols // 2 + rows * cols // BLOCK_SIZE


def check_packed_moe(x: torch.Tensor, ids: torch.Tensor, gate_up_blocks: torch.Tensor,
                     down_blocks: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate the inputs of a packed-MXFP4 MoE decode kernel and return ``(T, hidden, K, I)``: ``x``
    ``[T, hidden]``, ``ids`` ``[T, K]``, ``gate_up_blocks`` ``[E, 2I, hidden/32, 16]``, ``down_blocks``
    ``[E, hidden, I/32, 16]``.

    Raises:
        ValueError: packed tensors not contiguous uint8 ``[..., G, 16]``, or widths not multiples of 32.
    """
    t, hidden = x.shape
    inter = gate_up_blocks.shape[1] // 2
    for name, tensor in (("gate_up_blocks", gate_up_blocks), ("down_blocks", down_blocks)):
        if tensor.dtype != torch.uint8 or tensor.shape[-1] != BYTES_PER_BLOCK or not tensor.is_contiguous():
            raise ValueError(f"{name}: expected contiguous uint8 [..., G, {BYTES_PER_BLOCK}], got "
                             f"{tensor.dtype} {tuple(tensor.shape)}")
    if hidden % BLOCK_SIZE or inter % BLOCK_SIZE:
        raise ValueError(f"hidden ({hidden}) and expert width ({inter}) must be multiples of {BLOCK_SIZE}")
    return t, hidden, ids.shape[1], inter

"""E2M1 codes → fp32 values in Triton, shared by the SIMT MoE kernels (:mod:`.triton_fp32`) and the
prefill dequantization (:mod:`.prefill_dequantize`), so that neither imports the other.

E2M1 → fp32 without a conversion instruction (OCP MX v1.0 §5.3.3): a code's magnitude bits ``e1 e0 m``
placed on fp32's two lowest exponent bits and top mantissa bit (bits 24..22), its sign on bit 31, read as
the E2M1 value times ``2**-126`` (see :mod:`.triton_fp32`'s module docstring). On NVIDIA GPUs the decoding
runs as inline PTX; Triton's CPU interpreter cannot run PTX, so ``PTX=False`` decodes with plain Triton
integer ops (the same bits).
"""

from __future__ import annotations

import triton
import triton.language as tl

_E2M1_X4_TO_F32 = tl.constexpr("""
{
.reg .b32 t, a, s, p, z;
mov.b32 z, 0;
prmt.b32 t, $8, z, 0x4140;
shl.b32 a, t, 6; and.b32 a, a, 0x01C001C0; shl.b32 s, t, 12; lop3.b32 p, a, s, 0x80008000, 0xF8;
shl.b32 $0, p, 16; and.b32 $1, p, 0xFFFF0000;
shl.b32 a, t, 2; and.b32 a, a, 0x01C001C0; shl.b32 s, t, 8; lop3.b32 p, a, s, 0x80008000, 0xF8;
shl.b32 $4, p, 16; and.b32 $5, p, 0xFFFF0000;
prmt.b32 t, $8, z, 0x4342;
shl.b32 a, t, 6; and.b32 a, a, 0x01C001C0; shl.b32 s, t, 12; lop3.b32 p, a, s, 0x80008000, 0xF8;
shl.b32 $2, p, 16; and.b32 $3, p, 0xFFFF0000;
shl.b32 a, t, 2; and.b32 a, a, 0x01C001C0; shl.b32 s, t, 8; lop3.b32 p, a, s, 0x80008000, 0xF8;
shl.b32 $6, p, 16; and.b32 $7, p, 0xFFFF0000;
}
""")
"""Four bytes (``$8``) → their low-nibble values (``$0..$3``) and high-nibble values (``$4..$7``) as fp32
bit patterns, each the E2M1 value times 2**-126. ``prmt`` spreads bytes 0 and 1 (then 2 and 3) to the low
bits of the two 16-bit lanes; per nibble, a shift and mask put ``e1 e0 m`` on bits 8..6 of its lane, a
second shift and ``lop3`` (``a | (s & c)``, LUT 0xF8) its sign on bit 15; the lanes then become fp32 by
a shift (lane 0) or a mask (lane 1)."""


@triton.jit
def e2m1_bits(b, PTX: tl.constexpr):
    """uint8 ``[..]`` packed bytes → (low-nibble, high-nibble) fp32 values, each times 2**-126."""
    if PTX:
        return tl.inline_asm_elementwise(_E2M1_X4_TO_F32, "=r,=r,=r,=r,=r,=r,=r,=r,r", [b],
                                         dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
    else:
        c = b.to(tl.int32)
        lo = ((c & 7) << 22) | ((c & 8) << 28)
        hi = ((c & 0x70) << 18) | ((c & 0x80) << 24)
        return lo.to(tl.float32, bitcast=True), hi.to(tl.float32, bitcast=True)

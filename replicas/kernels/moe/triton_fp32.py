"""Triton kernels: MXFP4 MoE GEMV on the SIMT cores, exact fp32 sums (decode, a few tokens; the
``triton_fp32`` MoE backend, for fp32 models on NVIDIA GPUs).

Nothing leaves the registers: each thread loads one 32-value block (16 bytes, one 128-bit load), decodes its 32
E2M1 codes with a few integer instructions, and multiplies them with the
matching activations in fp32. The block's sum stays in that thread; the E8M0
scale multiplies it once; the row's sum over blocks is one warp reduction.

E2M1 → fp32 without a conversion instruction (OCP MX v1.0 §5.3.3): a code's
magnitude bits ``e1 e0 m`` placed on fp32's two lowest exponent bits and top
mantissa bit (bits 24..22), its sign on bit 31, read as ``2**(e-127) (1 + m/2)``
for ``e > 0`` and ``m * 2**-127`` (subnormal) for ``e = 0``: the E2M1 value times
``2**-126`` in every case. The activations are multiplied by ``2**64`` once
(so the products are normal fp32 numbers) and the block scale
``2**(s - 127)`` becomes ``2**(s - 127 + 126 - 64)``: powers of two, so the
result is the exact fp32 dot product up to fp32 summation order. fp32 FMA keeps
subnormal operands (Triton emits ``fma.rn.f32``, no ``.ftz``).

Two launches per MoE layer, for ``T`` tokens with ``K`` experts each (one
(token, expert) pair per grid row):

1. gate_up: ``2 * BJ`` interleaved gate/up rows per program, bias and GPT-OSS's
   clamped SwiGLU fused, ``h`` ``[T*K, I]`` fp32 written.
2. down: ``BR`` rows per program, bias added, times the routing weight, written
   per expert as ``[T, K, hidden]`` fp32 partials that
   :func:`~replicas.kernels.triton_rmsnorm.triton_add_rmsnorm` sums in a fixed
   order with the residual (no atomics, deterministic).

The decoding runs as inline PTX on NVIDIA GPUs (``prmt`` + shifts + ``lop3``,
26 instructions per 8 codes). Triton's CPU interpreter cannot run PTX, so the
kernels take ``PTX=False`` there and decode with plain Triton integer ops (the
same bits); the GPU tests (``tests/gpu``) check the PTX path against the same
reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replicas.kernels.moe.e2m1 import e2m1_bits
from replicas.kernels.moe.mxfp4 import check_packed_moe

X_SHIFT = tl.constexpr(64)
"""Activations are multiplied by ``2**X_SHIFT`` before the products (see the module docstring)."""
X_SCALE = tl.constexpr(float(2 ** X_SHIFT.value))

@triton.jit
def _load_step(row_ptr, srow_ptr, x_ptr, row_ok, g0, G: tl.constexpr, GB: tl.constexpr):
    """Blocks ``g0 .. g0+GB-1`` of R rows: bytes ``[R, GB, 16]``, scales ``[R, GB]``, activations ``[GB, 32]``
    (loaded contiguous: coalesced; their split into even/odd elements happens in registers)."""
    g = g0 + tl.arange(0, GB)
    g_ok = g < G
    c = tl.arange(0, 16)
    b = tl.load(row_ptr[:, None, None] + g[None, :, None] * 16 + c[None, None, :],
                mask=row_ok[:, None, None] & g_ok[None, :, None], other=0)
    s = tl.load(srow_ptr[:, None] + g[None, :], mask=row_ok[:, None] & g_ok[None, :], other=0)
    x = tl.load(x_ptr + g[:, None] * 32 + tl.arange(0, 32)[None, :], mask=g_ok[:, None], other=0.0)
    return b, s, x


@triton.jit
def _step_dot(b, s, x, PTX: tl.constexpr):
    """``[R, GB]`` fp32: each row's 32-value block · its activations, times the block scale."""
    xe, xo = tl.split(tl.reshape(x.to(tl.float32) * X_SCALE, [x.shape[0], 16, 2]))
    lo, hi = e2m1_bits(b, PTX)
    part = tl.sum(lo * xe[None, :, :] + hi * xo[None, :, :], axis=2)
    return part * ((s.to(tl.int32) + (126 - X_SHIFT)) << 23).to(tl.float32, bitcast=True)  # 2**(s-127+126-64)


@triton.jit
def _rows_dot(row_ptr, srow_ptr, x_ptr, row_ok, G: tl.constexpr, GB: tl.constexpr, PTX: tl.constexpr):
    """``[R]`` fp32: packed rows (byte pointers ``row_ptr`` ``[R]``, scale pointers ``srow_ptr`` ``[R]``)
    · the ``G * 32`` activations at ``x_ptr``, ``GB`` 32-value blocks per step, each block in one thread.

    The next step's loads are issued before this step's arithmetic (a batch-one GEMV has nothing else to
    hide DRAM latency with; one step ahead suffices: the kernel is bound by its instructions)."""
    NS: tl.constexpr = (G + GB - 1) // GB
    b, s, x = _load_step(row_ptr, srow_ptr, x_ptr, row_ok, 0, G, GB)
    for i in tl.static_range(NS):
        if i + 1 < NS:
            b_next, s_next, x_next = _load_step(row_ptr, srow_ptr, x_ptr, row_ok, (i + 1) * GB, G, GB)
        part = _step_dot(b, s, x, PTX)
        if i == 0:
            acc = part
        else:
            acc += part
        if i + 1 < NS:
            b, s, x = b_next, s_next, x_next
    return tl.sum(acc, axis=1)


@triton.jit
def _gate_up_kernel(
    x_ptr, ids_ptr, blocks_ptr, scales_ptr, bias_ptr, h_ptr,
    stride_be, stride_br, stride_se, stride_sr, stride_bias,
    INTER, alpha, limit,
    K: tl.constexpr, HIDDEN: tl.constexpr, BJ: tl.constexpr, GB: tl.constexpr, PTX: tl.constexpr,
):
    """Grid ``(pairs, cdiv(I, BJ))``: ``h[pair, j] = swiglu(W_gu[e] x + b)`` for ``BJ`` outputs ``j``."""
    pair = tl.program_id(0)
    token = pair // K
    e = tl.load(ids_ptr + pair).to(tl.int64)
    rows = tl.program_id(1) * (2 * BJ) + tl.arange(0, 2 * BJ)  # gate 2j, up 2j + 1, interleaved
    row_ok = rows < 2 * INTER
    y = _rows_dot(blocks_ptr + e * stride_be + rows.to(tl.int64) * stride_br,
                  scales_ptr + e * stride_se + rows.to(tl.int64) * stride_sr,
                  x_ptr + token * HIDDEN, row_ok, HIDDEN // 32, GB, PTX)
    y += tl.load(bias_ptr + e * stride_bias + rows, mask=row_ok, other=0.0).to(tl.float32)
    gate, up = tl.split(tl.reshape(y, [BJ, 2]))
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    j = tl.program_id(1) * BJ + tl.arange(0, BJ)
    tl.store(h_ptr + pair * INTER + j, (up + 1.0) * gate * tl.sigmoid(gate * alpha), mask=j < INTER)


@triton.jit
def _down_kernel(
    h_ptr, ids_ptr, w_ptr, blocks_ptr, scales_ptr, bias_ptr, part_ptr,
    stride_be, stride_br, stride_se, stride_sr, stride_bias, HIDDEN,
    INTER: tl.constexpr, BR: tl.constexpr, GB: tl.constexpr, PTX: tl.constexpr,
):
    """Grid ``(pairs, cdiv(hidden, BR))``: ``part[pair, r] = w_pair * (W_d[e] h_pair + b)[r]``."""
    pair = tl.program_id(0)
    r = tl.program_id(1) * BR + tl.arange(0, BR)
    r_ok = r < HIDDEN
    e = tl.load(ids_ptr + pair).to(tl.int64)
    w = tl.load(w_ptr + pair).to(tl.float32)
    y = _rows_dot(blocks_ptr + e * stride_be + r.to(tl.int64) * stride_br,
                  scales_ptr + e * stride_se + r.to(tl.int64) * stride_sr,
                  h_ptr + pair * INTER, r_ok, INTER // 32, GB, PTX)
    y += tl.load(bias_ptr + e * stride_bias + r, mask=r_ok, other=0.0).to(tl.float32)
    tl.store(part_ptr + pair * HIDDEN + r, w * y, mask=r_ok)


def triton_moe_gemv(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    gate_up_blocks: torch.Tensor, gate_up_scales: torch.Tensor, gate_up_bias: torch.Tensor,
    down_blocks: torch.Tensor, down_scales: torch.Tensor, down_bias: torch.Tensor,
    alpha: float, limit: float, block_j: int = 4, block_r: int = 8, blocks_per_step: int = 16,
    num_warps: int = 4, ptx: bool | None = None,
) -> torch.Tensor:
    """Per routed expert, its weighted output: ``[T, K, hidden]`` fp32 (two launches).

    Args:
        x: ``[T, hidden]`` activations (bf16, fp16 or fp32); weights: ``[T, K]`` routing weights;
            ids: ``[T, K]`` int expert ids (on the device: no host sync, capturable).
        gate_up_blocks: uint8 ``[E, 2I, hidden/32, 16]``, gate_up_scales: uint8 ``[E, 2I, hidden/32]``,
            gate_up_bias ``[E, 2I]`` (rows interleaved: ``2j`` gate, ``2j+1`` up).
        down_blocks: uint8 ``[E, hidden, I/32, 16]``, down_scales: uint8 ``[E, hidden, I/32]``,
            down_bias ``[E, hidden]``.
        alpha, limit: the clamped SwiGLU's constants (GPT-OSS: 1.702, 7.0).
        block_j: SwiGLU outputs per gate_up program; block_r: output rows per down program;
            blocks_per_step: 32-value blocks loaded per step (one per thread); num_warps: per program.
            Defaults: the best that ``python -m benchmarks.kernels --kernels triton_fp32`` found on an H200 at gpt-oss-120b's shape.
        ptx: decode with inline PTX (default: on CUDA; Triton's CPU interpreter needs False).

    Returns:
        ``[T, K, hidden]`` fp32; ``x + out.sum(1)`` (in order) is the MoE layer with its residual.

    Raises:
        ValueError: packed tensors not contiguous uint8 ``[..., G, 16]``, or widths not multiples of 32.
    """
    t, hidden, k, inter = check_packed_moe(x, ids, gate_up_blocks, down_blocks)
    if ptx is None:
        ptx = x.is_cuda and not torch.version.hip
    pairs = t * k
    x, ids, weights = x.contiguous(), ids.contiguous(), weights.contiguous()
    h = torch.empty(pairs, inter, dtype=torch.float32, device=x.device)
    _gate_up_kernel[(pairs, triton.cdiv(inter, block_j))](
        x, ids, gate_up_blocks, gate_up_scales, gate_up_bias, h,
        gate_up_blocks.stride(0), gate_up_blocks.stride(1), gate_up_scales.stride(0), gate_up_scales.stride(1),
        gate_up_bias.stride(0), inter, alpha, limit,
        K=k, HIDDEN=hidden, BJ=block_j, GB=blocks_per_step, PTX=ptx, num_warps=num_warps,
    )
    out = torch.empty(t, k, hidden, dtype=torch.float32, device=x.device)
    _down_kernel[(pairs, triton.cdiv(hidden, block_r))](
        h, ids, weights, down_blocks, down_scales, down_bias, out,
        down_blocks.stride(0), down_blocks.stride(1), down_scales.stride(0), down_scales.stride(1),
        down_bias.stride(0), hidden,
        INTER=inter, BR=block_r, GB=blocks_per_step, PTX=ptx, num_warps=num_warps,
    )
    return out

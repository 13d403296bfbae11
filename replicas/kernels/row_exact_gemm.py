"""Row-exact GEMMs: ``y = x W^T + b`` where each row of ``y`` is bitwise the same whatever other rows share the launch.

A GEMM library picks its tile shape, instruction and split-K factor from the problem size (cuBLAS's
heuristics do), so a row's fp32 reduction order, and with it the bf16-rounded result, changes with the number
of rows beside it. Then a greedy request's tokens depend on the load (``docs/exactness.md``). These kernels fix
everything that decides a row's arithmetic independently of the row count ``M``: the tile shape, the warps,
the instruction (Triton's ``tl.dot`` on constant block shapes), and the order of the reduction over ``K``.
``M`` only decides how many programs run; it is never specialised on (``do_not_specialize``).

Two families, each with one fixed configuration, so the rows of one family always agree with each other:

* :func:`decode_gemm` (decode rows, 1..256 per step, memory-bound): the weights are the *left* operand
  (``[BLOCK_N, BLOCK_K]`` weight rows times ``[BLOCK_K, SUB_M]`` activation columns, "swap AB"), so one
  16-column MMA tile serves up to 16 rows with no padding of the weight side. ``K`` is cut into fixed
  chunks of ``chunk_steps(K)`` K-steps; each chunk is accumulated from zero and the chunk sums are added in
  chunk order, ``(((0 + c_0) + c_1) + ...)``. Whether one program adds its chunks in registers or the chunks
  run in separate programs (split-K, for parallelism when there are few rows) and a second launch adds
  them in the same order, the additions are the same: the split factor is free, the bits are not affected.
* :func:`prefill_gemm` (prompt tokens, compute-bound): a plain ``128 x 128 x 64`` tile, eight warps, one
  program per output tile and the ``K`` loop in registers: the same for 1 or 8,192 tokens.

Rows of the two families are not meant to agree with each other (a prompt token and a generated token are
different rows); the engine keeps them apart (``docs/exactness.md``). References: ``torch.nn.functional.linear``
computes the same function (fp32 accumulation, one rounding to the output dtype); the tests compare against
it with a tolerance and against the kernels themselves at other row counts with exact equality.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

DECODE_BLOCK_N = 64
"""Weight rows (output columns) per decode program: one 64-row wgmma/MMA M dimension."""

DECODE_BLOCK_K = 64
"""Inputs per K step of the decode family."""

DECODE_SUB_M = 16
"""Activation rows per decode program (the MMA's N dimension; 16 is ``tl.dot``'s smallest)."""

DECODE_WARPS = 4
DECODE_STAGES = 4

MAX_CHUNKS = 8
"""The decode family cuts ``K`` into at most this many chunks (:func:`chunk_steps`)."""

PREFILL_TILE = (128, 128, 64)
"""``(BLOCK_M, BLOCK_N, BLOCK_K)`` of the prefill family."""

PREFILL_WARPS = 8
PREFILL_STAGES = 3
PREFILL_GROUP_M = 8
"""Programs are ordered in groups of this many M-tiles per N-tile column (L2 reuse; no effect on the bits)."""


def chunk_steps(k: int) -> int:
    """K-steps of :data:`DECODE_BLOCK_K` inputs per chunk for a reduction of length ``k``: the fewest that cut
    ``k`` into at most :data:`MAX_CHUNKS` chunks. A function of ``k`` alone (never of the rows)."""
    return triton.cdiv(triton.cdiv(k, DECODE_BLOCK_K), MAX_CHUNKS)


@functools.lru_cache(maxsize=8)
def _programs_wanted(device_index: int | None) -> int:
    """Two programs per streaming multiprocessor (4 off the GPU: Triton's interpreter)."""
    if device_index is None:
        return 4
    return 2 * torch.cuda.get_device_properties(device_index).multi_processor_count


@triton.jit(do_not_specialize=["M", "chunks_per_program"])
def _decode_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   num_chunks, chunks_per_program,
                   CHUNK_STEPS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_M: tl.constexpr,
                   HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr):
    """Grid ``(cdiv(N, BLOCK_N), cdiv(M, SUB_M), splits)``. Each program adds its chunks in order; with
    ``SPLIT`` it stores each chunk's sum in ``part`` ``[num_chunks, M, N]`` fp32 instead (the reduce launch adds
    them in the same order)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * SUB_M + tl.arange(0, SUB_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    total = tl.zeros([BLOCK_N, SUB_M], tl.float32)
    c_lo = pid_s * chunks_per_program
    c_hi = tl.minimum(c_lo + chunks_per_program, num_chunks)
    for c in range(c_lo, c_hi):
        part = tl.zeros([BLOCK_N, SUB_M], tl.float32)
        for step in range(CHUNK_STEPS):
            k = (c * CHUNK_STEPS + step) * BLOCK_K + offs_k
            k_ok = k < K
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0)  # [BLOCK_N, BLOCK_K]
            xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + k[:, None], mask=k_ok[:, None] & m_ok[None, :],
                         other=0.0)  # [BLOCK_K, SUB_M]
            part = tl.dot(w, xt, part, input_precision=PRECISION)
        if SPLIT:
            dst = part_ptr + c * M * N + offs_m[None, :] * N + offs_n[:, None]
            tl.store(dst, part, mask=n_ok[:, None] & m_ok[None, :])
        else:
            total = total + part
    if not SPLIT:
        if HAS_BIAS:
            total = total + tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        dst = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
        tl.store(dst, total.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _reduce_kernel(part_ptr, b_ptr, y_ptr, M, N, stride_ym, num_chunks, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """Grid ``(cdiv(N, BLOCK), M)``: ``y[m] = ((0 + part[0, m]) + part[1, m]) + ... (+ bias)``, rounded once."""
    pid_n = tl.program_id(0)
    m = tl.program_id(1)
    offs = pid_n * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.zeros([BLOCK], tl.float32)
    for c in range(0, num_chunks):
        acc = acc + tl.load(part_ptr + c * M * N + m * N + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


def _prepare(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the operands; return ``x`` with contiguous elements and the empty ``[M, N]`` output.

    Raises:
        ValueError: as :func:`decode_gemm` says."""
    _check(x, weight, bias)
    if x.stride(1) != 1:
        x = x.contiguous()
    return x, torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"row-exact GEMM needs x [M, K] and weight [N, K]; got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype} but weight is {weight.dtype}")
    if weight.stride(1) != 1:
        raise ValueError("weight rows must be contiguous")
    if bias is not None and (bias.shape != (weight.shape[0],) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{weight.shape[0]}] vector")


def decode_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                splits: int | None = None) -> torch.Tensor:
    """``x W^T + b`` for decode rows, each row bitwise independent of ``M`` and of the other rows.

    Args:
        x: ``[M, K]`` bf16/fp16/fp32 activations (rows may be strided; elements contiguous).
        weight: ``[N, K]`` in ``x.dtype``, rows contiguous.
        bias: optional ``[N]`` (any float dtype, added in fp32 before the one rounding).
        splits: programs along ``K`` (split-K; at most the chunk count). None: enough to give the GPU about
            two programs per multiprocessor. Any value gives the same bits (the module docstring says why).

    Returns:
        ``[M, N]`` in ``x.dtype``: fp32 accumulation (IEEE fp32 products for fp32 inputs), one rounding.

    Raises:
        ValueError: mismatched shapes or dtypes, or non-contiguous weight rows or bias.
    """
    x, y = _prepare(x, weight, bias)
    (m, k), n = x.shape, weight.shape[0]
    if m == 0:
        return y
    steps = chunk_steps(k)
    num_chunks = triton.cdiv(triton.cdiv(k, DECODE_BLOCK_K), steps)
    n_blocks, m_blocks = triton.cdiv(n, DECODE_BLOCK_N), triton.cdiv(m, DECODE_SUB_M)
    if splits is None:
        index = x.device.index if x.is_cuda else None
        if x.is_cuda and index is None:
            index = torch.cuda.current_device()
        splits = max(1, _programs_wanted(index) // (n_blocks * m_blocks))
    per_program = triton.cdiv(num_chunks, max(1, min(splits, num_chunks)))
    splits = triton.cdiv(num_chunks, per_program)
    split = splits > 1
    part = torch.empty(num_chunks, m, n, dtype=torch.float32, device=x.device) if split else y
    precision = "ieee" if x.dtype == torch.float32 else None
    _decode_kernel[(n_blocks, m_blocks, splits)](
        x, weight, bias if bias is not None else weight, y, part, m, n, k, x.stride(0), weight.stride(0),
        y.stride(0), num_chunks, per_program, CHUNK_STEPS=steps, BLOCK_N=DECODE_BLOCK_N, BLOCK_K=DECODE_BLOCK_K,
        SUB_M=DECODE_SUB_M, HAS_BIAS=bias is not None and not split, SPLIT=split, PRECISION=precision,
        num_warps=DECODE_WARPS, num_stages=DECODE_STAGES)
    if split:
        block = 256
        _reduce_kernel[(triton.cdiv(n, block), m)](part, bias if bias is not None else part, y, m, n, y.stride(0),
                                                   num_chunks, HAS_BIAS=bias is not None, BLOCK=block)
    return y


@triton.jit(do_not_specialize=["M"])
def _prefill_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr):
    """Grid ``(cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),)``; one output tile per program, ``K`` in order."""
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(M, BLOCK_M)
    n_tiles = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * n_tiles
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(m_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + offs_n[None, :] * stride_wn + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    dst = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(dst, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def prefill_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` for prompt tokens: one fixed tile (:data:`PREFILL_TILE`), so each row is bitwise the same
    whatever the token count and the other tokens. Arguments, result and errors as :func:`decode_gemm`
    (without ``splits``)."""
    x, y = _prepare(x, weight, bias)
    (m, k), n = x.shape, weight.shape[0]
    if m == 0:
        return y
    bm, bn, bk = PREFILL_TILE
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _prefill_kernel[grid](x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0),
                          weight.stride(0), y.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                          GROUP_M=PREFILL_GROUP_M, HAS_BIAS=bias is not None,
                          PRECISION="ieee" if x.dtype == torch.float32 else None,
                          num_warps=PREFILL_WARPS, num_stages=PREFILL_STAGES)
    return y

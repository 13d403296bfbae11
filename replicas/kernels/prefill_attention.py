"""Triton prefill attention over the paged KV cache: variable-length batches, causal, GQA, sinks, window.

One launch serves a whole forward's new tokens (prompt chunks after cached
context and single decode tokens alike). The ``T`` new tokens are the
concatenation of ``B`` sequences' tokens (``query_start``); sequence ``i``'s
``q_len_i`` tokens sit at absolute positions ``context_len_i - q_len_i ..
context_len_i - 1`` and their keys/values are already written to the cache
(:func:`replicas.kernels.paged_attention.write_kv`). Query token ``t`` at
position ``p`` sees keys at positions ``<= p`` (causal), and with a sliding
window ``W`` only those ``> p - W`` (transformers' ``sliding_window_overlay``).

Work split (FlashAttention-2, Dao 2023, §3.1: one program per query tile,
online softmax over key tiles, nothing materialized beyond one tile of
scores): a program owns ``BLOCK_T`` consecutive new tokens of one sequence and
*all* ``G = H / KVH`` query heads of one KV head, packed as the rows of one
``[BLOCK_T * GP, D]`` query tile (row ``r`` = token ``r // GP``, head ``r % GP``
of the group; ``GP`` = ``G`` rounded up to a power of two). Each key/value tile
is then loaded once for the whole group (GQA), gathered through the block table
page by page (``PAGE_SIZE`` = 16 tokens per page). Key tiles that every row of
the program sees in full skip the masking; only the causal diagonal and the
window's far edge are masked.

Softmax in base 2 with fp32 statistics: scores are scaled by
``scale * log2(e)``; the running maximum ``m``, denominator ``l`` and output
``acc`` are rescaled by ``2**(m_old - m_new)`` per key tile. Sinks (GPT-OSS's
per-head learned logits, transformers' ``eager_attention_forward``) join the
denominator once at the end: ``l += 2**(sink * log2(e) - m)``, their
probability mass dropped. Probabilities are rounded to the value dtype for the
``P V`` product, as FlashAttention does.

Every multiply and add is rounded on its own (the launch turns Triton's FMA
contraction off). Otherwise the unmasked key loop computes ``2**(s * scale - m)``
with one fused multiply-add while the masked loops, whose ``where`` sits between
the multiply and the subtraction, round twice; a query's probabilities would then
depend on whether a key tile fell in a masked or the unmasked loop, which depends
on where its chunk and its query tile start (docs/exactness.md, "Chunked prefill").

The tile map (which sequence and first token each program takes) is built on
the device from ``query_start`` (:func:`tile_map`), so the only host input is
the number of tiles, a function of the host-known chunk lengths.

Reference (and CPU path): :func:`replicas.kernels.paged_attention.paged_attention_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

PAGE = 16
"""Tokens per KV page (the cache geometry of :mod:`replicas.kernels.paged_attention`)."""

BLOCK_M = 128
"""Query rows per program (``BLOCK_T`` tokens x ``GP`` heads of one KV head)."""

BLOCK_N = 64
"""Keys per inner iteration (four 16-token pages)."""

NUM_WARPS = 4
NUM_STAGES = 2

LOG2E = 1.4426950408889634


def tokens_per_tile(num_heads: int, num_kv_heads: int, block_m: int | None = None) -> int:
    """New tokens per program: ``BLOCK_M // GP`` (at least 1), ``GP`` = the GQA group rounded up to a power of 2."""
    gp = triton.next_power_of_2(num_heads // num_kv_heads)
    return max(1, (block_m or BLOCK_M) // gp)


def tile_map(query_start: torch.Tensor, block_t: int, num_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which sequence and which of its new tokens each program starts at, computed on the device.

    Args:
        query_start: ``[B + 1]`` int32/int64 cumulative new-token offsets (on the kernel's device).
        block_t: new tokens per program (:func:`tokens_per_tile`).
        num_tiles: ``sum_i ceil(q_len_i / block_t)`` (host-known: the chunk lengths are).

    Returns:
        ``(tile_seq [num_tiles] int32, tile_first [num_tiles] int32)``.
    """
    q_lens = (query_start[1:] - query_start[:-1]).to(torch.int64)
    tiles = (q_lens + block_t - 1) // block_t  # [B]
    seq = torch.repeat_interleave(torch.arange(q_lens.shape[0], device=query_start.device), tiles,
                                  output_size=num_tiles)
    first_tile = torch.cumsum(tiles, 0) - tiles  # [B] index of each sequence's first program
    first = (torch.arange(num_tiles, device=query_start.device) - first_tile[seq]) * block_t
    return seq.to(torch.int32), first.to(torch.int32)


def num_tiles_for(q_lens: list[int], block_t: int) -> int:
    """``sum(ceil(n / block_t))`` over host-known chunk lengths."""
    return sum(-(-n // block_t) for n in q_lens)


@triton.jit
def _attend(acc, m_i, l_i, q, k_ptr, v_ptr, table_ptr, kv_off, start, end, qpos, window, scale_log2,
            stride_kb, stride_kt, stride_vb, stride_vt,
            MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
            PAGE: tl.constexpr, PRECISION: tl.constexpr):
    """Online softmax over keys ``[start, end)``; ``MASKED`` applies causality, the window and ``< end``."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    for base in range(start, end, BLOCK_N):
        kpos = base + offs_n
        if MASKED:
            kmask = kpos < end
            page = tl.load(table_ptr + kpos // PAGE, mask=kmask, other=0).to(tl.int64)
        else:
            page = tl.load(table_ptr + kpos // PAGE).to(tl.int64)
        slot = kpos % PAGE
        k_addr = page * stride_kb + slot * stride_kt + kv_off
        v_addr = page * stride_vb + slot * stride_vt + kv_off
        if MASKED:
            k = tl.load(k_ptr + k_addr[:, None] + offs_d[None, :], mask=kmask[:, None], other=0.0)
            v = tl.load(v_ptr + v_addr[:, None] + offs_d[None, :], mask=kmask[:, None], other=0.0)
        else:
            k = tl.load(k_ptr + k_addr[:, None] + offs_d[None, :])
            v = tl.load(v_ptr + v_addr[:, None] + offs_d[None, :])
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N] fp32
        if MASKED:
            vis = (kpos[None, :] <= qpos[:, None]) & kmask[None, :]
            if HAS_WINDOW:
                vis = vis & (kpos[None, :] > qpos[:, None] - window)
            s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _prefill_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, sinks_ptr, query_start_ptr, context_lens_ptr, table_ptr,
    tile_seq_ptr, tile_first_ptr, scale_log2, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_tb,
    G: tl.constexpr, GP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
    PAGE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid ``(num_tiles, KVH)``; see the module docstring."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    first = tl.load(tile_first_ptr + tile)
    q_start = tl.load(query_start_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_ptr + seq + 1).to(tl.int32) - q_start
    ctx = tl.load(context_lens_ptr + seq).to(tl.int32)
    table_ptr += seq.to(tl.int64) * stride_tb

    BLOCK_M: tl.constexpr = BLOCK_T * GP
    rows = tl.arange(0, BLOCK_M)
    tok = first + rows // GP  # new-token index within the sequence
    g = rows % GP
    row_ok = (tok < q_len) & (g < G)
    head = kvh * G + g
    qpos = ctx - q_len + tok  # absolute positions
    offs_d = tl.arange(0, D)
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)

    n_valid = tl.minimum(BLOCK_T, q_len - first)
    pos_first = ctx - q_len + first
    pos_last = pos_first + n_valid - 1
    hi = pos_last + 1  # keys [lo, hi) are visible to some row
    lo = 0
    full_lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(pos_first - window + 1, 0) // BLOCK_N * BLOCK_N
        full_lo = tl.maximum(pos_last - window + 1, 0)
    full_hi = pos_first + 1  # keys [full_lo, full_hi) are visible to every row
    # Key tiles start at multiples of BLOCK_N (absolute positions), whichever query tile this is, so a query's
    # online softmax sees the same key tiles in the same order however its prompt was cut into chunks and
    # tiles (docs/exactness.md); keys below the window's edge are masked like any other invisible key.
    a_end = tl.minimum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, hi)
    b_end = a_end + tl.maximum(full_hi - a_end, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    kv_off = kvh * stride_kh
    acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_ptr, v_ptr, table_ptr, kv_off, lo, a_end, qpos, window,
                            scale_log2, stride_kb, stride_kt, stride_vb, stride_vt, True, HAS_WINDOW, BLOCK_N, D,
                            PAGE, PRECISION)
    acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_ptr, v_ptr, table_ptr, kv_off, a_end, b_end, qpos, window,
                            scale_log2, stride_kb, stride_kt, stride_vb, stride_vt, False, HAS_WINDOW, BLOCK_N, D,
                            PAGE, PRECISION)
    acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_ptr, v_ptr, table_ptr, kv_off, b_end, hi, qpos, window,
                            scale_log2, stride_kb, stride_kt, stride_vb, stride_vt, True, HAS_WINDOW, BLOCK_N, D,
                            PAGE, PRECISION)

    m_f = m_i
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        m_f = tl.maximum(m_i, sink)
    m_safe = tl.where(m_f == float("-inf"), 0.0, m_f)
    w = tl.exp2(m_i - m_safe)
    denom = l_i * w
    if HAS_SINKS:
        denom += tl.exp2(sink - m_safe)
    out = acc * tl.where(denom > 0, w / denom, 0.0)[:, None]
    tl.store(o_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def launch_meta(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, windowed: bool,
                has_sinks: bool, config: dict[str, int]) -> dict:
    """The kernel's compile-time arguments and options for one launch (every key but ``num_stages``, which
    the launch adds): the constexprs, ``num_warps`` from ``config``, and ``enable_fp_fusion=False`` (no FMA
    contraction, see the module docstring)."""
    group = num_heads // num_kv_heads
    return dict(G=group, GP=triton.next_power_of_2(group),
                BLOCK_T=tokens_per_tile(num_heads, num_kv_heads, config["BLOCK_M"]), BLOCK_N=config["BLOCK_N"],
                D=head_dim, PAGE=PAGE, HAS_WINDOW=windowed, HAS_SINKS=has_sinks,
                PRECISION="ieee" if dtype == torch.float32 else None, num_warps=config["num_warps"],
                enable_fp_fusion=False)


def triton_prefill_attention(
    query: torch.Tensor, key_plane: torch.Tensor, value_plane: torch.Tensor, query_start: torch.Tensor,
    context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, num_tiles: int, *,
    sinks: torch.Tensor | None = None, sliding_window: int | None = None,
    tiles: tuple[torch.Tensor, torch.Tensor] | None = None, out: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged context, in one launch.

    Args:
        query: ``[T, H, D]`` (bf16/fp16/fp32; ``D`` a power of two, last dim contiguous).
        key_plane, value_plane: ``[num_blocks, PAGE_SIZE, KVH, D]`` of one layer, the new tokens' K/V written.
        query_start: ``[B + 1]`` int32/int64 cumulative new-token offsets, on the device.
        context_lens: ``[B]`` int32/int64 KV lengths after this forward (cached + new), on the device.
        block_tables: ``[B, max_blocks]`` int32/int64 page ids (rows padded; only the pages holding
            positions ``< context_lens[i]`` are read).
        scale: softmax scale (``D ** -0.5``).
        num_tiles: :func:`num_tiles_for` of the chunk lengths with :func:`tokens_per_tile`'s tokens per program.
        sinks: optional ``[H]`` per-head sink logits.
        sliding_window: optional window ``W`` in tokens (keys at ``(p - W, p]``).
        tiles: :func:`tile_map`'s result when the caller shares it across layers (else built here).
        out: optional ``[T, H, D]`` output buffer.
        config: tile settings other than the defaults (keys ``BLOCK_M``, ``BLOCK_N``, ``num_warps``,
            ``num_stages``; a benchmark's sweep passes them, serving never does); ``tiles`` and ``num_tiles``
            must then come from :func:`tokens_per_tile` with that ``BLOCK_M``.

    Returns:
        ``[T, H, D]`` in ``query.dtype``; fp32 softmax statistics. fp32 inputs take IEEE-exact fp32 dot products.

    Raises:
        ValueError: ``D`` not a power of two, or heads not a multiple of the KV heads.
    """
    t, num_heads, head_dim = query.shape
    kvh = key_plane.shape[2]
    if head_dim & (head_dim - 1) or num_heads % kvh:
        raise ValueError(f"prefill attention needs a power-of-two head_dim and H % KVH == 0, got D={head_dim}, "
                         f"H={num_heads}, KVH={kvh}")
    config = {"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "num_warps": NUM_WARPS, "num_stages": NUM_STAGES,
              **(config or {})}
    meta = launch_meta(num_heads, kvh, head_dim, query.dtype, sliding_window is not None, sinks is not None, config)
    block_t = meta["BLOCK_T"]
    if tiles is None:
        tiles = tile_map(query_start, block_t, num_tiles)
    out = torch.empty_like(query) if out is None else out
    if num_tiles == 0 or t == 0:
        return out
    if query.stride(-1) != 1 or key_plane.stride(-1) != 1 or value_plane.stride(-1) != 1:
        raise ValueError("prefill attention needs the head dim contiguous in query and the cache planes")
    args = (query, key_plane, value_plane, out, sinks if sinks is not None else query, query_start, context_lens,
            block_tables, tiles[0], tiles[1], scale * LOG2E, sliding_window or 0,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            key_plane.stride(0), key_plane.stride(1), key_plane.stride(2),
            value_plane.stride(0), value_plane.stride(1), value_plane.stride(2), block_tables.stride(0))
    stages = 1 if _ONE_STAGE else config["num_stages"]
    try:
        _prefill_attention_kernel[(num_tiles, kvh)](*args, **meta, num_stages=stages)
    except OutOfResources:  # the tile does not fit the GPU's shared memory pipelined: run it in one stage
        if stages == 1:
            raise
        _ONE_STAGE.append(True)
        _prefill_attention_kernel[(num_tiles, kvh)](*args, **meta, num_stages=1)
    return out


_ONE_STAGE: list[bool] = []
"""Non-empty once a launch ran out of shared memory with :data:`NUM_STAGES`: one stage from then on."""


def attention_flops(q_lens: list[int], context_lens: list[int], num_heads: int, head_dim: int,
                    window: int | None = None) -> float:
    """Useful FLOPs of causal attention: ``4 * H * D`` per visible (query, key) pair (``QK^T`` and ``PV``).

    Query ``j`` (0-based) of a chunk of ``n`` ending at context ``c`` sees ``min(c - n + j + 1, W)`` keys."""
    pairs = 0
    for n, ctx in zip(q_lens, context_lens, strict=True):
        first = ctx - n + 1  # keys seen by the chunk's first query without a window
        if window is None or ctx <= window:
            pairs += n * first + n * (n - 1) // 2
        else:
            below = max(0, min(n, window - first + 1))  # queries that see fewer than W keys
            pairs += below * first + below * (below - 1) // 2 + (n - below) * window
    return 4.0 * num_heads * head_dim * pairs

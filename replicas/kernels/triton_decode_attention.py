"""Triton paged decode attention for one query token (batch one), CUDA-graph capturable.

Same contract as the torch reference
:func:`replicas.kernels.decode_ops.static_decode_attention`: the context
length is read from device memory, so one compiled kernel (and one captured
graph) serves every length; unlike the reference it reads only the pages that
hold visible keys (``ceil(context_len / 16)`` of them, or the window's), not the
whole padded block table.

One program per (KV head, split): the G = H / KVH query heads that share a KV
head are processed together (GQA), and the context is split across
``num_splits`` programs (split-K, as in flash-decoding) whose partial results
(running max, denominator, weighted sum) are merged by a second small kernel.
Scores and the softmax are fp32; sinks add ``exp(sink)`` to the denominator
(GPT-OSS, transformers' ``eager_attention_forward``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replicas.kernels.paged_attention import PAGE_SIZE
from replicas.kernels.pdl import pdl_args, pdl_wait

TOKENS_PER_ITER = 64
"""Keys per inner iteration: four 16-token pages gathered into one tile."""

SPLITS = 16
"""Split count when more than 8 (sequence, KV head) pairs share the launch (the standard lane's batches;
``python -m benchmarks.kernels --kernels attention``)."""

FEW_HEADS_SPLITS = 32
"""Split count when at most 8 (sequence, KV head) pairs share the launch (batch one: gpt-oss's 8 KV heads,
SmolLM2's 3). A split covers ``cdiv(cdiv(context, splits), 64) * 64`` tokens, so at 1,152 tokens 16 splits
leave 9 programs per KV head with two dependent 64-token iterations each, and 32 leave 18 with one
(``docs/decisions/0013-decode-attention-splits.md`` compares 8, 16 and 32 inside the decode step)."""


ONE_PASS_WINDOW = 128
"""Sliding windows up to this many tokens take one program per (sequence, KV head) that also normalizes and
writes the output (no merge launch): gpt-oss's 128-token window is one 128-key tile
(:data:`ONE_PASS_BLOCK`), while split across programs it left all but two of 32 splits empty and still paid
the merge launch. 0 turns it off."""


ONE_PASS_BLOCK = 128
"""Keys per iteration of the one-pass (windowed) launch: 128, a whole gpt-oss window in one tile, so a
program makes one iteration (``docs/decisions/0014-one-pass-window-attention.md`` compares it with 64-key tiles)."""

ONE_PASS_WARPS = 4
"""Warps per program of the one-pass (windowed) launch."""


def default_splits(num_kv_heads: int, batch: int, sliding_window: int | None = None) -> int:
    """1 for a sliding window of at most :data:`ONE_PASS_WINDOW` tokens; else :data:`FEW_HEADS_SPLITS` when
    ``num_kv_heads * batch <= 8``, else :data:`SPLITS`."""
    if sliding_window is not None and 0 < sliding_window <= ONE_PASS_WINDOW:
        return 1
    return FEW_HEADS_SPLITS if num_kv_heads * batch <= 8 else SPLITS


@triton.jit
def _with_sinks(m, sink_ptrs, mask, HAS_SINKS: tl.constexpr):
    """The shift for a softmax whose running max over the keys is ``m``, and what the sinks add to its
    denominator: ``(m_safe, exp(sink - m_safe))`` with ``m_safe = max(m, sink)`` (0 where that is ``-inf``:
    no keys, no sink) and the sink loaded at ``sink_ptrs`` (GPT-OSS's per-head learned sinks, transformers'
    ``eager_attention_forward``); without sinks ``(m_safe, 0)``."""
    sink_term = tl.zeros_like(m)
    if HAS_SINKS:
        sink = tl.load(sink_ptrs, mask=mask, other=0.0).to(tl.float32)
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    if HAS_SINKS:
        sink_term = tl.exp(sink - m_safe)
    return m_safe, sink_term


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, ctx_ptr, part_m_ptr, part_l_ptr, part_o_ptr,
    scale, stride_kb, stride_kt, stride_kh, num_splits, window, stride_tb, num_kvh, stride_ctx,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr,
    HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
    sinks_ptr=None, out_ptr=None, FINAL: tl.constexpr = False, HAS_SINKS: tl.constexpr = False,
):
    """Grid ``(KVH, splits, B)``. With ``FINAL`` (one split) the program applies the sinks and writes the
    output itself, as :func:`_merge_kernel` would from one partial."""
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2)
    pdl_wait(PDL)  # the query and this step's K/V come from the RoPE + KV-write launch
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    offs_t = tl.arange(0, BLOCK)
    g_mask = offs_g < G
    q_ptr += seq * num_kvh * G * D
    table_ptr += seq * stride_tb
    q = tl.load(q_ptr + (kvh * G + offs_g)[:, None] * D + offs_d[None, :], mask=g_mask[:, None], other=0.0)
    ctx = tl.load(ctx_ptr + seq * stride_ctx)  # 0 for a padding row of a CUDA-graph batch: nothing is read
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx - window, 0)
    span = ctx - lo
    per_split = tl.cdiv(tl.cdiv(span, num_splits), BLOCK) * BLOCK
    start = lo + split * per_split
    end = tl.minimum(start + per_split, ctx)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for base in range(start, end, BLOCK):
        pos = base + offs_t
        valid = pos < end
        page = tl.load(table_ptr + pos // PAGE, mask=valid, other=0)
        addr = page * stride_kb + (pos % PAGE) * stride_kt + kvh * stride_kh
        k = tl.load(k_ptr + addr[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + addr[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)  # with k: one wait
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale  # [GP, BLOCK]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    if FINAL:
        m_safe, sink_term = _with_sinks(m_i, sinks_ptr + kvh * G + offs_g, g_mask, HAS_SINKS)
        w = tl.exp(m_i - m_safe)
        denom = l_i * w + sink_term
        out = tl.where(denom[:, None] > 0, acc * (w / denom)[:, None], 0.0)  # a padding row (no keys) gives 0
        dst = out_ptr + (seq * num_kvh * G + kvh * G + offs_g)[:, None] * D + offs_d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        out_row = ((seq * num_kvh + kvh) * num_splits + split) * GP + offs_g
        tl.store(part_m_ptr + out_row, m_i)
        tl.store(part_l_ptr + out_row, l_i)
        tl.store(part_o_ptr + out_row[:, None] * D + offs_d[None, :], acc)


@triton.jit
def _merge_kernel(
    part_m_ptr, part_l_ptr, part_o_ptr, sinks_ptr, out_ptr, num_splits, num_kvh,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, SPLITS_P: tl.constexpr, HAS_SINKS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid ``(KVH, G, B)``: one query head per program; all its splits' partials loaded at once (one
    round trip to memory instead of one per split)."""
    kvh = tl.program_id(0)
    g = tl.program_id(1)
    seq = tl.program_id(2)
    pdl_wait(PDL)
    offs_s = tl.arange(0, SPLITS_P)
    offs_d = tl.arange(0, D)
    s_mask = offs_s < num_splits
    rows = ((seq * num_kvh + kvh) * num_splits + offs_s) * GP + g  # [S]
    m = tl.load(part_m_ptr + rows, mask=s_mask, other=float("-inf"))
    den = tl.load(part_l_ptr + rows, mask=s_mask, other=0.0)
    o = tl.load(part_o_ptr + rows[:, None] * D + offs_d[None, :], mask=s_mask[:, None], other=0.0)  # [S, D]
    m_safe, sink_term = _with_sinks(tl.max(m, 0), sinks_ptr + kvh * G + g, g < G, HAS_SINKS)
    w = tl.exp(m - m_safe)  # [S]
    denom = tl.sum(den * w, 0) + sink_term
    acc = tl.sum(o * w[:, None], 0)  # [D]
    out = tl.where(denom > 0, acc / denom, 0.0)  # a padding row (no keys) gives 0
    tl.store(out_ptr + (seq * num_kvh * G + kvh * G + g) * D + offs_d, out.to(out_ptr.dtype.element_ty))


def triton_decode_attention(
    query: torch.Tensor, key_plane: torch.Tensor, value_plane: torch.Tensor,
    block_table: torch.Tensor, context_len: torch.Tensor, scale: float, *,
    sinks: torch.Tensor | None = None, sliding_window: int | None = None, num_splits: int | None = None,
    workspace: dict | None = None, pdl: bool = True,
) -> torch.Tensor:
    """Decode attention of ``query`` ``[B, H, D]`` (one token per sequence) over each sequence's paged
    context; see the module docstring.

    Args:
        key_plane, value_plane: ``[num_blocks, PAGE_SIZE, KVH, D]``, contiguous in the last two dims.
        block_table: ``[B, max_blocks]`` (or ``[max_blocks]`` for ``B = 1``) int64 page ids;
            context_len: ``[B]`` int64 (on the device; 0 marks a padding row, whose output is 0).
        num_splits: programs per KV head along the context (split-K; 1: no merge launch); None:
            :func:`default_splits`.
        workspace: optional dict reused across calls for the partial buffers (:func:`partial_buffers`:
            a buffer handed to a launch stays allocated as long as the dict, so captured graphs of any batch
            size sharing it stay valid).

    Returns:
        ``[B, H, D]`` in ``query.dtype``.
    """
    batch, num_heads, head_dim = query.shape
    block_table = block_table.view(batch, -1) if block_table.dim() == 1 else block_table
    kvh = key_plane.shape[2]
    num_splits = num_splits or default_splits(kvh, batch, sliding_window)
    group = num_heads // kvh
    gp = max(16, triton.next_power_of_2(group))
    out = torch.empty_like(query)
    q = query.contiguous()
    common = dict(G=group, GP=gp, D=head_dim, PAGE=PAGE_SIZE, HAS_WINDOW=sliding_window is not None,
                  PRECISION="ieee" if query.dtype == torch.float32 else None, **pdl_args(q, pdl))
    args = (q, key_plane, value_plane, block_table, context_len)
    strides = (scale, key_plane.stride(0), key_plane.stride(1), key_plane.stride(2), num_splits,
               sliding_window or 0, block_table.stride(0), kvh, context_len.stride(0))
    if num_splits == 1:  # the one program per KV head normalizes and writes the output
        _split_kernel[(kvh, 1, batch)](*args, q, q, q, *strides, sinks_ptr=sinks if sinks is not None else q,
                                       out_ptr=out, FINAL=True, HAS_SINKS=sinks is not None, BLOCK=ONE_PASS_BLOCK,
                                       num_warps=ONE_PASS_WARPS, **common)
        return out
    part_m, part_l, part_o = partial_buffers(workspace if workspace is not None else {},
                                             batch * kvh * num_splits * gp, head_dim, query.device)
    _split_kernel[(kvh, num_splits, batch)](*args, part_m, part_l, part_o, *strides, BLOCK=TOKENS_PER_ITER,
                                            **common)
    _merge_kernel[(kvh, group, batch)](
        part_m, part_l, part_o, sinks if sinks is not None else q, out, num_splits, kvh,
        G=group, GP=gp, D=head_dim, SPLITS_P=triton.next_power_of_2(num_splits), HAS_SINKS=sinks is not None,
        **pdl_args(q, pdl),
    )
    return out


def partial_buffers(workspace: dict, rows: int, head_dim: int, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split-K partials of ``rows`` (sequence, KV head, split, head) rows: running maxima ``[rows]``,
    denominators ``[rows]`` and weighted sums ``[rows, head_dim]``, fp32, kept in ``workspace``.

    A CUDA graph replays the raw addresses it was captured with, and the standard lane's decode graphs of
    every batch size (and the persistent lane's quanta) share one workspace per model. So a buffer once
    handed to a launch is never freed while ``workspace`` lives: the buffers are prefix views of an arena
    that only grows (to at least twice its size), and the views of an outgrown arena stay cached here,
    keeping it allocated. (Freed, its memory would be returned to the driver by the
    ``torch.cuda.empty_cache()`` that every ``torch.cuda.graph`` capture starts with, and replaying a graph
    captured before would then fault.) The views are cached per size: one dict lookup per call.
    """
    views = workspace.setdefault("partials", {})
    key = (rows, head_dim, device)
    got = views.get(key)
    if got is None:
        arena = workspace.get("partials_arena")
        if arena is None or arena[0].shape[0] < rows or arena[2].shape[1] != head_dim or arena[0].device != device:
            size = max(rows, 2 * arena[0].shape[0]) if arena is not None and arena[0].device == device else rows
            arena = (torch.empty(size, dtype=torch.float32, device=device),
                     torch.empty(size, dtype=torch.float32, device=device),
                     torch.empty(size, head_dim, dtype=torch.float32, device=device))
            workspace["partials_arena"] = arena
        got = views[key] = (arena[0][:rows], arena[1][:rows], arena[2][:rows])
    return got

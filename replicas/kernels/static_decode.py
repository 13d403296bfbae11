"""Batch-one decode attention with static shapes (capturable in a CUDA graph).

Every tensor has a fixed shape and everything stays on the device: the block
table is padded to ``max_blocks`` pages and positions at or beyond the
context length are masked, so one captured graph serves every context length
up to ``max_blocks * PAGE_SIZE``. This is the torch reference the Triton decode
kernel will replace; it reads every page of the padded table each step.
"""

from __future__ import annotations

import torch

from replicas.kernels.paged_attention import PAGE_SIZE


def static_slot(block_table: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Flat cache slot of ``position`` ``[1]`` through ``block_table`` ``[max_blocks]`` (both int64, on device)."""
    return block_table[position // PAGE_SIZE] * PAGE_SIZE + position % PAGE_SIZE


def static_decode_attention(
    query: torch.Tensor, key_plane: torch.Tensor, value_plane: torch.Tensor,
    block_table: torch.Tensor, context_len: torch.Tensor, scale: float, *,
    sinks: torch.Tensor | None = None, sliding_window: int | None = None,
) -> torch.Tensor:
    """One query token's attention over its paged context, with static shapes.

    Args:
        query: ``[1, H, D]``.
        key_plane, value_plane: ``[num_blocks, PAGE_SIZE, KVH, D]``.
        block_table: ``[max_blocks]`` int64 page ids (padding entries may be any valid page).
        context_len: ``[1]`` int64, keys ``0 .. context_len-1`` are visible
            (the query's own KV already written at ``context_len - 1``).
        scale: softmax scale.
        sinks: optional ``[H]`` per-head sink logits (GPT-OSS; transformers'
            ``eager_attention_forward``): an extra softmax term whose mass is dropped.
        sliding_window: optional window ``W``: only keys at positions ``> context_len - 1 - W``.

    Returns:
        ``[1, H, D]`` in ``query.dtype``; the softmax runs in fp32.
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    kvh = key_plane.shape[2]
    k = key_plane.index_select(0, block_table).flatten(0, 1)  # [L, KVH, D], L = max_blocks * PAGE_SIZE
    v = value_plane.index_select(0, block_table).flatten(0, 1)
    q = query[0].view(kvh, num_heads // kvh, head_dim).float()  # [KVH, G, D]
    scores = torch.einsum("kgd,lkd->kgl", q, k.float()) * scale  # [KVH, G, L]
    pos = torch.arange(k.shape[0], device=query.device)
    visible = pos < context_len
    if sliding_window is not None:
        visible = visible & (pos > context_len - 1 - sliding_window)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(kvh, num_heads // kvh, 1)
        m = torch.maximum(scores.amax(-1, keepdim=True), sink)
        e = torch.exp(scores - m)
        probs = e / (e.sum(-1, keepdim=True) + torch.exp(sink - m))
    else:
        probs = torch.softmax(scores, -1)
    out = torch.einsum("kgl,lkd->kgd", probs, v.float())  # [KVH, G, D]
    return out.reshape(1, num_heads, head_dim).to(query.dtype)


def decode_attention(query, key_plane, value_plane, block_table, context_len, scale, *, sinks=None,
                     sliding_window=None, workspace=None):
    """Dispatch: the Triton kernel on CUDA when Triton is installed, else the torch reference above.

    Same arguments and result as :func:`static_decode_attention`; ``workspace``
    is the Triton kernel's reusable scratch dict (ignored by the reference).
    """
    if query.is_cuda and _triton_kernel() is not None:
        return _triton_kernel()(query, key_plane, value_plane, block_table, context_len, scale, sinks=sinks,
                                sliding_window=sliding_window, workspace=workspace)
    return static_decode_attention(query, key_plane, value_plane, block_table, context_len, scale, sinks=sinks,
                                   sliding_window=sliding_window)


_TRITON = []


def _triton_kernel():
    """The Triton kernel wrapped so ``torch.compile`` leaves it alone (it runs inside our CUDA graph), or None."""
    if not _TRITON:
        try:
            from replicas.kernels.triton_decode_attention import triton_decode_attention
        except ImportError:
            _TRITON.append(None)
        else:
            _TRITON.append(torch.compiler.disable(triton_decode_attention))
    return _TRITON[0]


def rope_kv_write(attn, x, cos_table, sin_table, position, block_table, key_plane, value_plane):
    """Project ``x`` ``[1, hidden]`` with ``attn``'s fused qkv, rotate q/k, write k/v to the cache; return q ``[1, H, D]``.

    One Triton launch after the GEMM on CUDA (:mod:`replicas.kernels.triton_rope_kv`); the torch
    path elsewhere (``attn.project`` + :func:`~replicas.kernels.paged_attention.write_kv`).
    """
    qkv = attn.qkv_proj(x)
    if x.is_cuda and _fused_rope_kv() is not None:
        return _fused_rope_kv()(qkv, cos_table, sin_table, position, block_table, key_plane, value_plane,
                                attn.num_heads, attn.num_kv_heads)
    from replicas.kernels.paged_attention import write_kv
    from replicas.models.llama import apply_rope

    t, d = x.shape[0], attn.head_dim
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    cos, sin = cos_table[position].to(x.dtype), sin_table[position].to(x.dtype)
    q = apply_rope(q.view(t, attn.num_heads, d), cos, sin)
    k = apply_rope(k.view(t, attn.num_kv_heads, d), cos, sin)
    write_kv(k, v.view(t, attn.num_kv_heads, d), key_plane, value_plane, static_slot(block_table, position))
    return q


_ROPE_KV = []


def _fused_rope_kv():
    """The fused Triton RoPE + KV-write kernel, hidden from ``torch.compile``, or None without Triton."""
    if not _ROPE_KV:
        try:
            from replicas.kernels.triton_rope_kv import triton_rope_kv
        except ImportError:
            _ROPE_KV.append(None)
        else:
            _ROPE_KV.append(torch.compiler.disable(triton_rope_kv))
    return _ROPE_KV[0]

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

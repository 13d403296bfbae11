"""Paged attention over the engine's KV cache (torch reference implementation).

KV cache geometry (DESIGN.md): one tensor ``[2, num_layers, num_blocks,
PAGE_SIZE, num_kv_heads, head_dim]``; each layer's key plane and value plane is
``[num_blocks, PAGE_SIZE, num_kv_heads, head_dim]``. A token at position ``p``
of a sequence lives in physical page ``block_table[p // PAGE_SIZE]`` at offset
``p % PAGE_SIZE``; its *slot* is ``page * PAGE_SIZE + offset``.

This is the reference path used on CPU and as the oracle for GPU kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

PAGE_SIZE = 16
"""Tokens per KV page (DESIGN.md, "KV cache geometry"; vLLM's default block size)."""


@dataclass
class AttentionMetadata:
    """Where this forward's tokens sit in the paged cache.

    The forward's ``T`` tokens are the concatenation of ``B`` sequences'
    new tokens; sequence ``i`` owns ``query_start[i]:query_start[i+1]``.

    Attributes:
        positions: ``[T]`` int64, absolute position of each new token.
        slot_mapping: ``[T]`` int64, flat cache slot each new token's K/V goes to.
        query_start: ``B + 1`` cumulative offsets into the ``T`` tokens.
        context_lens: ``B`` KV lengths *after* this forward (cached + new).
        block_tables: ``B`` int64 tensors of physical page ids, each covering
            at least ``ceil(context_lens[i] / PAGE_SIZE)`` pages.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start: list[int]
    context_lens: list[int]
    block_tables: list[torch.Tensor]

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def last_token_indices(self) -> torch.Tensor:
        """``[B]`` index of each sequence's last new token (whose logits we sample)."""
        return torch.tensor([s - 1 for s in self.query_start[1:]], dtype=torch.long)


def write_kv(
    key: torch.Tensor, value: torch.Tensor, key_plane: torch.Tensor, value_plane: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new keys/values into one layer's cache planes, in place.

    Args:
        key, value: ``[T, num_kv_heads, head_dim]``.
        key_plane, value_plane: ``[num_blocks, PAGE_SIZE, num_kv_heads, head_dim]``.
        slot_mapping: ``[T]`` int64 flat slots.
    """
    kvh, hd = key.shape[-2:]
    key_plane.view(-1, kvh, hd).index_copy_(0, slot_mapping, key.to(key_plane.dtype))
    value_plane.view(-1, kvh, hd).index_copy_(0, slot_mapping, value.to(value_plane.dtype))


def paged_attention(
    query: torch.Tensor, key_plane: torch.Tensor, value_plane: torch.Tensor,
    meta: AttentionMetadata, scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached context.

    The new tokens' K/V must already be written (see :func:`write_kv`).

    Args:
        query: ``[T, num_heads, head_dim]``.
        key_plane, value_plane: ``[num_blocks, PAGE_SIZE, num_kv_heads, head_dim]``.
        meta: token placement.
        scale: softmax scale, ``head_dim ** -0.5`` for Llama.

    Returns:
        ``[T, num_heads, head_dim]`` in ``query.dtype``.
    """
    out = torch.empty_like(query)
    num_heads, num_kv_heads = query.shape[1], key_plane.shape[2]
    for i in range(meta.num_seqs):
        start, end = meta.query_start[i], meta.query_start[i + 1]
        q_len, ctx = end - start, meta.context_lens[i]
        pages = meta.block_tables[i][: (ctx + PAGE_SIZE - 1) // PAGE_SIZE]
        k = key_plane.index_select(0, pages).flatten(0, 1)[:ctx].to(query.dtype)  # [ctx, kvh, hd]
        v = value_plane.index_select(0, pages).flatten(0, 1)[:ctx].to(query.dtype)
        q = query[start:end].transpose(0, 1)  # [h, q_len, hd]
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [kvh, ctx, hd]
        if num_heads != num_kv_heads:
            rep = num_heads // num_kv_heads
            k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        if q_len == 1:
            o = F.scaled_dot_product_attention(q, k, v, scale=scale)
        elif q_len == ctx:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:  # chunk of new tokens after cached context: query j sees keys <= ctx - q_len + j
            qpos = torch.arange(ctx - q_len, ctx).unsqueeze(1)
            mask = torch.arange(ctx).unsqueeze(0) <= qpos
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out

"""Paged attention over the engine's KV cache (torch reference implementation).

KV cache geometry (docs/design.md "KV cache geometry"): one tensor ``[2, num_layers, num_blocks,
PAGE_SIZE, num_kv_heads, head_dim]``; each layer's key plane and value plane is
``[num_blocks, PAGE_SIZE, num_kv_heads, head_dim]``. A token at position ``p``
of a sequence lives in physical page ``block_table[p // PAGE_SIZE]`` at offset
``p % PAGE_SIZE``; its *slot* is ``page * PAGE_SIZE + offset``.

:func:`paged_attention` dispatches: on a GPU with ``meta.kernels`` on (the model's resolved
``prefill_kernels``) one launch of
:func:`replicas.kernels.prefill_attention.triton_prefill_attention` for the whole batch; elsewhere
:func:`paged_attention_reference`, the torch path used on CPU and as the oracle for the GPU kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from replicas.kernels.page import PAGE_SIZE


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
            at least ``ceil(context_lens[i] / PAGE_SIZE)`` pages (views of ``block_table`` rows when
            that is given).
        device: optional :class:`DeviceMetadata`, the same facts as device tensors (the model runner's
            tensor path builds it; otherwise :meth:`device_view` builds it from the lists on first use).
        kernels: whether the Triton prefill attention serves this forward on a GPU (the model's
            ``DecodeOps.prefill_kernels``, resolved at load from ``EngineConfig.prefill_kernels``; the model
            runner sets it); False keeps the torch reference path.
        logits_indices: which of the ``T`` tokens the model returns logits for,
            in order; None (the default) means each sequence's last new token.
            Prompt logprobs ask for every token of a prompt chunk.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start: list[int]
    context_lens: list[int]
    block_tables: list[torch.Tensor]
    device: DeviceMetadata | None = None
    kernels: bool = False
    cache: dict = field(default_factory=dict, repr=False, compare=False)
    """Per-forward derived tensors shared by every layer (e.g. the prefill kernel's tile map)."""
    logits_indices: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def query_lens(self) -> list[int]:
        """New tokens of each sequence (host ints)."""
        return [self.query_start[i + 1] - self.query_start[i] for i in range(self.num_seqs)]

    @property
    def last_token_indices(self) -> torch.Tensor:
        """``[R]`` int64 indices of the tokens whose logits the model returns: ``logits_indices`` if set, else
        ``[B]``, each sequence's last new token (whose logits we sample); on the device when :attr:`device`
        holds it."""
        if self.logits_indices is not None:
            return torch.tensor(self.logits_indices, dtype=torch.long)
        if self.device is not None:
            return self.device.last_token_indices
        return torch.tensor([s - 1 for s in self.query_start[1:]], dtype=torch.long)

    def device_view(self, device: torch.device) -> DeviceMetadata:
        """:attr:`device`, built from the lists (one copy each) when the runner did not provide it."""
        if self.device is None:
            width = max((int(t.numel()) for t in self.block_tables), default=1)
            table = torch.zeros(self.num_seqs, max(width, 1), dtype=torch.long, device=device)
            for i, t in enumerate(self.block_tables):
                table[i, : t.numel()] = t.to(device)
            self.device = DeviceMetadata(
                query_start=torch.tensor(self.query_start, dtype=torch.int32, device=device),
                context_lens=torch.tensor(self.context_lens, dtype=torch.int32, device=device),
                block_table=table,
                last_token_indices=torch.tensor([s - 1 for s in self.query_start[1:]], dtype=torch.long,
                                                device=device),
            )
        return self.device


@dataclass
class DeviceMetadata:
    """:class:`AttentionMetadata`'s per-sequence facts as device tensors (what the GPU kernels read).

    Attributes:
        query_start: ``[B + 1]`` int32 cumulative new-token offsets.
        context_lens: ``[B]`` int32 KV lengths after this forward.
        block_table: ``[B, max_blocks]`` int32/int64 page ids, rows padded (padding never read).
        last_token_indices: ``[B]`` int64 index of each sequence's last new token.
    """

    query_start: torch.Tensor
    context_lens: torch.Tensor
    block_table: torch.Tensor
    last_token_indices: torch.Tensor


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
    meta: AttentionMetadata, scale: float, *,
    sinks: torch.Tensor | None = None, sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached context (dispatch).

    On a GPU with ``meta.kernels`` on (set by the model runner from the model's resolved ops): one launch of the Triton prefill kernel for the
    whole batch (:mod:`replicas.kernels.prefill_attention`; its tile map is built once per forward and kept
    in ``meta.cache``); otherwise :func:`paged_attention_reference`. Same arguments and result.
    """
    if not (query.is_cuda and meta.kernels):
        return paged_attention_reference(query, key_plane, value_plane, meta, scale, sinks=sinks,
                                         sliding_window=sliding_window)
    return prefill_attention(query, key_plane, value_plane, meta, scale, sinks=sinks, sliding_window=sliding_window)


def prefill_attention(
    query: torch.Tensor, key_plane: torch.Tensor, value_plane: torch.Tensor,
    meta: AttentionMetadata, scale: float, *,
    sinks: torch.Tensor | None = None, sliding_window: int | None = None,
) -> torch.Tensor:
    """:func:`paged_attention` through the Triton prefill kernel on any device Triton runs on (a GPU, or the
    CPU under Triton's interpreter): one launch for the whole batch; the tile map is built once per forward
    and kept in ``meta.cache``. Same arguments and result as :func:`paged_attention_reference`."""
    from replicas.kernels import prefill_attention as pa

    dev = meta.device_view(query.device)
    block_t = pa.tokens_per_tile(query.shape[1], key_plane.shape[2])
    key = ("prefill_tiles", block_t)
    if key not in meta.cache:
        n = pa.num_tiles_for(meta.query_lens, block_t)
        meta.cache[key] = (n, pa.tile_map(dev.query_start, block_t, n))
    num_tiles, tiles = meta.cache[key]
    return pa.triton_prefill_attention(query, key_plane, value_plane, dev.query_start, dev.context_lens,
                                       dev.block_table, scale, num_tiles, sinks=sinks,
                                       sliding_window=sliding_window, tiles=tiles)


def paged_attention_reference(
    query: torch.Tensor, key_plane: torch.Tensor, value_plane: torch.Tensor,
    meta: AttentionMetadata, scale: float, *,
    sinks: torch.Tensor | None = None, sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached context (torch reference).

    The new tokens' K/V must already be written (see :func:`write_kv`).

    Args:
        query: ``[T, num_heads, head_dim]``.
        key_plane, value_plane: ``[num_blocks, PAGE_SIZE, num_kv_heads, head_dim]``.
        meta: token placement.
        scale: softmax scale, ``head_dim ** -0.5`` for Llama and GPT-OSS.
        sinks: optional ``[num_heads]`` learned per-head logits (GPT-OSS
            "attention sinks"): an extra logit in each softmax denominator
            whose probability mass is dropped, i.e.
            ``p_j = exp(s_j) / (exp(sink) + sum_k exp(s_k))`` (transformers'
            ``eager_attention_forward`` of ``modeling_gpt_oss.py``).
        sliding_window: optional window ``W`` in tokens: the query at
            position ``p`` sees keys at positions ``(p - W, p]`` (transformers'
            ``sliding_window_overlay``: ``kv_idx > q_idx - W``). Every token
            stays in the cache; the window only masks (and bounds the pages read).

    Returns:
        ``[T, num_heads, head_dim]`` in ``query.dtype``. With ``sinks`` or
        ``sliding_window`` the softmax is computed in fp32.
    """
    if sinks is not None or sliding_window is not None:
        return _masked_attention(query, key_plane, value_plane, meta, scale, sinks, sliding_window)
    out = torch.empty_like(query)
    num_heads, num_kv_heads = query.shape[1], key_plane.shape[2]
    for i in range(meta.num_seqs):
        start, end = meta.query_start[i], meta.query_start[i + 1]
        q_len, ctx = end - start, meta.context_lens[i]
        pages = meta.block_tables[i][: (ctx + PAGE_SIZE - 1) // PAGE_SIZE]
        k = key_plane.index_select(0, pages).flatten(0, 1)[:ctx].to(query.dtype)  # [ctx, kvh, hd]
        v = value_plane.index_select(0, pages).flatten(0, 1)[:ctx].to(query.dtype)
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, h, q_len, hd]
        k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # [1, kvh, ctx, hd]
        gqa = num_heads != num_kv_heads  # SDPA broadcasts KV heads itself (no repeat_interleave copies)
        if q_len == 1:
            o = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
        elif q_len == ctx:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:  # chunk of new tokens after cached context: query j sees keys <= ctx - q_len + j
            qpos = torch.arange(ctx - q_len, ctx, device=query.device).unsqueeze(1)
            mask = torch.arange(ctx, device=query.device).unsqueeze(0) <= qpos
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        o = o[0]
        out[start:end] = o.transpose(0, 1)
    return out


SCORE_BUDGET = 1 << 26
"""Most fp32 attention scores materialized at once by :func:`_masked_attention` (256 MiB):
queries are processed in row chunks of ``SCORE_BUDGET // (num_heads * keys)``."""


def _gather_tokens(plane: torch.Tensor, table: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Tokens ``[lo, hi)`` of a sequence from one cache plane: ``[hi - lo, num_kv_heads, head_dim]``."""
    first = lo // PAGE_SIZE
    pages = table[first: (hi + PAGE_SIZE - 1) // PAGE_SIZE]
    return plane.index_select(0, pages).flatten(0, 1)[lo - first * PAGE_SIZE: hi - first * PAGE_SIZE]


def _masked_attention(
    query: torch.Tensor, key_plane: torch.Tensor, value_plane: torch.Tensor, meta: AttentionMetadata,
    scale: float, sinks: torch.Tensor | None, window: int | None,
) -> torch.Tensor:
    """:func:`paged_attention_reference` with sinks and/or a sliding window: explicit fp32 scores, row-chunked.

    Only the pages holding keys some query of the chunk can see are gathered
    (for a window, the last ``W - 1`` tokens before the chunk and the chunk).
    GQA: query head ``h`` reads KV head ``h // (num_heads / num_kv_heads)``.
    """
    out = torch.empty_like(query)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_plane.shape[2]
    rep = num_heads // num_kv_heads
    sink_logits = None if sinks is None else sinks.float().view(num_heads, 1, 1)
    for i in range(meta.num_seqs):
        start, end = meta.query_start[i], meta.query_start[i + 1]
        q_len, ctx = end - start, meta.context_lens[i]
        table = meta.block_tables[i]
        max_keys = ctx if window is None else min(ctx, window - 1 + q_len)
        rows = max(1, SCORE_BUDGET // (num_heads * max_keys))
        for a in range(0, q_len, rows):
            b = min(q_len, a + rows)
            m = b - a
            q_first, hi = ctx - q_len + a, ctx - q_len + b  # query positions [q_first, hi)
            lo = 0 if window is None else max(0, q_first - window + 1)
            n = hi - lo
            k = _gather_tokens(key_plane, table, lo, hi).float().permute(1, 2, 0)  # [kvh, D, n]
            v = _gather_tokens(value_plane, table, lo, hi).float().transpose(0, 1)  # [kvh, n, D]
            q = query[start + a: start + b].float().transpose(0, 1)  # [H, m, D]
            scores = torch.matmul(q.reshape(num_kv_heads, rep * m, head_dim), k) * scale  # [kvh, rep*m, n]
            scores = scores.view(num_heads, m, n)
            qpos = torch.arange(q_first, hi, device=query.device).unsqueeze(1)  # [m, 1]
            kpos = torch.arange(lo, hi, device=query.device).unsqueeze(0)  # [1, n]
            visible = kpos <= qpos
            if window is not None:
                visible &= kpos > qpos - window
            scores = scores.masked_fill(~visible, float("-inf"))
            if sink_logits is not None:
                scores = torch.cat((scores, sink_logits.expand(num_heads, m, 1)), dim=-1)  # [H, m, n + 1]
            probs = torch.softmax(scores, dim=-1)[..., :n]  # the sink's share is dropped
            o = torch.matmul(probs.reshape(num_kv_heads, rep * m, n), v)  # [kvh, rep*m, D]
            out[start + a: start + b] = o.view(num_heads, m, head_dim).transpose(0, 1).to(query.dtype)
    return out

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
from replicas.kernels.triton_loader import lazy_kernel
from replicas.models.layers import apply_rope_half, rms_norm


def static_slot(block_table: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Flat cache slots ``[B]`` of ``position`` ``[B]`` through ``block_table`` ``[B, max_blocks]`` (or
    ``[max_blocks]`` for ``B = 1``), all int64 on the device."""
    table = block_table.view(position.shape[0], -1)
    return table.gather(1, (position // PAGE_SIZE).view(-1, 1)).view(-1) * PAGE_SIZE + position % PAGE_SIZE


def static_decode_attention(
    query: torch.Tensor, key_plane: torch.Tensor, value_plane: torch.Tensor,
    block_table: torch.Tensor, context_len: torch.Tensor, scale: float, *,
    sinks: torch.Tensor | None = None, sliding_window: int | None = None,
) -> torch.Tensor:
    """One query token per sequence attending over its paged context, with static shapes.

    Args:
        query: ``[B, H, D]``.
        key_plane, value_plane: ``[num_blocks, PAGE_SIZE, KVH, D]``.
        block_table: ``[B, max_blocks]`` (or ``[max_blocks]`` for ``B = 1``) int64 page ids
            (padding entries may be any valid page).
        context_len: ``[B]`` int64, keys ``0 .. context_len-1`` are visible
            (the query's own KV already written at ``context_len - 1``).
        scale: softmax scale.
        sinks: optional ``[H]`` per-head sink logits (GPT-OSS; transformers'
            ``eager_attention_forward``): an extra softmax term whose mass is dropped.
        sliding_window: optional window ``W``: only keys at positions ``> context_len - 1 - W``.

    Returns:
        ``[B, H, D]`` in ``query.dtype``; the softmax runs in fp32.
    """
    if query.shape[0] > 1:
        table = block_table.view(query.shape[0], -1)
        return torch.cat([static_decode_attention(query[i:i + 1], key_plane, value_plane, table[i],
                                                  context_len[i:i + 1], scale, sinks=sinks,
                                                  sliding_window=sliding_window) for i in range(query.shape[0])])
    block_table = block_table.view(-1)
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
    kernel = lazy_kernel("replicas.kernels.triton_decode_attention", "triton_decode_attention") if query.is_cuda \
        else None
    if kernel is not None:
        return kernel(query, key_plane, value_plane, block_table, context_len, scale, sinks=sinks,
                      sliding_window=sliding_window, workspace=workspace)
    return static_decode_attention(query, key_plane, value_plane, block_table, context_len, scale, sinks=sinks,
                                   sliding_window=sliding_window)


def rope_kv_write(attn, x, cos_table, sin_table, position, block_table, key_plane, value_plane, qkv=None):
    """Project ``x`` ``[B, hidden]`` with ``attn``'s fused qkv, rotate q/k, write k/v to the cache; return q
    ``[B, H, D]`` (``position`` ``[B]``, ``block_table`` ``[B, max_blocks]`` or ``[max_blocks]`` for ``B = 1``).

    ``attn`` has ``qkv_proj`` (callable), ``num_heads``, ``num_kv_heads``, ``head_dim``.
    ``cos_table``/``sin_table`` are ``[max_pos, D]`` (Llama, halves repeated) or ``[max_pos, D/2]``
    (GPT-OSS); both rotate the half-split pairs ``(i, i + D/2)``. One Triton launch after the GEMM on
    CUDA (:mod:`replicas.kernels.triton_rope_kv`); the torch reference elsewhere. ``qkv``: the projection
    ``[B, (H + 2 KVH) D]`` when the caller computed it (then ``attn.qkv_proj`` is not called).
    """
    qkv = attn.qkv_proj(x) if qkv is None else qkv
    kernel = lazy_kernel("replicas.kernels.triton_rope_kv", "triton_rope_kv") if x.is_cuda else None
    if kernel is not None:
        return kernel(qkv, cos_table, sin_table, position, block_table, key_plane, value_plane,
                      attn.num_heads, attn.num_kv_heads)
    from replicas.kernels.paged_attention import write_kv

    t, d, h, kvh = x.shape[0], attn.head_dim, attn.num_heads, attn.num_kv_heads
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    cos, sin = cos_table[position, : d // 2].to(x.dtype), sin_table[position, : d // 2].to(x.dtype)  # [T, D/2]
    q, k = apply_rope_half(q.view(t, h, d), cos, sin), apply_rope_half(k.view(t, kvh, d), cos, sin)
    write_kv(k, v.view(t, kvh, d), key_plane, value_plane, static_slot(block_table, position))
    return q


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; one bf16/fp16 row on a GPU goes through the batch-one Triton GEMV
    (:func:`replicas.kernels.triton_gemv.triton_gemv`), everything else (fp32, batches, CPU) through
    torch. ``x`` ``[T, K]``, ``weight`` ``[N, K]``, ``bias`` ``[N]`` → ``[T, N]``."""
    if x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16):
        kernel = lazy_kernel("replicas.kernels.triton_gemv", "triton_gemv")
        if kernel is not None:
            return kernel(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def swiglu_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Llama's MLP input: ``silu(gate) * up`` with ``gate, up = F.linear(x, weight).chunk(2, -1)`` (Shazeer
    2020); ``x`` ``[T, K]``, ``weight`` ``[2I, K]`` (gate rows over up rows) → ``[T, I]``. One bf16/fp16 row on
    a GPU: one Triton GEMV launch with the SwiGLU in its epilogue
    (:func:`replicas.kernels.triton_gemv.triton_gemv`, ``swiglu=True``; fp32 sums, rounded once); otherwise
    torch, as transformers' ``LlamaMLP``."""
    if x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16):
        kernel = lazy_kernel("replicas.kernels.triton_gemv", "triton_gemv")
        if kernel is not None:
            return kernel(x, weight, swiglu=True)
    gate, up = torch.nn.functional.linear(x, weight).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def add_rmsnorm_linear(x: torch.Tensor, delta: torch.Tensor | None, norm, weight_in_fp32: bool,
                       weight: torch.Tensor, bias: torch.Tensor | None = None, swiglu: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`add_rmsnorm` then the projection that reads the normed rows (:func:`linear`, or
    :func:`swiglu_linear` with ``swiglu``): ``(x + delta, proj(norm(x + delta)))``; ``x``, ``delta``
    ``[T, K]``, ``weight`` ``[N, K]`` (``[2N, K]`` with ``swiglu``) → ``([T, K], [T, N])``.

    One bf16/fp16 row on a GPU with ``K <= NORM_MAX_K``: one Triton launch whose programs each recompute the
    norm (:func:`replicas.kernels.triton_gemv.triton_add_rmsnorm_gemv`); otherwise the two steps.
    """
    if x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16):
        kernel = lazy_kernel("replicas.kernels.triton_gemv", "triton_add_rmsnorm_gemv")
        if kernel is not None:
            from replicas.kernels.triton_gemv import NORM_MAX_K

            if x.shape[1] <= NORM_MAX_K:
                return kernel(x, delta, norm.weight, norm.eps, weight, bias, weight_in_fp32=weight_in_fp32,
                              swiglu=swiglu)
    x, h = add_rmsnorm(x, delta, norm, weight_in_fp32)
    return x, swiglu_linear(h, weight) if swiglu else linear(h, weight, bias)


def add_rmsnorm(x: torch.Tensor, delta: torch.Tensor | None, norm, weight_in_fp32: bool, mxfp4_out: bool = False):
    """``(x + delta, norm(x + delta))`` for ``[T, hidden]`` rows; ``norm`` has ``weight`` and ``eps``.
    With ``mxfp4_out``, a third result: the normed rows in the tensor-core MoE kernels' activation format
    (:func:`~replicas.kernels.triton_moe_tc.mxfp4_activations`).

    One Triton launch on CUDA (:mod:`replicas.kernels.triton_rmsnorm`), its torch reference elsewhere.
    """
    kernel = lazy_kernel("replicas.kernels.triton_rmsnorm", "triton_add_rmsnorm") if x.is_cuda else None
    if kernel is not None:
        return kernel(x, delta, norm.weight, norm.eps, weight_in_fp32, mxfp4_out)
    x, y = add_rmsnorm_reference(x, delta, norm.weight, norm.eps, weight_in_fp32)
    if mxfp4_out:
        from replicas.kernels.triton_moe_tc import mxfp4_activations

        return x, y, mxfp4_activations(y)
    return x, y


def add_rmsnorm_reference(x, delta, weight, eps, weight_in_fp32):
    """Torch reference of :func:`replicas.kernels.triton_rmsnorm.triton_add_rmsnorm` (same arguments and result).

    RMSNorm (Zhang & Sennrich 2019) in fp32; the weight applied after rounding to ``x.dtype`` (HF Llama)
    or in fp32 (HF GPT-OSS, ``weight_in_fp32``).
    """
    if delta is not None and delta.dim() == 3:  # fp32 partial sums [T, P, N], added in order
        acc = x.float()
        for p in range(delta.shape[1]):
            acc = acc + delta[:, p]
        x = acc.to(x.dtype)
    elif delta is not None:
        x = x + delta
    return x, rms_norm(x, weight, eps, weight_in_fp32)

"""Triton kernel: RoPE on q and k fused with the KV-cache write, for one decode token.

Replaces, per layer, the split of the fused qkv projection, two RoPE kernels,
a contiguous copy of q and two scatter kernels (the KV write) with one launch.
Reference: :func:`rope_kv_reference` (the same math in torch: half-split RoPE
as in HF Llama, Su et al. 2021; slot = ``block_table[pos // 16] * 16 + pos % 16``).
Math runs in fp32 and is rounded once to the cache dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replicas.kernels.paged_attention import PAGE_SIZE


@triton.jit
def _rope_kv_kernel(
    qkv_ptr, cos_ptr, sin_ptr, pos_ptr, table_ptr, q_out_ptr, k_ptr, v_ptr,
    stride_cos, stride_kb, stride_kt, stride_kh,
    H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr,
):
    h = tl.program_id(0)
    pos = tl.load(pos_ptr)
    offs = tl.arange(0, HALF)
    x1 = tl.load(qkv_ptr + h * D + offs).to(tl.float32)
    x2 = tl.load(qkv_ptr + h * D + HALF + offs).to(tl.float32)
    if h < H + KVH:  # q and k heads are rotated
        c = tl.load(cos_ptr + pos * stride_cos + offs).to(tl.float32)
        s = tl.load(sin_ptr + pos * stride_cos + offs).to(tl.float32)
        x1, x2 = x1 * c - x2 * s, x2 * c + x1 * s
    if h < H:
        tl.store(q_out_ptr + h * D + offs, x1.to(q_out_ptr.dtype.element_ty))
        tl.store(q_out_ptr + h * D + HALF + offs, x2.to(q_out_ptr.dtype.element_ty))
    else:
        page = tl.load(table_ptr + pos // PAGE)
        base = page * stride_kb + (pos % PAGE) * stride_kt
        if h < H + KVH:
            dst = k_ptr + base + (h - H) * stride_kh
        else:
            dst = v_ptr + base + (h - H - KVH) * stride_kh
        tl.store(dst + offs, x1.to(k_ptr.dtype.element_ty))
        tl.store(dst + HALF + offs, x2.to(k_ptr.dtype.element_ty))


def triton_rope_kv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position: torch.Tensor, block_table: torch.Tensor,
    key_plane: torch.Tensor, value_plane: torch.Tensor, num_heads: int, num_kv_heads: int,
) -> torch.Tensor:
    """Rotate q/k of one token, write k and v into the cache, return rotated q.

    Args:
        qkv: ``[1, (H + 2 KVH) * D]`` output of the fused projection (contiguous).
        cos, sin: ``[max_positions, D]`` RoPE tables (halves repeated, HF Llama layout) or
            ``[max_positions, D / 2]`` (HF GPT-OSS layout); only the first ``D / 2`` columns are read.
        position: ``[1]`` int64 on the device; block_table: ``[max_blocks]`` int64.
        key_plane, value_plane: ``[num_blocks, PAGE_SIZE, KVH, D]``.

    Returns:
        ``q`` ``[1, H, D]`` in ``qkv.dtype``.
    """
    head_dim = key_plane.shape[-1]
    q = torch.empty(1, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _rope_kv_kernel[(num_heads + 2 * num_kv_heads,)](
        qkv, cos, sin, position, block_table, q, key_plane, value_plane,
        cos.stride(0), key_plane.stride(0), key_plane.stride(1), key_plane.stride(2),
        H=num_heads, KVH=num_kv_heads, D=head_dim, HALF=head_dim // 2, PAGE=PAGE_SIZE,
    )
    return q


def rope_kv_reference(qkv, cos, sin, position, block_table, key_plane, value_plane, num_heads, num_kv_heads):
    """Torch reference of :func:`triton_rope_kv` (same arguments and result)."""
    d = key_plane.shape[-1]
    q, k, v = qkv.float().split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    c, s = cos[position, : d // 2].float(), sin[position, : d // 2].float()  # [1, D/2]
    c, s = torch.cat((c, c), -1), torch.cat((s, s), -1)  # [1, D]

    def rot(x, heads):
        x = x.view(1, heads, d)
        rotated = torch.cat((-x[..., d // 2:], x[..., : d // 2]), dim=-1)
        return x * c.unsqueeze(1) + rotated * s.unsqueeze(1)

    slot = block_table[position // PAGE_SIZE] * PAGE_SIZE + position % PAGE_SIZE
    key_plane.view(-1, num_kv_heads, d).index_copy_(0, slot, rot(k, num_kv_heads).to(key_plane.dtype))
    value_plane.view(-1, num_kv_heads, d).index_copy_(0, slot, v.view(1, num_kv_heads, d).to(value_plane.dtype))
    return rot(q, num_heads).to(qkv.dtype)

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
from replicas.kernels.pdl import pdl_args, pdl_wait


@triton.jit
def _rope_kv_kernel(
    qkv_ptr, cos_ptr, sin_ptr, pos_ptr, table_ptr, q_out_ptr, k_ptr, v_ptr,
    stride_cos, stride_kb, stride_kt, stride_kh, stride_tb, stride_pos,
    H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid ``(H + 2 KVH, B)``: one head of one token per program. The position, its RoPE row and its cache
    page were written two or more launches back, so they load before the PDL wait; only the projection
    itself comes from the launch just before."""
    h = tl.program_id(0)
    seq = tl.program_id(1)
    qkv_ptr += seq * (H + 2 * KVH) * D
    q_out_ptr += seq * H * D
    table_ptr += seq * stride_tb
    pos = tl.load(pos_ptr + seq * stride_pos)  # -1 marks a padding row of a CUDA-graph batch: nothing is written
    offs = tl.arange(0, HALF)
    p = tl.maximum(pos, 0)
    c = tl.load(cos_ptr + p * stride_cos + offs).to(tl.float32)  # (v heads load them too, unused)
    s = tl.load(sin_ptr + p * stride_cos + offs).to(tl.float32)
    page = tl.load(table_ptr + p // PAGE)
    pdl_wait(PDL)  # everything below reads the qkv GEMV's output
    x1 = tl.load(qkv_ptr + h * D + offs).to(tl.float32)
    x2 = tl.load(qkv_ptr + h * D + HALF + offs).to(tl.float32)
    if h < H + KVH:  # q and k heads are rotated
        x1, x2 = x1 * c - x2 * s, x2 * c + x1 * s
    if h < H:
        tl.store(q_out_ptr + h * D + offs, x1.to(q_out_ptr.dtype.element_ty))
        tl.store(q_out_ptr + h * D + HALF + offs, x2.to(q_out_ptr.dtype.element_ty))
    elif pos >= 0:
        base = page * stride_kb + (pos % PAGE) * stride_kt
        if h < H + KVH:
            dst = k_ptr + base + (h - H) * stride_kh
        else:
            dst = v_ptr + base + (h - H - KVH) * stride_kh
        tl.store(dst + offs, x1.to(k_ptr.dtype.element_ty))
        tl.store(dst + HALF + offs, x2.to(k_ptr.dtype.element_ty))


def triton_rope_kv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position: torch.Tensor, block_table: torch.Tensor,
    key_plane: torch.Tensor, value_plane: torch.Tensor, num_heads: int, num_kv_heads: int, pdl: bool = True,
) -> torch.Tensor:
    """Rotate q/k of one token per sequence, write k and v into the cache, return rotated q.

    Args:
        qkv: ``[B, (H + 2 KVH) * D]`` output of the fused projection (contiguous).
        cos, sin: ``[max_positions, D]`` RoPE tables (halves repeated, HF Llama layout) or
            ``[max_positions, D / 2]`` (HF GPT-OSS layout); only the first ``D / 2`` columns are read.
        position: ``[B]`` int64 on the device, any stride (a column of the CUDA-graph staging buffer; -1:
            a padding row, nothing written);
            block_table: ``[B, max_blocks]`` (or ``[max_blocks]`` for ``B = 1``) int64.
        key_plane, value_plane: ``[num_blocks, PAGE_SIZE, KVH, D]``.

    Returns:
        ``q`` ``[B, H, D]`` in ``qkv.dtype``.
    """
    head_dim = key_plane.shape[-1]
    batch = qkv.shape[0]
    block_table = block_table.view(batch, -1) if block_table.dim() == 1 else block_table
    q = torch.empty(batch, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _rope_kv_kernel[(num_heads + 2 * num_kv_heads, batch)](
        qkv.contiguous(), cos, sin, position, block_table, q, key_plane, value_plane,
        cos.stride(0), key_plane.stride(0), key_plane.stride(1), key_plane.stride(2), block_table.stride(0),
        position.stride(0), H=num_heads, KVH=num_kv_heads, D=head_dim, HALF=head_dim // 2, PAGE=PAGE_SIZE,
        **pdl_args(qkv, pdl),
    )
    return q


def rope_kv_reference(qkv, cos, sin, position, block_table, key_plane, value_plane, num_heads, num_kv_heads):
    """Torch reference of :func:`triton_rope_kv` (same arguments and result; no padding rows)."""
    d = key_plane.shape[-1]
    b = qkv.shape[0]
    table = block_table.view(b, -1) if block_table.dim() == 1 else block_table
    q, k, v = qkv.float().split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    c, s = cos[position, : d // 2].float(), sin[position, : d // 2].float()  # [B, D/2]
    c, s = torch.cat((c, c), -1), torch.cat((s, s), -1)  # [B, D]

    def rot(x, heads):
        x = x.view(b, heads, d)
        rotated = torch.cat((-x[..., d // 2:], x[..., : d // 2]), dim=-1)
        return x * c.unsqueeze(1) + rotated * s.unsqueeze(1)

    slot = table.gather(1, (position // PAGE_SIZE).view(b, 1)).view(b) * PAGE_SIZE + position % PAGE_SIZE
    key_plane.view(-1, num_kv_heads, d).index_copy_(0, slot, rot(k, num_kv_heads).to(key_plane.dtype))
    value_plane.view(-1, num_kv_heads, d).index_copy_(0, slot, v.view(b, num_kv_heads, d).to(value_plane.dtype))
    return rot(q, num_heads).to(qkv.dtype)

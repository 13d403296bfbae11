"""Triton kernel: RoPE on q and k fused with the KV-cache write, for every new token of a forward.

The eager forward's counterpart of :mod:`replicas.kernels.triton_rope_kv` (which serves one decode token
per sequence through a block table): here ``T`` tokens of any mix of sequences arrive with their absolute
positions and their flat cache slots (``AttentionMetadata.positions`` / ``slot_mapping``, built once per
step), and one launch replaces the split of the fused qkv projection, the rotation of q and of k (each a
handful of torch kernels), the contiguous copy of q and the two scatters of the KV write.

Half-split RoPE (Su et al. 2021; HF Llama's and GPT-OSS's ``rotate_half``): dims ``i`` and ``i + D/2``
form a pair rotated by the position's angle; the cos/sin tables hold ``D/2`` columns (GPT-OSS, YaRN's
scale already applied) or ``D`` with the halves repeated (Llama); only the first ``D/2`` are read. The math
runs in fp32 from fp32 tables and is rounded once to the output dtypes, as the decode step's kernel does.
Reference: :func:`prefill_rope_kv_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replicas.kernels.paged_attention import PAGE_SIZE


@triton.jit
def _prefill_rope_kv_kernel(
    qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_out_ptr, k_ptr, v_ptr,
    stride_qkv, stride_cos, stride_kb, stride_kt, stride_kh,
    H: tl.constexpr, KVH: tl.constexpr, NHP: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr,
):
    """Grid ``(T,)``: every head of one token per program (``NHP`` = ``H + 2 KVH`` rounded up to a power
    of two rows of ``HALF`` pairs)."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, NHP)
    offs = tl.arange(0, HALF)
    live = heads < H + 2 * KVH
    pos = tl.load(pos_ptr + t)
    slot = tl.load(slot_ptr + t)
    c = tl.load(cos_ptr + pos * stride_cos + offs).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * stride_cos + offs).to(tl.float32)[None, :]
    src = qkv_ptr + t * stride_qkv + heads[:, None] * (2 * HALF) + offs[None, :]
    x1 = tl.load(src, mask=live[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=live[:, None], other=0.0).to(tl.float32)
    rot = (heads < H + KVH)[:, None]  # q and k heads are rotated, v heads copied
    y1 = tl.where(rot, x1 * c - x2 * s, x1)
    y2 = tl.where(rot, x2 * c + x1 * s, x2)
    is_q = (heads < H)[:, None]
    q_dst = q_out_ptr + t * (H * 2 * HALF) + heads[:, None] * (2 * HALF) + offs[None, :]
    tl.store(q_dst, y1.to(q_out_ptr.dtype.element_ty), mask=is_q)
    tl.store(q_dst + HALF, y2.to(q_out_ptr.dtype.element_ty), mask=is_q)
    base = (slot // PAGE) * stride_kb + (slot % PAGE) * stride_kt
    is_k = ((heads >= H) & (heads < H + KVH))[:, None]
    k_dst = k_ptr + base + (heads - H)[:, None] * stride_kh + offs[None, :]
    tl.store(k_dst, y1.to(k_ptr.dtype.element_ty), mask=is_k)
    tl.store(k_dst + HALF, y2.to(k_ptr.dtype.element_ty), mask=is_k)
    is_v = ((heads >= H + KVH) & live)[:, None]
    v_dst = v_ptr + base + (heads - H - KVH)[:, None] * stride_kh + offs[None, :]
    tl.store(v_dst, y1.to(v_ptr.dtype.element_ty), mask=is_v)
    tl.store(v_dst + HALF, y2.to(v_ptr.dtype.element_ty), mask=is_v)


def _check(qkv, cos, key_plane, value_plane, num_heads, num_kv_heads) -> int:
    head_dim = key_plane.shape[-1]
    if qkv.dim() != 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv must be [T, (H + 2 KVH) D] = [T, {(num_heads + 2 * num_kv_heads) * head_dim}], "
                         f"got {tuple(qkv.shape)}")
    if head_dim % 2 or cos.shape[1] < head_dim // 2:
        raise ValueError(f"head_dim {head_dim} must be even and the tables hold at least D/2 columns")
    if key_plane.shape != value_plane.shape or key_plane.shape[1] != PAGE_SIZE or key_plane.shape[2] != num_kv_heads:
        raise ValueError(f"cache planes must be [blocks, {PAGE_SIZE}, {num_kv_heads}, {head_dim}]")
    return head_dim


def triton_prefill_rope_kv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
    key_plane: torch.Tensor, value_plane: torch.Tensor, num_heads: int, num_kv_heads: int,
) -> torch.Tensor:
    """Rotate q and k of ``T`` tokens, write k and v at their cache slots, return the rotated q.

    Args:
        qkv: ``[T, (H + 2 KVH) D]`` output of the fused projection (q heads, then k, then v).
        cos, sin: ``[max_positions, >= D/2]`` fp32 RoPE tables (first ``D/2`` columns read).
        positions: ``[T]`` int absolute positions; slots: ``[T]`` int flat cache slots
            (``page * PAGE_SIZE + offset``), both on the device.
        key_plane, value_plane: ``[num_blocks, PAGE_SIZE, KVH, D]`` of one layer (head dim contiguous).

    Returns:
        ``q`` ``[T, H, D]`` in ``qkv.dtype``; k and v land in the planes in their dtype.

    Raises:
        ValueError: shapes that do not fit together, an odd ``head_dim``, or a table narrower than ``D/2``.
    """
    head_dim = _check(qkv, cos, key_plane, value_plane, num_heads, num_kv_heads)
    t = qkv.shape[0]
    q = torch.empty(t, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    if qkv.stride(1) != 1 or key_plane.stride(3) != 1 or value_plane.stride() != key_plane.stride():
        raise ValueError("qkv rows and the planes' head dim must be contiguous (planes of one layout)")
    if cos.stride() != sin.stride() or cos.stride(1) != 1:
        raise ValueError("cos and sin must be row-major tables of one layout")
    _prefill_rope_kv_kernel[(t,)](
        qkv, cos, sin, positions, slots, q, key_plane, value_plane,
        qkv.stride(0), cos.stride(0), key_plane.stride(0), key_plane.stride(1), key_plane.stride(2),
        H=num_heads, KVH=num_kv_heads, NHP=triton.next_power_of_2(num_heads + 2 * num_kv_heads),
        HALF=head_dim // 2, PAGE=PAGE_SIZE, num_warps=4,
    )
    return q


def prefill_rope_kv_reference(qkv, cos, sin, positions, slots, key_plane, value_plane, num_heads: int,
                              num_kv_heads: int) -> torch.Tensor:
    """Torch reference of :func:`triton_prefill_rope_kv` (same arguments and result): fp32 rotation, one
    rounding, :func:`~replicas.kernels.paged_attention.write_kv`."""
    from replicas.kernels.paged_attention import write_kv

    head_dim = _check(qkv, cos, key_plane, value_plane, num_heads, num_kv_heads)
    t, half = qkv.shape[0], head_dim // 2
    q, k, v = qkv.float().split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    c = cos[positions, :half].float().unsqueeze(1)  # [T, 1, D/2]
    s = sin[positions, :half].float().unsqueeze(1)

    def rot(x, heads):
        x1, x2 = x.view(t, heads, head_dim).split(half, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    write_kv(rot(k, num_kv_heads), v.view(t, num_kv_heads, head_dim), key_plane, value_plane, slots.long())
    return rot(q, num_heads).to(qkv.dtype)

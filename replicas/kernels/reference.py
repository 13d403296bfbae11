"""Torch references of the elementwise math the kernels implement, shared by the models and the kernels.

The models (``replicas/models/``) build their layers from these functions, and every kernel's CPU path
and test oracle uses the same ones, so a kernel and its reference cannot drift apart. Torch only.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) of ``x`` ``[..., N]`` over its last dim, computed in fp32.

    ``weight`` ``[N]`` multiplies after rounding to ``x.dtype`` (HF Llama: ``weight * x.to(dtype)``)
    or in fp32 (HF GPT-OSS: ``(weight * x).to(dtype)``) when ``weight_in_fp32``. Returns ``x.dtype``.
    """
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed).to(x.dtype) if weight_in_fp32 else weight * normed.to(x.dtype)


def apply_rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, D]`` by ``cos``/``sin`` ``[T, D/2]``, half-split pairs ``(i, i + D/2)``
    (RoFormer, Su et al. 2021; transformers' GPT-OSS ``_apply_rotary_emb``). Returns ``x.dtype``."""
    first, second = x.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).to(x.dtype)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's SwiGLU on interleaved ``[..., 2I]`` → ``[..., I]`` (transformers' ``GptOssExperts._apply_gate``).

    ``gate = min(x[..., ::2], limit)``, ``up = clamp(x[..., 1::2], -limit, limit)``,
    ``out = (up + 1) * gate * sigmoid(alpha * gate)``; GPT-OSS uses alpha 1.702, limit 7.0 (its config).
    """
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def router_topk_reference(logits: torch.Tensor, k: int, weight_dtype: torch.dtype):
    """``topk`` of ``logits`` ``[T, E]`` then ``softmax`` of the kept logits (fp32) → ``(weights [T, k]
    weight_dtype, ids [T, k] int64)``: transformers' ``GptOssTopKRouter``; reference of the Triton kernel."""
    top, ids = torch.topk(logits.float(), k, dim=-1)
    return torch.softmax(top, dim=-1).to(weight_dtype), ids

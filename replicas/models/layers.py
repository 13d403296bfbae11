"""Building blocks both model families share: RMSNorm and half-split rotary embedding.

Kept free of the kernels package so the decode-step dispatch
(:mod:`replicas.kernels.static_decode`) can use the same math as its reference.
"""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) of ``x`` ``[..., N]`` over its last dim, computed in fp32.

    ``weight`` ``[N]`` multiplies after rounding to ``x.dtype`` (HF Llama: ``weight * x.to(dtype)``)
    or in fp32 (HF GPT-OSS: ``(weight * x).to(dtype)``) when ``weight_in_fp32``. Returns ``x.dtype``.
    """
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed).to(x.dtype) if weight_in_fp32 else weight * normed.to(x.dtype)


class RMSNorm(nn.Module):
    """:func:`rms_norm` with a learned ``weight`` ``[dim]`` (checkpoint name ``*.weight``).

    Args:
        weight_in_fp32: GPT-OSS's convention (``GptOssRMSNorm``) instead of Llama's (``LlamaRMSNorm``).
    """

    def __init__(self, dim: int, eps: float, weight_in_fp32: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.weight_in_fp32 = weight_in_fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.weight_in_fp32)


def apply_rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, D]`` by ``cos``/``sin`` ``[T, D/2]``, half-split pairs ``(i, i + D/2)``
    (RoFormer, Su et al. 2021; transformers' GPT-OSS ``_apply_rotary_emb``). Returns ``x.dtype``."""
    first, second = x.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).to(x.dtype)

"""Building blocks both model families share: the RMSNorm module.

Its math, and the half-split rotary embedding's, is :mod:`replicas.kernels.reference` (the kernels'
own references), so a model and its decode kernels compute the same function.
"""

from __future__ import annotations

import torch
from torch import nn

from replicas.kernels.reference import rms_norm


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

"""Torch reference of the MXFP4 MoE expert sum: every routed expert dequantized once, dense GEMMs.

It runs on the CPU, it is the oracle of every MoE kernel's test, and on a GPU it is the prefill path
(more tokens than a decode backend takes), with the one-launch Triton dequantization
(:mod:`replicas.kernels.moe.prefill_dequantize`) passed in as ``dequantize``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from replicas.kernels.moe.decode_layout import unpacked
from replicas.kernels.moe.mxfp4 import dequantize_mxfp4
from replicas.kernels.reference import clamped_swiglu


def moe_reference(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts,
                  dequantize=None, dequantize_repacked=None) -> torch.Tensor:
    """``sum_k weights[:, k] * expert_{ids[:, k]}(x)`` ``[T, hidden]`` in ``x.dtype``.

    ``x`` ``[T, hidden]``; ``weights`` ``[T, K]`` routing weights; ``ids`` ``[T, K]`` int64 expert ids;
    ``experts`` has GPT-OSS's ``Experts`` buffers (packed ``*_blocks``/``*_scales``, biases, ``alpha``,
    ``limit``, and ``decode_layout`` when its blocks were repacked at load).

    Experts are visited in increasing id and accumulated in ``x.dtype``, as transformers'
    ``GptOssExperts.forward``. Syncs with the host (``torch.unique``): not capturable. Repacked experts
    go through ``dequantize_repacked`` (same signature, reading the decode layout) or, without one, are
    unpacked to the checkpoint layout one expert at a time. ``dequantize(blocks, scales, dtype)`` defaults
    to :func:`~replicas.kernels.moe.mxfp4.dequantize_mxfp4`.
    """
    dequantize = dequantize or dequantize_mxfp4
    if getattr(experts, "decode_layout", False):
        plain = dequantize
        dequantize = dequantize_repacked or (lambda blocks, scales, dtype: plain(unpacked(blocks), scales, dtype))
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.where(ids == e)  # tokens routed to e, and at which of their K slots
        w_gate_up = dequantize(experts.gate_up_proj_blocks[e], experts.gate_up_proj_scales[e], x.dtype)
        w_down = dequantize(experts.down_proj_blocks[e], experts.down_proj_scales[e], x.dtype)
        y = F.linear(x[tok], w_gate_up, experts.gate_up_proj_bias[e])  # [n, 2I]
        y = F.linear(clamped_swiglu(y, experts.alpha, experts.limit), w_down, experts.down_proj_bias[e])
        out.index_add_(0, tok, y * weights[tok, slot, None])
    return out

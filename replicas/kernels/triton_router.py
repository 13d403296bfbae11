"""Triton kernel: top-k expert selection and softmax over the selected router logits.

GPT-OSS routing (transformers' ``GptOssTopKRouter``): take the ``K`` largest of
the ``E`` router logits of each token and softmax them among themselves. One
program per token replaces ``topk`` + ``softmax`` (and their index/dtype
glue) with one launch; the logits themselves come from the router's GEMV.

Ties pick the lowest expert id first (``torch.topk`` leaves tie order
unspecified, so tests use logits without ties). Reference:
:func:`replicas.kernels.moe.router_topk_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replicas.kernels.pdl import pdl_args, pdl_wait


@triton.jit
def _router_topk_kernel(logits_ptr, w_ptr, ids_ptr, E, K: tl.constexpr, EP: tl.constexpr, KP: tl.constexpr,
                        PDL: tl.constexpr):
    token = tl.program_id(0)
    pdl_wait(PDL)
    offs = tl.arange(0, EP)
    vals = tl.load(logits_ptr + token * E + offs, mask=offs < E, other=float("-inf")).to(tl.float32)
    offs_k = tl.arange(0, KP)
    top = tl.full([KP], float("-inf"), tl.float32)
    idx = tl.zeros([KP], tl.int32)
    for k in tl.static_range(K):
        best = tl.max(vals, 0)
        pick = tl.min(tl.where(vals == best, offs, EP), 0)  # lowest id among the maxima
        top = tl.where(offs_k == k, best, top)
        idx = tl.where(offs_k == k, pick, idx)
        vals = tl.where(offs == pick, float("-inf"), vals)
    m = tl.max(top, 0)
    p = tl.exp(top - m)
    p = p / tl.sum(p, 0)
    k_mask = offs_k < K
    tl.store(w_ptr + token * K + offs_k, p.to(w_ptr.dtype.element_ty), mask=k_mask)
    tl.store(ids_ptr + token * K + offs_k, idx.to(tl.int64), mask=k_mask)


def triton_router_topk(logits: torch.Tensor, k: int, weight_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` softmax routing.

    Args:
        logits: ``[T, E]`` router logits (any float dtype; compared and softmaxed in fp32).
        k: experts per token (GPT-OSS: 4).
        weight_dtype: dtype of the returned weights (the model's compute dtype).

    Returns:
        ``(weights [T, k] weight_dtype, ids [T, k] int64)``, ids in decreasing logit order.
    """
    t, e = logits.shape
    logits = logits.contiguous()
    w = torch.empty(t, k, dtype=weight_dtype, device=logits.device)
    ids = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    _router_topk_kernel[(t,)](logits, w, ids, e, K=k, EP=triton.next_power_of_2(e),
                              KP=triton.next_power_of_2(k), **pdl_args(logits))
    return w, ids

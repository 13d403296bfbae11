"""Triton kernels: top-k expert selection and softmax over the selected router logits.

GPT-OSS routing (transformers' ``GptOssTopKRouter``): take the ``K`` largest of
the ``E`` router logits of each token and softmax them among themselves. One
program per token replaces ``topk`` + ``softmax`` (and their index/dtype
glue) with one launch; the logits themselves come from the router's GEMV.

At batch one the decode step instead runs :func:`triton_add_rmsnorm_route`:
the residual add and RMSNorm after attention, the router GEMV and the top-k in
one launch instead of three. Every program recomputes the norm (2,880 values
from L2) and takes four experts' logits; the last program to finish (a global
arrival counter: :mod:`replicas.kernels.grid_sync`) picks the top k.

Ties pick the lowest expert id first (``torch.topk`` leaves tie order
unspecified, so tests use logits without ties). Reference:
:func:`replicas.kernels.reference.router_topk_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replicas.kernels.grid_sync import arrive, gpu_fence
from replicas.kernels.moe.mma_format import X_SCALE, mma_position
from replicas.kernels.pdl import pdl_args, pdl_wait
from replicas.kernels.triton_rmsnorm import rmsnorm_row


@triton.jit
def _topk_softmax(vals, offs, w_ptr, ids_ptr, K: tl.constexpr, EP: tl.constexpr, KP: tl.constexpr):
    """Store the softmax of the ``K`` largest of ``vals`` ``[EP]`` fp32 (ids ``offs``; padding ``-inf``) at
    ``w_ptr`` and their ids (int64; decreasing logit, ties to the lowest id) at ``ids_ptr``: ``K`` rounds of
    arg-max (``docs/decisions/0019-fused-router-launch-and-fusions-that-lost.md`` compares this with ranking all values at once)."""
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
    tl.store(w_ptr + offs_k, p.to(w_ptr.dtype.element_ty), mask=k_mask)
    tl.store(ids_ptr + offs_k, idx.to(tl.int64), mask=k_mask)


@triton.jit
def _router_topk_kernel(logits_ptr, w_ptr, ids_ptr, E, K: tl.constexpr, EP: tl.constexpr, KP: tl.constexpr,
                        PDL: tl.constexpr):
    token = tl.program_id(0)
    pdl_wait(PDL)
    offs = tl.arange(0, EP)
    vals = tl.load(logits_ptr + token * E + offs, mask=offs < E, other=float("-inf")).to(tl.float32)
    _topk_softmax(vals, offs, w_ptr + token * K, ids_ptr + token * K, K, EP, KP)


def triton_router_topk(logits: torch.Tensor, k: int, weight_dtype: torch.dtype, pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
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
                              KP=triton.next_power_of_2(k), **pdl_args(logits, pdl))
    return w, ids


@triton.jit
def _add_rmsnorm_route_kernel(res_ptr, delta_ptr, nw_ptr, rw_ptr, rb_ptr, x_out_ptr, h_ptr, hmx_ptr, logits_ptr,
                              counter_ptr, w_ptr, ids_ptr, E, eps, HIDDEN: tl.constexpr, BH: tl.constexpr,
                              BN: tl.constexpr, K: tl.constexpr, EP: tl.constexpr, KP: tl.constexpr,
                              MXFP4_OUT: tl.constexpr, FENCE: tl.constexpr, PDL: tl.constexpr):
    """Grid ``(cdiv(E, BN),)``. Every program: ``x = res + delta`` and ``h = rmsnorm(x)`` (GPT-OSS's fp32
    weight), the logits of experts ``[pid * BN, pid * BN + BN)`` (fp32 sums plus bias, rounded to the logits'
    dtype like the GEMV's). Program 0 also stores ``x``, ``h`` and, with ``MXFP4_OUT``, ``h`` in the MoE
    kernels' format; the last program to arrive stores the top-k softmax and resets the counter."""
    pid = tl.program_id(0)
    n = pid * BN + tl.arange(0, BN)
    n_ok = n < E
    k = tl.arange(0, BH)
    k_ok = k < HIDDEN
    # weights: before the wait
    w = tl.load(rw_ptr + n[:, None] * HIDDEN + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    nw = tl.load(nw_ptr + k, mask=k_ok, other=0.0)
    bias = tl.load(rb_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    pdl_wait(PDL)  # the residual stream and o_proj's output come from the launches before
    x = tl.load(res_ptr + k, mask=k_ok, other=0.0) + tl.load(delta_ptr + k, mask=k_ok, other=0.0)  # torch's add
    h = rmsnorm_row(x, nw, HIDDEN, eps, True).to(h_ptr.dtype.element_ty)
    if pid == 0:
        tl.store(x_out_ptr + k, x, mask=k_ok)
        tl.store(h_ptr + k, h, mask=k_ok)
        if MXFP4_OUT:
            tl.store(hmx_ptr + mma_position(k), (h.to(tl.float32) * X_SCALE).to(tl.bfloat16), mask=k_ok)
    logit = tl.sum(w.to(tl.float32) * h.to(tl.float32)[None, :], 1) + bias
    tl.store(logits_ptr + n, logit.to(logits_ptr.dtype.element_ty), mask=n_ok)
    if arrive(counter_ptr, FENCE):  # the last program: every logit is in
        gpu_fence(FENCE)
        offs = tl.arange(0, EP)
        vals = tl.load(logits_ptr + offs, mask=offs < E, other=float("-inf"), cache_modifier=".cg")
        _topk_softmax(vals.to(tl.float32), offs, w_ptr, ids_ptr, K, EP, KP)
        tl.store(counter_ptr, 0)  # ready for the next launch (CUDA-graph replays)


def triton_add_rmsnorm_route(residual: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                             router_weight: torch.Tensor, router_bias: torch.Tensor, k: int,
                             mxfp4_out: bool = False, workspace: dict | None = None, block_n: int = 4,
                             num_warps: int = 8, pdl: bool = True) -> tuple[torch.Tensor, ...]:
    """GPT-OSS's post-attention residual add + RMSNorm (weight applied in fp32), router GEMV and top-k
    softmax for one token, in one launch.

    The same results as :func:`~replicas.kernels.triton_rmsnorm.triton_add_rmsnorm` (``weight_in_fp32``),
    then the router GEMV (logits rounded to ``residual.dtype``) and :func:`triton_router_topk`; the logits'
    fp32 sums may differ from the separate GEMV's in the last bits (another summation order).

    Args:
        residual, delta: ``[1, hidden]`` bf16/fp16 (the residual stream and o_proj's output).
        norm_weight: ``[hidden]``; eps: the norm's epsilon.
        router_weight: ``[E, hidden]`` contiguous; router_bias: ``[E]``; k: experts per token.
        mxfp4_out: also return ``h`` in the tensor-core MoE kernels' activation format
            (:func:`~replicas.kernels.moe.mma_format.mxfp4_activations`).
        workspace: dict reused across calls for the logits and the arrival counter (keeps a captured graph's
            buffers fixed; the counter is back at 0 after every launch). One decode stream per workspace.
        block_n, num_warps: experts per program (``cdiv(E, block_n)`` programs) and warps per program.

    Returns:
        ``(x [1, hidden], h [1, hidden], h_mxfp4 [1, hidden] bf16 or None, weights [1, k] residual.dtype,
        ids [1, k] int64)``.

    Raises:
        ValueError: not one row, mismatched shapes, or a non-contiguous router weight.
    """
    e, hidden = router_weight.shape
    if residual.shape != (1, hidden) or delta.shape != residual.shape or router_bias.shape != (e,) \
            or not router_weight.is_contiguous():
        raise ValueError(f"triton_add_rmsnorm_route: expected residual/delta [1, {hidden}], bias [{e}] and a "
                         f"contiguous weight, got {tuple(residual.shape)}, {tuple(delta.shape)}, "
                         f"{tuple(router_bias.shape)}")
    ws = workspace if workspace is not None else {}
    key = (e, residual.dtype, residual.device)
    if ws.get("route_key") != key:
        ws.update(route_key=key, route_logits=torch.empty(e, dtype=residual.dtype, device=residual.device),
                  route_counter=torch.zeros(1, dtype=torch.int32, device=residual.device))
    residual, delta = residual.contiguous(), delta.contiguous()
    x = torch.empty_like(residual)
    h = torch.empty_like(residual)
    h_mx = torch.empty(1, hidden, dtype=torch.bfloat16, device=residual.device) if mxfp4_out else None
    w = torch.empty(1, k, dtype=residual.dtype, device=residual.device)
    ids = torch.empty(1, k, dtype=torch.int64, device=residual.device)
    _add_rmsnorm_route_kernel[(triton.cdiv(e, block_n),)](
        residual, delta, norm_weight, router_weight, router_bias, x, h, h_mx if mxfp4_out else h,
        ws["route_logits"], ws["route_counter"], w, ids, e, eps, HIDDEN=hidden, BH=triton.next_power_of_2(hidden),
        BN=block_n, K=k, EP=triton.next_power_of_2(e), KP=triton.next_power_of_2(k), MXFP4_OUT=mxfp4_out,
        FENCE=residual.is_cuda and not torch.version.hip, num_warps=num_warps, **pdl_args(residual, pdl),
    )
    return x, h, h_mx, w, ids

"""Mixture-of-experts dispatch for GPT-OSS: routing and the MXFP4 expert sum.

On CUDA with Triton, a few tokens (decode: the persistent lane's one token or
a small standard-lane batch, up to :data:`GROUPED_MAX_TOKENS`) go through the
packed-MXFP4 GEMV kernels selected by :data:`MOE_KERNEL` (by default the
tensor-core kernels of :mod:`replicas.kernels.cuda_moe_bulk`; fp32 models take
the exact SIMT kernels of :mod:`replicas.kernels.triton_moe_gemv`) and the top-k
kernel of :mod:`replicas.kernels.triton_router`; everything else (CPU, prefill)
uses :func:`moe_reference`, which dequantizes each routed expert once and runs
dense GEMMs (the same math as transformers' ``GptOssExperts``).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from replicas.kernels.triton_loader import lazy_kernel

GROUPED_MAX_TOKENS = 16
"""Above this many tokens, dequantize-then-GEMM beats re-reading packed experts per (token, expert) pair."""

MOE_KERNEL = os.environ.get("PERSISTENT_SERVE_MOE_KERNEL", "bulk")
"""Decode MoE kernels on CUDA: ``bulk`` — inline-PTX E2M1 decoding to bf16 pairs and ``mma.sync`` on the
tensor cores, fp32 sums, activations rounded to bf16, the weights bulk-copied into shared memory
(:mod:`replicas.kernels.cuda_moe_bulk`, CUDA C++ compiled with NVRTC, Hopper and newer, bf16 models; the
fastest on an H200; elsewhere ``tc`` runs in its place); ``tc`` — the same math in Triton, weights loaded
into registers (:mod:`replicas.kernels.triton_moe_tc`, NVIDIA only); fp32 models use ``gemv`` instead,
which stays exact; ``gemv`` — inline-PTX E2M1 decoding straight to fp32, exact fp32 sums on the SIMT
cores (:mod:`replicas.kernels.triton_moe_gemv`); ``mma`` — inline-PTX decoding to fp16 + ``tl.dot`` (:mod:`replicas.kernels.triton_moe_mma`);
``scaled`` — ``tl.dot_scaled`` (:mod:`replicas.kernels.triton_moe_scaled`); ``simt`` — the portable
scalar kernels of :mod:`replicas.kernels.triton_moe` (also used on ROCm). Environment
``PERSISTENT_SERVE_MOE_KERNEL`` selects one; ``python -m ops.bench.kernels`` compares them."""

_PARTIALS = {"tc": ("replicas.kernels.triton_moe_tc", "triton_moe_tc"),
             "bulk": ("replicas.kernels.cuda_moe_bulk", "cuda_moe_bulk"),
             "gemv": ("replicas.kernels.triton_moe_gemv", "triton_moe_gemv"),
             "scaled": ("replicas.kernels.triton_moe_scaled", "triton_moe_scaled"),
             "mma": ("replicas.kernels.triton_moe_mma", "triton_moe_partials")}


MXFP4_FORMAT_KERNELS = ("tc", "bulk")
"""The kernels that read their activations in :func:`~replicas.kernels.triton_moe_tc.mxfp4_activations`'s
format."""


REPACK = os.environ.get("PERSISTENT_SERVE_MOE_REPACK", "1") == "1"
"""Whether :func:`prepare_decode_layout` repacks experts for the ``bulk`` kernels (on by default;
``PERSISTENT_SERVE_MOE_REPACK=0`` keeps the checkpoint layout). gpt-oss-120b on an H200: 2.242 against 2.324
ms/token in one call, TTFT 2.15 against 2.42 s (``docs/benchmarks.md``, GPT-OSS items 14 and 15)."""


def repacked(experts) -> bool:
    """Whether ``experts``' packed blocks are in :mod:`~replicas.kernels.mxfp4_decode_layout`'s layout."""
    return getattr(experts, "decode_layout", False)


def prepare_decode_layout(experts) -> bool:
    """Repack ``experts``' blocks in place for the ``bulk`` decode kernels when those will run them (CUDA,
    bf16 biases, :data:`MOE_KERNEL` ``bulk`` and runnable here, :data:`REPACK`), and tag the module; returns
    whether it did. Call once after loading, never inside a CUDA-graph capture. From then on every MoE path
    honours the layout: the decode kernels and the prefill's Triton dequantization read it, the torch
    reference unpacks a copy per expert.

    Raises:
        RuntimeError: called during a CUDA-graph capture."""
    from replicas.kernels.mxfp4_decode_layout import repack_

    blocks = experts.gate_up_proj_blocks
    if repacked(experts) or not (REPACK and MOE_KERNEL == "bulk" and blocks.is_cuda and not torch.version.hip
                                 and experts.gate_up_proj_bias.dtype == torch.bfloat16 and _bulk_runs(blocks.device)):
        return False
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("prepare_decode_layout inside a CUDA-graph capture")
    with torch.no_grad():
        repack_(experts.gate_up_proj_blocks)
        repack_(experts.down_proj_blocks)
    experts.decode_layout = True
    return True


def restore_checkpoint_layout(experts) -> None:
    """Undo :func:`prepare_decode_layout` in place (to run another MoE kernel on the same weights, e.g. in a
    benchmark); a no-op for experts in the checkpoint layout. Never inside a CUDA-graph capture, and graphs
    captured before read the new layout from then on."""
    from replicas.kernels.mxfp4_decode_layout import unpack_

    if not repacked(experts):
        return
    if experts.gate_up_proj_blocks.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("restore_checkpoint_layout inside a CUDA-graph capture")
    with torch.no_grad():
        unpack_(experts.gate_up_proj_blocks)
        unpack_(experts.down_proj_blocks)
    experts.decode_layout = False


def _partials_name(x: torch.Tensor, experts=None) -> str | None:
    """Which per-expert-partials MoE kernel applies to ``x``: :data:`MOE_KERNEL` on CUDA on NVIDIA for a
    few tokens, except that fp32 activations take the exact ``gemv`` kernels in place of the tensor-core
    ones (which round activations to bf16/fp16), and ``bulk`` gives way to ``tc`` where it cannot run;
    None elsewhere. Repacked ``experts`` (:func:`prepare_decode_layout`) take ``bulk`` only.

    Raises:
        ValueError: repacked experts while :data:`MOE_KERNEL` names another kernel."""
    if experts is not None and repacked(experts):
        if MOE_KERNEL != "bulk":
            raise ValueError(f"these experts were repacked for the bulk MoE kernels when loaded; set "
                             f"PERSISTENT_SERVE_MOE_KERNEL={MOE_KERNEL} (or PERSISTENT_SERVE_MOE_REPACK=0) before "
                             "loading to run another kernel")
        return "bulk" if x.is_cuda and x.shape[0] <= GROUPED_MAX_TOKENS else None
    if MOE_KERNEL not in _PARTIALS or not x.is_cuda or torch.version.hip or x.shape[0] > GROUPED_MAX_TOKENS:
        return None
    if x.dtype == torch.float32 and MOE_KERNEL != "gemv":
        return "gemv"
    if MOE_KERNEL == "bulk" and (x.dtype != torch.bfloat16 or not _bulk_runs(x.device)):
        return "tc"  # fp16 models (bf16 biases only), GPUs before Hopper, no NVRTC
    return MOE_KERNEL


def _bulk_runs(device: torch.device) -> bool:
    runs = lazy_kernel("replicas.kernels.cuda_moe_bulk", "available")
    return runs is not None and runs(device.index if device.index is not None else torch.cuda.current_device())


def _partials_kernel(x: torch.Tensor, experts=None):
    """The kernel of :func:`_partials_name` (None when none applies or Triton is missing); for repacked
    experts, bound to their layout."""
    name = _partials_name(x, experts)
    kernel = lazy_kernel(*_PARTIALS[name]) if name else None
    if kernel is not None and experts is not None and repacked(experts):
        return functools.partial(kernel, repacked=True)
    return kernel


def moe_takes_mxfp4(x: torch.Tensor, experts=None) -> bool:
    """Whether the decode MoE kernel for ``x`` reads its activations in the tensor-core format
    (:func:`~replicas.kernels.triton_moe_tc.mxfp4_activations`): the add+RMSNorm launch before it then writes
    them too (``add_rmsnorm(..., mxfp4_out=True)``), saving a conversion per layer."""
    return _partials_name(x, experts) in MXFP4_FORMAT_KERNELS and _partials_kernel(x, experts) is not None


def _packed(experts) -> tuple:
    return (experts.gate_up_proj_blocks, experts.gate_up_proj_scales, experts.gate_up_proj_bias,
            experts.down_proj_blocks, experts.down_proj_scales, experts.down_proj_bias, experts.alpha, experts.limit)


def moe_add_rmsnorm(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts, residual: torch.Tensor,
                    norm, weight_in_fp32: bool, x_mxfp4: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE layer, its residual add and the next RMSNorm: ``(x_new, norm(x_new))`` with
    ``x_new = residual + moe(x)`` ``[T, hidden]``. ``x_mxfp4``: ``x`` in the tensor-core kernels' format
    when :func:`moe_takes_mxfp4` (written by the add+RMSNorm that produced ``x``).

    On NVIDIA GPUs two launches write per-expert partials and one add+RMSNorm launch sums them (fixed
    order, no atomics); elsewhere :func:`moe` then
    :func:`~replicas.kernels.static_decode.add_rmsnorm`.
    """
    from replicas.kernels.static_decode import add_rmsnorm

    kernel = _partials_kernel(x, experts)
    if kernel is not None:
        extra = {"x_mxfp4": x_mxfp4} if x_mxfp4 is not None else {}
        return add_rmsnorm(residual, kernel(x, weights, ids, *_packed(experts), **extra), norm, weight_in_fp32)
    return add_rmsnorm(moe(x, weights, ids, experts, residual=residual), None, norm, weight_in_fp32)


def route(router, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights ``[T, K]`` (``x.dtype``) and expert ids ``[T, K]`` int64 for ``x`` ``[T, hidden]``.

    ``router`` has ``weight [E, hidden]``, ``bias [E]``, ``top_k`` (GPT-OSS's ``Router``).
    """
    from replicas.kernels.static_decode import linear

    logits = linear(x, router.weight, router.bias)  # [T, E]
    kernel = lazy_kernel("replicas.kernels.triton_router", "triton_router_topk") if x.is_cuda else None
    if kernel is not None:
        return kernel(logits, router.top_k, x.dtype)
    return router_topk_reference(logits, router.top_k, x.dtype)


def add_rmsnorm_route(x: torch.Tensor, delta: torch.Tensor, norm, router, mxfp4_out: bool = False,
                      workspace: dict | None = None) -> tuple[torch.Tensor, ...]:
    """GPT-OSS's residual add + RMSNorm (weight in fp32) after attention, then :func:`route` on the normed
    rows: ``(x + delta, h, h_mxfp4 or None, weights [T, K], ids [T, K])`` for ``x``, ``delta`` ``[T, hidden]``;
    ``h_mxfp4`` (with ``mxfp4_out``) is ``h`` in the tensor-core MoE kernels' format.

    One bf16/fp16 row on an NVIDIA GPU: one Triton launch
    (:func:`~replicas.kernels.triton_router.triton_add_rmsnorm_route`, scratch kept in ``workspace``);
    otherwise :func:`~replicas.kernels.static_decode.add_rmsnorm` then :func:`route`.
    """
    from replicas.kernels.static_decode import add_rmsnorm

    if x.is_cuda and not torch.version.hip and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16) \
            and router.bias is not None and router.weight.is_contiguous():
        kernel = lazy_kernel("replicas.kernels.triton_router", "triton_add_rmsnorm_route")
        if kernel is not None:
            return kernel(x, delta, norm.weight, norm.eps, router.weight, router.bias, router.top_k,
                          mxfp4_out=mxfp4_out, workspace=workspace)
    x, h, *h_mx = add_rmsnorm(x, delta, norm, True, mxfp4_out=mxfp4_out)
    return x, h, h_mx[0] if h_mx else None, *route(router, h)


def router_topk_reference(logits: torch.Tensor, k: int, weight_dtype: torch.dtype):
    """``topk`` of ``logits`` ``[T, E]`` then ``softmax`` of the kept logits (fp32) → ``(weights [T, k]
    weight_dtype, ids [T, k] int64)``: transformers' ``GptOssTopKRouter``; reference of the Triton kernel."""
    top, ids = torch.topk(logits.float(), k, dim=-1)
    return torch.softmax(top, dim=-1).to(weight_dtype), ids


def moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts, residual: torch.Tensor | None = None):
    """``residual + sum_k weights[:, k] * expert_{ids[:, k]}(x)`` ``[T, hidden]`` in ``x.dtype``.

    ``experts`` is GPT-OSS's ``Experts`` module (packed ``*_blocks``/``*_scales``, biases, ``alpha``,
    ``limit``). Triton kernels on CUDA for ``T <= GROUPED_MAX_TOKENS``, else :func:`moe_reference`.
    """
    mma = _partials_kernel(x, experts)
    if mma is not None:
        out = mma(x, weights, ids, *_packed(experts)).sum(1)
        return (out if residual is None else residual.float() + out).to(x.dtype)
    kernel = lazy_kernel("replicas.kernels.triton_moe", "triton_moe") if x.is_cuda and not repacked(experts) else None
    if kernel is not None and x.shape[0] <= GROUPED_MAX_TOKENS:
        return kernel(x, weights, ids, *_packed(experts), residual=residual)
    # prefill: dequantize-then-GEMM, each expert dequantized in one Triton launch on a GPU (exact)
    fast = lazy_kernel("replicas.kernels.triton_mxfp4", "triton_dequantize_mxfp4") if x.is_cuda else None
    out = moe_reference(x, weights, ids, experts, dequantize=fast,
                        dequantize_repacked=functools.partial(fast, repacked=True) if fast else None)
    return out if residual is None else residual + out


def moe_reference(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts,
                  dequantize=None, dequantize_repacked=None) -> torch.Tensor:
    """Torch reference: each routed expert dequantized once (to ``x.dtype``) and applied to its tokens.

    Experts are visited in increasing id and accumulated in ``x.dtype``, as transformers'
    ``GptOssExperts.forward``. Syncs with the host (``torch.unique``): not capturable. Repacked experts
    (:func:`prepare_decode_layout`) go through ``dequantize_repacked`` (same signature, reading the decode
    layout) or, without one, are unpacked to the checkpoint layout one expert at a time.
    ``dequantize(blocks, scales, dtype)`` defaults to :func:`~replicas.models.mxfp4.dequantize_mxfp4`;
    :func:`moe` passes the one-launch Triton equivalent on a GPU
    (:func:`~replicas.kernels.triton_mxfp4.triton_dequantize_mxfp4`, exact as well).
    """
    from replicas.kernels.mxfp4_decode_layout import unpacked
    from replicas.models.gpt_oss import clamped_swiglu
    from replicas.models.mxfp4 import dequantize_mxfp4

    dequantize = dequantize or dequantize_mxfp4
    if repacked(experts):
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

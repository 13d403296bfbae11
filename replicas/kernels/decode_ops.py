"""The decode step's operations, each dispatched to its kernel or its torch reference once, at load.

:class:`DecodeOps` is what a model's ``decode_static`` (and its eager forward, for the MoE) calls:
projections, add + RMSNorm, RoPE + KV write, paged decode attention, the GPT-OSS router and MoE. Built
once per model from the engine config and the device (:meth:`DecodeOps.build`), it records which kernels
run (:meth:`DecodeOps.describe`, shown in ``/debug/stats``): Triton kernels on a GPU (with
programmatic dependent launch on Hopper when ``pdl`` holds), the torch references below elsewhere.
Only the shape decides per call (one row or a batch), never a global.

Static shapes throughout (CUDA-graph capturable): block tables are padded to ``max_blocks`` pages and
positions at or beyond the context length are masked, so one captured graph serves every context length
up to ``max_blocks * PAGE_SIZE``. The torch references read every page of the padded table each step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replicas.kernels.moe import MoE, MoEChoice, resolve_moe
from replicas.kernels.paged_attention import PAGE_SIZE
from replicas.kernels.reference import apply_rope_half, rms_norm, router_topk_reference


def static_slot(block_table: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Flat cache slots ``[B]`` of ``position`` ``[B]`` through ``block_table`` ``[B, max_blocks]`` (or
    ``[max_blocks]`` for ``B = 1``), all int64 on the device."""
    table = block_table.view(position.shape[0], -1)
    return table.gather(1, (position // PAGE_SIZE).view(-1, 1)).view(-1) * PAGE_SIZE + position % PAGE_SIZE


def static_decode_attention(
    query: torch.Tensor, key_plane: torch.Tensor, value_plane: torch.Tensor,
    block_table: torch.Tensor, context_len: torch.Tensor, scale: float, *,
    sinks: torch.Tensor | None = None, sliding_window: int | None = None,
) -> torch.Tensor:
    """One query token per sequence attending over its paged context, with static shapes.

    Args:
        query: ``[B, H, D]``.
        key_plane, value_plane: ``[num_blocks, PAGE_SIZE, KVH, D]``.
        block_table: ``[B, max_blocks]`` (or ``[max_blocks]`` for ``B = 1``) int64 page ids
            (padding entries may be any valid page).
        context_len: ``[B]`` int64, keys ``0 .. context_len-1`` are visible
            (the query's own KV already written at ``context_len - 1``).
        scale: softmax scale.
        sinks: optional ``[H]`` per-head sink logits (GPT-OSS; transformers'
            ``eager_attention_forward``): an extra softmax term whose mass is dropped.
        sliding_window: optional window ``W``: only keys at positions ``> context_len - 1 - W``.

    Returns:
        ``[B, H, D]`` in ``query.dtype``; the softmax runs in fp32.
    """
    if query.shape[0] > 1:
        table = block_table.view(query.shape[0], -1)
        return torch.cat([static_decode_attention(query[i:i + 1], key_plane, value_plane, table[i],
                                                  context_len[i:i + 1], scale, sinks=sinks,
                                                  sliding_window=sliding_window) for i in range(query.shape[0])])
    block_table = block_table.view(-1)
    num_heads, head_dim = query.shape[1], query.shape[2]
    kvh = key_plane.shape[2]
    k = key_plane.index_select(0, block_table).flatten(0, 1)  # [L, KVH, D], L = max_blocks * PAGE_SIZE
    v = value_plane.index_select(0, block_table).flatten(0, 1)
    q = query[0].view(kvh, num_heads // kvh, head_dim).float()  # [KVH, G, D]
    scores = torch.einsum("kgd,lkd->kgl", q, k.float()) * scale  # [KVH, G, L]
    pos = torch.arange(k.shape[0], device=query.device)
    visible = pos < context_len
    if sliding_window is not None:
        visible = visible & (pos > context_len - 1 - sliding_window)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(kvh, num_heads // kvh, 1)
        m = torch.maximum(scores.amax(-1, keepdim=True), sink)
        e = torch.exp(scores - m)
        probs = e / (e.sum(-1, keepdim=True) + torch.exp(sink - m))
    else:
        probs = torch.softmax(scores, -1)
    out = torch.einsum("kgl,lkd->kgd", probs, v.float())  # [KVH, G, D]
    return out.reshape(1, num_heads, head_dim).to(query.dtype)


def rope_kv_write_reference(qkv, cos_table, sin_table, position, block_table, key_plane, value_plane,
                            num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Torch reference of :func:`replicas.kernels.triton_rope_kv.triton_rope_kv`: split ``qkv``
    ``[B, (H + 2 KVH) D]``, rotate q/k at ``position`` ``[B]`` (half-split pairs), write k/v through
    ``block_table`` and return q ``[B, H, D]``."""
    from replicas.kernels.paged_attention import write_kv

    t = qkv.shape[0]
    d = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    cos, sin = cos_table[position, : d // 2].to(qkv.dtype), sin_table[position, : d // 2].to(qkv.dtype)
    q = apply_rope_half(q.view(t, num_heads, d), cos, sin)
    k = apply_rope_half(k.reshape(t, num_kv_heads, d), cos, sin)
    write_kv(k, v.reshape(t, num_kv_heads, d), key_plane, value_plane, static_slot(block_table, position))
    return q


BATCH_INVARIANT_SPLITS = 32
"""Decode attention's split-K count with :attr:`DecodeOps.batch_invariant`, at every batch size (the batch-one
choice, :data:`~replicas.kernels.triton_decode_attention.FEW_HEADS_SPLITS`): each row's splits then depend on
its own context length only."""


def _one_row(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class DecodeOps:
    """The decode-step operations of one model on one device, resolved once.

    Attributes:
        triton: the Triton kernels run (a CUDA/ROCm device with Triton installed); else the torch references.
        nvidia: an NVIDIA GPU (the inline-PTX and single-launch fused kernels need one).
        pdl: kernels launch with programmatic dependent launch (requested and supported: sm_90+).
        prefill_kernels: the eager forward (prefill, mixed and large standard-lane steps) runs the Triton
            prefill attention over the paged cache (:mod:`replicas.kernels.prefill_attention`) and the MoE's
            grouped GEMMs; else their torch references. The model runner passes it to each forward's
            attention metadata.
        moe: the MoE kernels (GPT-OSS models; None for dense models).
        batch_invariant: every op runs a row-exact kernel (``docs/exactness.md``): a row's result is bitwise
            the same whatever other rows share the launch. Decode rows (:meth:`linear`, :meth:`route`,
            :meth:`lm_head`, :meth:`moe_add_rmsnorm` with ``prefill=False``) take the decode family at every
            batch size, one row included (no batch-one GEMV, no fused norm + projection); prompt tokens
            (``prefill=True``) the prefill family; decode attention a fixed split count
            (:data:`BATCH_INVARIANT_SPLITS`). Only with ``triton`` and the grouped MoE GEMMs.
    """

    triton: bool = False
    nvidia: bool = False
    pdl: bool = False
    prefill_kernels: bool = False
    moe: MoE | None = None
    batch_invariant: bool = False

    @classmethod
    def build(cls, device: torch.device | str, dtype: torch.dtype, *, pdl: bool = True, moe_backend: str | None = None,
              moe_repack: bool = True, moe_tiles: dict[str, int] | None = None,
              prefill_kernels: bool = True, batch_invariant: bool = False) -> DecodeOps:
        """Resolve the kernels for a ``dtype`` model on ``device``.

        Args:
            pdl: use programmatic dependent launch where the GPU supports it.
            prefill_kernels: on a GPU, the Triton prefill attention and the MoE's grouped GEMMs serve the
                eager forward (engine config ``prefill_kernels``).
            moe_backend: ``auto`` or a name of :data:`replicas.kernels.moe.MOE_BACKENDS` for models with
                experts; None for dense models (no MoE).
            moe_repack, moe_tiles: see :func:`replicas.kernels.moe.resolve_moe`.
            batch_invariant: the row-exact kernels (:attr:`batch_invariant`); ignored off the GPU, where the
                torch references are already independent of the batch (fp32, one row at a time where it
                matters: ``docs/exactness.md``).

        Raises:
            replicas.kernels.moe.MoEBackendError: the MoE backend or its tiles cannot run here.
            ValueError: ``batch_invariant`` on a GPU without the prefill kernels (the grouped MoE GEMMs are
                the MoE's row-exact kernels).
        """
        device = torch.device(device)
        triton = device.type == "cuda" and _triton_importable()
        nvidia = triton and not torch.version.hip
        use_pdl = False
        if pdl and nvidia:
            from replicas.kernels.pdl import supported

            use_pdl = supported(device)
        moe = None
        if moe_backend is not None:
            moe = MoE(resolve_moe(moe_backend, device, dtype, moe_repack, moe_tiles, prefill_kernels), pdl=use_pdl)
        invariant = triton and batch_invariant
        if invariant and not prefill_kernels:
            raise ValueError("batch_invariant needs prefill_kernels (the grouped MoE GEMMs and the prefill "
                             "attention are its row-exact kernels)")
        return cls(triton=triton, nvidia=nvidia, pdl=use_pdl, prefill_kernels=triton and prefill_kernels, moe=moe,
                   batch_invariant=invariant)

    @classmethod
    def reference(cls, moe: bool = False) -> DecodeOps:
        """The torch references everywhere (what a model uses until :meth:`build`'s ops are given to it);
        with ``moe``, the reference MoE."""
        return cls(moe=MoE(MoEChoice("reference", "reference", False, reason="torch reference")) if moe else None)

    @property
    def moe_choice(self) -> MoEChoice | None:
        return self.moe.choice if self.moe is not None else None

    def describe(self) -> dict:
        """A JSON-able record of what runs (``/debug/stats``, span attributes)."""
        out = {"decode_kernels": "triton" if self.triton else "torch", "pdl": self.pdl,
               "prefill_kernels": self.prefill_kernels, "batch_invariant": self.batch_invariant}
        if self.moe is not None:
            out |= self.moe.choice.describe()
        return out

    # ------------------------------------------------------------------------------------- projections

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)``: ``x`` ``[T, K]``, ``weight`` ``[N, K]``, ``bias`` ``[N]`` → ``[T, N]``.
        One bf16/fp16 row on a GPU: the batch-one Triton GEMV (:func:`replicas.kernels.triton_gemv.triton_gemv`);
        everything else (fp32, batches, CPU): torch. With :attr:`batch_invariant`, every row count: the
        decode family of :mod:`replicas.kernels.row_exact_gemm`."""
        if self.batch_invariant:
            from replicas.kernels.row_exact_gemm import decode_gemm

            return decode_gemm(x, weight, bias)
        if self.triton and _one_row(x):
            from replicas.kernels.triton_gemv import triton_gemv

            return triton_gemv(x, weight, bias, pdl=self.pdl)
        return torch.nn.functional.linear(x, weight, bias)

    def prefill_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                       ) -> torch.Tensor:
        """:meth:`linear` for prompt tokens (the eager forward): with :attr:`batch_invariant` the prefill
        family of :mod:`replicas.kernels.row_exact_gemm` (one fixed tile for any token count), else
        :meth:`linear`. Shapes as :meth:`linear`."""
        if self.batch_invariant:
            from replicas.kernels.row_exact_gemm import prefill_gemm

            return prefill_gemm(x, weight, bias)
        return self.linear(x, weight, bias)

    def lm_head(self, h: torch.Tensor, weight: torch.Tensor, prefill: bool = False) -> torch.Tensor:
        """Logits ``[T, vocab]`` in ``h.dtype`` of the normed rows ``h`` ``[T, hidden]`` (``weight``
        ``[vocab, hidden]``): a row-exact family with :attr:`batch_invariant` (``prefill`` picks which), else
        ``F.linear`` (cuBLAS on a GPU)."""
        if self.batch_invariant:
            return self.prefill_linear(h, weight) if prefill else self.linear(h, weight)
        return torch.nn.functional.linear(h, weight)

    def swiglu_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Llama's MLP input: ``silu(gate) * up`` with ``gate, up = F.linear(x, weight).chunk(2, -1)`` (Shazeer
        2020); ``x`` ``[T, K]``, ``weight`` ``[2I, K]`` (gate rows over up rows) → ``[T, I]``. One bf16/fp16 row
        on a GPU: one Triton GEMV launch with the SwiGLU in its epilogue (fp32 sums, rounded once); otherwise
        torch, as transformers' ``LlamaMLP`` (with :attr:`batch_invariant`: :meth:`linear`'s row-exact GEMM,
        then the SwiGLU in torch, elementwise)."""
        if self.triton and _one_row(x) and not self.batch_invariant:
            from replicas.kernels.triton_gemv import triton_gemv

            return triton_gemv(x, weight, swiglu=True, pdl=self.pdl)
        gate, up = (self.linear(x, weight) if self.batch_invariant else torch.nn.functional.linear(x, weight)
                    ).chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    # ---------------------------------------------------------------------------------------- norms

    def add_rmsnorm(self, x: torch.Tensor, delta: torch.Tensor | None, norm, weight_in_fp32: bool,
                    mxfp4_out: bool = False):
        """``(x + delta, norm(x + delta))`` for ``[T, hidden]`` rows (``delta`` may also be fp32 partials
        ``[T, P, hidden]``, summed in order); ``norm`` has ``weight`` and ``eps``. With ``mxfp4_out``, a third
        result: the normed rows in the tensor-core MoE kernels' activation format
        (:func:`~replicas.kernels.moe.mma_format.mxfp4_activations`). One Triton launch on a GPU
        (:mod:`replicas.kernels.triton_rmsnorm`), :func:`add_rmsnorm_reference` elsewhere."""
        if self.triton:
            from replicas.kernels.triton_rmsnorm import triton_add_rmsnorm

            return triton_add_rmsnorm(x, delta, norm.weight, norm.eps, weight_in_fp32, mxfp4_out, pdl=self.pdl)
        x, y = add_rmsnorm_reference(x, delta, norm.weight, norm.eps, weight_in_fp32)
        if mxfp4_out:
            from replicas.kernels.moe.mma_format import mxfp4_activations

            return x, y, mxfp4_activations(y)
        return x, y

    def add_rmsnorm_linear(self, x: torch.Tensor, delta: torch.Tensor | None, norm, weight_in_fp32: bool,
                           weight: torch.Tensor, bias: torch.Tensor | None = None, swiglu: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`add_rmsnorm` then the projection that reads the normed rows (:meth:`linear`, or
        :meth:`swiglu_linear` with ``swiglu``): ``(x + delta, proj(norm(x + delta)))``; ``x``, ``delta``
        ``[T, K]``, ``weight`` ``[N, K]`` (``[2N, K]`` with ``swiglu``) → ``([T, K], [T, N])``. One bf16/fp16
        row on a GPU with ``K <= NORM_MAX_K``: one Triton launch whose programs each recompute the norm
        (:func:`replicas.kernels.triton_gemv.triton_add_rmsnorm_gemv`); otherwise (and with
        :attr:`batch_invariant`) the two steps."""
        if self.triton and _one_row(x) and not self.batch_invariant:
            from replicas.kernels.triton_gemv import NORM_MAX_K, triton_add_rmsnorm_gemv

            if x.shape[1] <= NORM_MAX_K:
                return triton_add_rmsnorm_gemv(x, delta, norm.weight, norm.eps, weight, bias,
                                               weight_in_fp32=weight_in_fp32, swiglu=swiglu, pdl=self.pdl)
        x, h = self.add_rmsnorm(x, delta, norm, weight_in_fp32)
        return x, self.swiglu_linear(h, weight) if swiglu else self.linear(h, weight, bias)

    # ------------------------------------------------------------------------------------ attention

    def rope_kv_write(self, attn, x, cos_table, sin_table, position, block_table, key_plane, value_plane, qkv=None):
        """Project ``x`` ``[B, hidden]`` with ``attn``'s fused qkv, rotate q/k, write k/v to the cache; return q
        ``[B, H, D]`` (``position`` ``[B]``, ``block_table`` ``[B, max_blocks]`` or ``[max_blocks]`` for
        ``B = 1``).

        ``attn`` has ``qkv_proj`` (callable), ``num_heads``, ``num_kv_heads``, ``head_dim``.
        ``cos_table``/``sin_table`` are ``[max_pos, D]`` (Llama, halves repeated) or ``[max_pos, D/2]``
        (GPT-OSS); both rotate the half-split pairs ``(i, i + D/2)``. One Triton launch after the GEMM on a
        GPU (:mod:`replicas.kernels.triton_rope_kv`); :func:`rope_kv_write_reference` elsewhere. ``qkv``:
        the projection ``[B, (H + 2 KVH) D]`` when the caller computed it (then ``attn.qkv_proj`` is not
        called)."""
        qkv = attn.qkv_proj(x) if qkv is None else qkv
        if self.triton:
            from replicas.kernels.triton_rope_kv import triton_rope_kv

            return triton_rope_kv(qkv, cos_table, sin_table, position, block_table, key_plane, value_plane,
                                  attn.num_heads, attn.num_kv_heads, pdl=self.pdl)
        return rope_kv_write_reference(qkv, cos_table, sin_table, position, block_table, key_plane, value_plane,
                                       attn.num_heads, attn.num_kv_heads)

    def prefill_rope_kv(self, attn, qkv, cos_table, sin_table, positions, slots, key_plane, value_plane):
        """The eager forward's RoPE + KV write for ``T`` tokens of any mix of sequences: rotate q/k of ``qkv``
        ``[T, (H + 2 KVH) D]`` (``attn``'s fused projection) at ``positions`` ``[T]``, write k/v at ``slots``
        ``[T]`` (``AttentionMetadata.slot_mapping``), return q ``[T, H, D]``. One Triton launch when ``triton``
        (:func:`~replicas.kernels.triton_prefill_rope_kv.triton_prefill_rope_kv`), its torch reference
        elsewhere; ``attn`` has ``num_heads``, ``num_kv_heads``."""
        from replicas.kernels import triton_prefill_rope_kv as rk

        fn = rk.triton_prefill_rope_kv if self.triton else rk.prefill_rope_kv_reference
        return fn(qkv, cos_table, sin_table, positions, slots, key_plane, value_plane, attn.num_heads,
                  attn.num_kv_heads)

    def decode_attention(self, query, key_plane, value_plane, block_table, context_len, scale, *, sinks=None,
                         sliding_window=None, workspace=None):
        """One query token per sequence over its paged context: the Triton kernel on a GPU
        (:func:`replicas.kernels.triton_decode_attention.triton_decode_attention`), else
        :func:`static_decode_attention` (same arguments and result; ``workspace`` is the kernel's reusable
        scratch dict, ignored by the reference). With :attr:`batch_invariant` the split count does not depend
        on the batch (:data:`BATCH_INVARIANT_SPLITS`; one for short windows, as always)."""
        if self.triton:
            from replicas.kernels.triton_decode_attention import (
                default_splits,
                triton_decode_attention,
            )

            splits = None
            if self.batch_invariant:
                splits = min(BATCH_INVARIANT_SPLITS, default_splits(key_plane.shape[2], 1, sliding_window))
            return triton_decode_attention(query, key_plane, value_plane, block_table, context_len, scale,
                                           sinks=sinks, sliding_window=sliding_window, workspace=workspace,
                                           num_splits=splits, pdl=self.pdl)
        return static_decode_attention(query, key_plane, value_plane, block_table, context_len, scale, sinks=sinks,
                                       sliding_window=sliding_window)

    # ---------------------------------------------------------------------------- router and experts

    def route(self, router, x: torch.Tensor, prefill: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights ``[T, K]`` (``x.dtype``) and expert ids ``[T, K]`` int64 for ``x`` ``[T, hidden]``.
        ``router`` has ``weight [E, hidden]``, ``bias [E]``, ``top_k`` (GPT-OSS's ``Router``). The top-k is
        one Triton launch on a GPU, :func:`~replicas.kernels.reference.router_topk_reference` elsewhere.
        ``prefill``: the rows are prompt tokens (:meth:`prefill_linear`)."""
        logits = (self.prefill_linear if prefill else self.linear)(x, router.weight, router.bias)  # [T, E]
        if self.triton:
            from replicas.kernels.triton_router import triton_router_topk

            return triton_router_topk(logits, router.top_k, x.dtype, pdl=self.pdl)
        return router_topk_reference(logits, router.top_k, x.dtype)

    def add_rmsnorm_route(self, x: torch.Tensor, delta: torch.Tensor, norm, router, mxfp4_out: bool = False,
                          workspace: dict | None = None, prefill: bool = False) -> tuple[torch.Tensor, ...]:
        """GPT-OSS's residual add + RMSNorm (weight in fp32) after attention, then :meth:`route` on the normed
        rows: ``(x + delta, h, h_mxfp4 or None, weights [T, K], ids [T, K])`` for ``x``, ``delta``
        ``[T, hidden]``; ``h_mxfp4`` (with ``mxfp4_out``) is ``h`` in the tensor-core MoE kernels' format.
        One bf16/fp16 row on an NVIDIA GPU with a biased, contiguous router: one Triton launch
        (:func:`~replicas.kernels.triton_router.triton_add_rmsnorm_route`, scratch kept in ``workspace``);
        otherwise (and with :attr:`batch_invariant`) :meth:`add_rmsnorm` then :meth:`route` (``prefill``: the
        rows are prompt tokens)."""
        if (self.nvidia and _one_row(x) and router.bias is not None and router.weight.is_contiguous()
                and not self.batch_invariant):
            from replicas.kernels.triton_router import triton_add_rmsnorm_route

            return triton_add_rmsnorm_route(x, delta, norm.weight, norm.eps, router.weight, router.bias,
                                            router.top_k, mxfp4_out=mxfp4_out, workspace=workspace, pdl=self.pdl)
        x, h, *h_mx = self.add_rmsnorm(x, delta, norm, True, mxfp4_out=mxfp4_out)
        return x, h, h_mx[0] if h_mx else None, *self.route(router, h, prefill)

    def moe_add_rmsnorm(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts,
                        residual: torch.Tensor, norm, weight_in_fp32: bool, x_mxfp4: torch.Tensor | None = None,
                        prefill: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The MoE layer, its residual add and the next RMSNorm: ``(x_new, norm(x_new))`` with
        ``x_new = residual + moe(x)`` ``[T, hidden]``. ``x_mxfp4``: ``x`` in the tensor-core kernels' format
        when :attr:`takes_mxfp4_activations` (written by the add+RMSNorm that produced ``x``).

        With a partials backend two launches write per-expert fp32 partials and one add+RMSNorm launch sums
        them (fixed order, no atomics); otherwise the MoE with its residual, then :meth:`add_rmsnorm`. With
        :attr:`batch_invariant` the grouped GEMMs at every token count, with a fixed M-block height per family
        (``prefill``: prompt tokens, :data:`~replicas.kernels.moe.ROW_EXACT_BLOCK_M`).

        Raises:
            RuntimeError: the ops were built without a MoE backend.
        """
        if self.moe is None:
            raise RuntimeError("DecodeOps built without a MoE backend (moe_backend=None)")
        if self.batch_invariant:
            parts = self.moe.row_exact_partials(x, weights, ids, experts, prefill, x_mxfp4)
        else:
            parts = self.moe.partials(x, weights, ids, experts, x_mxfp4)
        if parts is not None:
            return self.add_rmsnorm(residual, parts, norm, weight_in_fp32)
        return self.add_rmsnorm(self.moe(x, weights, ids, experts, residual=residual), None, norm, weight_in_fp32)

    def mxfp4_for(self, tokens: int, prefill: bool = False) -> bool:
        """Whether a step of ``tokens`` rows (``prefill``: prompt tokens, else decode rows) runs MoE kernels
        that read the tensor-core activation format (the add + RMSNorm before them then writes it):
        :attr:`takes_mxfp4_activations`, and :meth:`~replicas.kernels.moe.MoE.reads_mxfp4` for the path
        :meth:`moe_add_rmsnorm` takes (the row-exact one with :attr:`batch_invariant`)."""
        return self.takes_mxfp4_activations and self.moe.reads_mxfp4(tokens, prefill, self.batch_invariant)

    @property
    def takes_mxfp4_activations(self) -> bool:
        """Whether the MoE kernel reads its activations in the tensor-core format (the add+RMSNorm launch
        before it then writes them too: ``mxfp4_out=True``)."""
        return (self.moe is not None and self.moe.takes_mxfp4_activations
                and (not self.batch_invariant or self.moe.row_exact_decode))


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def add_rmsnorm_reference(x, delta, weight, eps, weight_in_fp32):
    """Torch reference of :func:`replicas.kernels.triton_rmsnorm.triton_add_rmsnorm` (same arguments and result).

    RMSNorm (Zhang & Sennrich 2019) in fp32; the weight applied after rounding to ``x.dtype`` (HF Llama)
    or in fp32 (HF GPT-OSS, ``weight_in_fp32``).
    """
    if delta is not None and delta.dim() == 3:  # fp32 partial sums [T, P, N], added in order
        acc = x.float()
        for p in range(delta.shape[1]):
            acc = acc + delta[:, p]
        x = acc.to(x.dtype)
    elif delta is not None:
        x = x + delta
    return x, rms_norm(x, weight, eps, weight_in_fp32)

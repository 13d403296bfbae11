"""GPT-OSS decoder (OpenAI gpt-oss-20b / -120b) over the paged KV cache.

Read top to bottom: YaRN RoPE → attention (biases, per-head sinks,
128-token sliding window on ``sliding_attention`` layers) → MoE (top-k router,
MXFP4 experts with the clamped SwiGLU) → decoder layer → model (RMSNorm:
:mod:`replicas.models.layers`; the half-split rotation: :mod:`replicas.kernels.reference`). Module and
tensor names mirror transformers' ``GptOssForCausalLM`` and the HF checkpoint
(experts as ``*_blocks``/``*_scales``), so safetensors load by name;
transformers is our test reference, not our runtime. Shapes: ``T`` = new
tokens in this forward, ``H`` = query heads, ``KVH`` = KV heads, ``D`` =
head_dim, ``E`` = experts, ``K`` = experts per token, ``I`` = expert width.

Expert memory: the experts stay packed (MXFP4, 4.25 bits per weight) as
buffers on the model's device; each forward dequantizes only the experts its
tokens were routed to, one at a time, into a transient ``[2I, hidden]`` +
``[hidden, I]`` pair in the compute dtype (GPT-OSS bf16: 2 x 2880 x 8640 bytes
= 50 MB). gpt-oss-120b is then ~61 GB of packed experts + ~4 GB of bf16
(attention, router, embeddings) instead of ~233 GB dense bf16. This is the
reference path; GPU kernels consume the packed buffers directly.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from replicas.kernels.decode_ops import DecodeOps
from replicas.kernels.moe import DECODE_MAX_TOKENS
from replicas.kernels.moe.mxfp4 import BLOCK_SIZE, BYTES_PER_BLOCK, MXFP4Error, check_mxfp4
from replicas.kernels.moe.reference import moe_reference
from replicas.kernels.paged_attention import (
    AttentionMetadata,
    paged_attention,
    prefill_attention,
    write_kv,
)
from replicas.kernels.reference import apply_rope_half
from replicas.models.base import MODELS, CausalLM
from replicas.models.gpt_oss_config import GptOssConfig, YarnScaling
from replicas.models.layers import RMSNorm
from replicas.models.loader import load_safetensors

KVPlanes = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer ``(key_plane, value_plane)``, each ``[num_blocks, PAGE_SIZE, KVH, D]``."""


# ---------------------------------------------------------------------------------------------- RoPE


def rope_inv_freq(head_dim: int, theta: float, yarn: YarnScaling | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_dim / 2]`` fp32 and the cos/sin scale (YaRN's ``mscale``, else 1).

    Plain RoPE (Su et al. 2021): ``inv_freq_i = theta ** (-2i / D)``. YaRN
    (Peng et al. 2023, §3.2 "NTK-by-parts", as transformers'
    ``_compute_yarn_parameters``): dims rotating more than ``beta_fast`` times
    over the original context keep their frequency, those rotating fewer than
    ``beta_slow`` times are divided by ``factor``, with a linear ramp between.
    """
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if yarn is None:
        return 1.0 / pos_freqs, 1.0

    def correction_dim(rotations: float) -> float:  # dim index that rotates `rotations` times over L
        return head_dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency
    inv_freq = (1.0 / (yarn.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, yarn.mscale


def rope_tables(cfg: GptOssConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[max_position_embeddings, D / 2]`` fp32, already multiplied by the YaRN mscale."""
    inv_freq, scale = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    freqs = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos() * scale, freqs.sin() * scale


# ----------------------------------------------------------------------------------------- attention


class Attention(nn.Module):
    """GQA attention with q/k/v/o biases and learned per-head sinks; a sliding window on sliding layers."""

    def __init__(self, cfg: GptOssConfig, layer: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=bias)
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads))  # [H] logits
        self.sliding_window = cfg.layer_window(layer)
        self.scale = cfg.head_dim**-0.5
        self._qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def fuse_qkv(self) -> None:
        """Store q/k/v weights (and biases) as row blocks of one ``[(H + 2 KVH) D, hidden]`` tensor.

        ``q_proj``/``k_proj``/``v_proj`` parameters become views into it (same
        names and state dict, no extra memory), so the decode step runs one
        GEMM. Call after the final ``.to(dtype/device)``: a later cast copies
        the parameters and un-fuses them (the method can then be called again).
        """
        projs = (self.q_proj, self.k_proj, self.v_proj)
        weight = torch.cat([p.weight.detach() for p in projs])
        bias = torch.cat([p.bias.detach() for p in projs]) if self.q_proj.bias is not None else None
        start = 0
        for p in projs:
            rows = p.weight.shape[0]
            p.weight = nn.Parameter(weight[start:start + rows], requires_grad=False)
            if bias is not None:
                p.bias = nn.Parameter(bias[start:start + rows], requires_grad=False)
            start += rows
        self._qkv = (weight, bias)

    def qkv_proj(self, x: torch.Tensor, linear=F.linear) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, (H + 2 KVH) D]``: q, k, v projections (with biases) in one output, one
        ``linear(x, weight, bias)`` call once :meth:`fuse_qkv` ran (the decode step passes its GEMV)."""
        fused = self._qkv
        if fused is None or fused[0].data_ptr() != self.q_proj.weight.data_ptr():
            return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        return linear(x, fused[0], fused[1])

    def forward(self, x, cos, sin, meta: AttentionMetadata, planes: tuple[torch.Tensor, torch.Tensor]):
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)  # [T, H, D]
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rope_half(q, cos, sin), apply_rope_half(k, cos, sin)
        write_kv(k, v, planes[0], planes[1], meta.slot_mapping)
        o = paged_attention(
            q, planes[0], planes[1], meta, self.scale, sinks=self.sinks, sliding_window=self.sliding_window
        )  # [T, H, D]
        return self.o_proj(o.reshape(t, -1))


# ----------------------------------------------------------------------------------------------- MoE


class Router(nn.Module):
    """Top-k router: ``logits = x W^T + b`` ``[T, E]``; the K largest, softmaxed among themselves."""

    def __init__(self, cfg: GptOssConfig):
        super().__init__()
        self.top_k = cfg.experts_per_token
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        self.bias = nn.Parameter(torch.zeros(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(weights [T, K] in x.dtype, expert ids [T, K] int64)``."""
        logits = F.linear(x, self.weight, self.bias)  # [T, E]
        top, idx = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=-1), idx


class Experts(nn.Module):
    """``E`` MXFP4 experts, kept packed; each routed expert is dequantized on the fly.

    Buffers (HF checkpoint names; logical weights in ``nn.Linear`` ``[out, in]`` layout):
        gate_up_proj_blocks: uint8 ``[E, 2I, hidden/32, 16]``; gate_up_proj_scales: uint8 ``[E, 2I, hidden/32]``.
        down_proj_blocks: uint8 ``[E, hidden, I/32, 16]``; down_proj_scales: uint8 ``[E, hidden, I/32]``.
    Parameters: gate_up_proj_bias ``[E, 2I]``, down_proj_bias ``[E, hidden]``.
    Gate and up rows are interleaved: row ``2j`` is gate ``j``, row ``2j + 1`` is up ``j``.
    Once the model's MoE backend repacked them at load (:meth:`GptOssForCausalLM.use_ops`;
    ``decode_layout`` True), the ``*_blocks`` hold :mod:`replicas.kernels.moe.decode_layout`'s bit layout,
    not the checkpoint's.
    """

    def __init__(self, cfg: GptOssConfig):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.register_buffer("gate_up_proj_blocks", torch.zeros(e, 2 * i, h // BLOCK_SIZE, BYTES_PER_BLOCK, dtype=torch.uint8))
        self.register_buffer("gate_up_proj_scales", torch.zeros(e, 2 * i, h // BLOCK_SIZE, dtype=torch.uint8))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * i))
        self.register_buffer("down_proj_blocks", torch.zeros(e, h, i // BLOCK_SIZE, BYTES_PER_BLOCK, dtype=torch.uint8))
        self.register_buffer("down_proj_scales", torch.zeros(e, h, i // BLOCK_SIZE, dtype=torch.uint8))
        self.down_proj_bias = nn.Parameter(torch.zeros(e, h))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]``, routing ``weights``/``idx`` ``[T, K]`` → ``sum_k w_k * expert_k(x)`` ``[T, hidden]``.

        Experts are visited in increasing id, as transformers' ``GptOssExperts.forward``
        (:func:`~replicas.kernels.moe.reference.moe_reference`).
        """
        return moe_reference(x, weights, idx, self)


class MLP(nn.Module):
    """Mixture of experts: route, then the weighted sum of the K chosen experts.

    ``ops`` (set by :meth:`GptOssForCausalLM.use_ops`) decides the kernels: with Triton, the router's
    top-k kernel and the model's MoE backend (its decode kernel for up to
    :data:`~replicas.kernels.moe.DECODE_MAX_TOKENS` tokens, the grouped GEMMs or the dequantization above);
    with the torch references, :class:`Router` and :class:`Experts` as transformers computes them."""

    def __init__(self, cfg: GptOssConfig):
        super().__init__()
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        self.ops = DecodeOps.reference(moe=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops.triton:
            weights, idx = self.ops.route(self.router, x)
            return self.ops.moe(x, weights, idx, self.experts)
        weights, idx = self.router(x)  # [T, K]
        return self.experts(x, weights, idx)


# ----------------------------------------------------------------------------------------- the model


class DecoderLayer(nn.Module):
    def __init__(self, cfg: GptOssConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, weight_in_fp32=True)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, weight_in_fp32=True)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, meta, planes):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, planes)
        return x + self.mlp(self.post_attention_layernorm(x))


class GptOssBackbone(nn.Module):
    def __init__(self, cfg: GptOssConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, weight_in_fp32=True)


@MODELS.register("gpt_oss")
class GptOssForCausalLM(CausalLM):
    """GPT-OSS decoder with an LM head, running over a paged KV cache.

    ``forward(input_ids [T] int64, meta, kv_planes) -> logits [B, vocab]`` (fp32)
    for the last new token of each of the ``B`` sequences in ``meta``; any
    ``T`` (prefill chunks, batched decode, or the persistent lane's one token).
    """

    def __init__(self, cfg: GptOssConfig):
        super().__init__()
        self.config = cfg
        self.model = GptOssBackbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg)
        self.ops = DecodeOps.reference(moe=True)  # the kernels: use_ops() sets the ones resolved at load
        self._decode_workspace: dict = {}  # scratch of the Triton decode attention, reused by every layer
        self.register_buffer("rope_cos", cos, persistent=False)  # [max_pos, D/2] fp32
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_planes: KVPlanes) -> torch.Tensor:
        if meta.kernels and self.ops.triton and self.layered_kernel_forward:
            return self.forward_kernels(input_ids, meta, kv_planes)
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        cos = self.rope_cos[meta.positions].to(x.dtype)  # [T, D/2]
        sin = self.rope_sin[meta.positions].to(x.dtype)
        for layer, planes in zip(self.model.layers, kv_planes, strict=True):
            x = layer(x, cos, sin, meta, planes)
        x = self.model.norm(x[meta.last_token_indices.to(x.device)])  # [B, hidden]
        return self.lm_head(x).float()  # [B, vocab]

    def forward_kernels(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_planes: KVPlanes) -> torch.Tensor:
        """:meth:`forward` through the kernels (``meta.kernels`` and Triton ops: the GPU's prefill and mixed
        standard-lane steps; the CPU under Triton's interpreter in tests), laid out as :meth:`decode_static`:
        per layer the fused qkv GEMM, one RoPE + KV-write launch for all ``T`` tokens
        (:meth:`DecodeOps.prefill_rope_kv`), one prefill-attention launch
        (:func:`~replicas.kernels.paged_attention.prefill_attention`), the o_proj GEMM, the residual add +
        RMSNorm + router + top-k (:meth:`DecodeOps.add_rmsnorm_route`), and the MoE whose per-expert fp32
        partials the next add + RMSNorm launch sums with the residual (:meth:`DecodeOps.moe_add_rmsnorm`:
        above :data:`~replicas.kernels.moe.DECODE_MAX_TOKENS` tokens the grouped GEMMs, three grouping
        launches and two GEMMs). RoPE runs in fp32 from the fp32 tables (the torch path rotates in the
        activations' dtype); the MoE's partials are added to the residual in fp32 and rounded once.

        Returns:
            ``[B, vocab]`` fp32 logits of each sequence's last new token.
        """
        ops = self.ops
        layers = self.model.layers
        t = input_ids.shape[0]
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        _, h = ops.add_rmsnorm(x, None, layers[0].input_layernorm, True)
        mx = ops.mxfp4_for(t, prefill=True)  # the MoE kernels read the tensor-core activation format
        for i, (layer, (kp, vp)) in enumerate(zip(layers, kv_planes, strict=True)):
            attn = layer.self_attn
            q = ops.prefill_rope_kv(attn, attn.qkv_proj(h, ops.prefill_linear), self.rope_cos, self.rope_sin,
                                    meta.positions, meta.slot_mapping, kp, vp)  # [T, H, D]
            o = prefill_attention(q, kp, vp, meta, attn.scale, sinks=attn.sinks, sliding_window=attn.sliding_window)
            o = ops.prefill_linear(o.reshape(t, -1), attn.o_proj.weight, attn.o_proj.bias)
            x, h, h_mx, weights, ids = ops.add_rmsnorm_route(x, o, layer.post_attention_layernorm, layer.mlp.router,
                                                             mxfp4_out=mx, workspace=self._decode_workspace,
                                                             prefill=True)
            norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            x, h = ops.moe_add_rmsnorm(h, weights, ids, layer.mlp.experts, x, norm, True, x_mxfp4=h_mx, prefill=True)
        return ops.lm_head(h[meta.last_token_indices.to(h.device)], self.lm_head.weight, prefill=True).float()

    layered_kernel_forward = True
    """With the kernels (``meta.kernels`` and Triton ops), :meth:`forward` runs :meth:`forward_kernels`; False
    runs the layer modules with the prefill attention and the MoE kernels only (a benchmark's comparison, as
    ``benchmarks/prefill.py`` measures both; serving keeps True)."""

    config_class = GptOssConfig
    """The config type ``config.json`` parses into."""

    uses_moe = True
    """The model has experts: its :class:`DecodeOps` are built with a MoE backend."""

    has_static_decode = True
    """:meth:`decode_static` is the capturable decode step."""

    @property
    def max_decode_graph_batch(self) -> int | None:
        """Largest standard-lane decode CUDA-graph batch: no limit when the MoE's prefill path is the grouped
        GEMMs (capturable at any batch, :attr:`~replicas.kernels.moe.MoE.capturable_at_any_batch`), else
        :data:`~replicas.kernels.moe.DECODE_MAX_TOKENS` (above it the experts are dequantized: a host
        sync, not capturable)."""
        moe = self.ops.moe
        return None if moe is not None and moe.capturable_at_any_batch else DECODE_MAX_TOKENS

    def warm_up_prompt_lengths(self, max_tokens: int) -> tuple[int, ...]:
        """Prompt lengths (at most ``max_tokens``) whose prefill reaches every M-block height of the grouped
        MoE GEMMs for this model's experts (:func:`~replicas.kernels.moe.grouped_gemm.token_counts_per_block_m`;
        above :data:`~replicas.kernels.moe.DECODE_MAX_TOKENS`, where the grouped path starts), for
        :meth:`replicas.engine.LLMEngine.warm_up`."""
        from replicas.kernels.moe.grouped_gemm import token_counts_per_block_m

        cfg = self.config
        found = token_counts_per_block_m(cfg.num_experts, cfg.experts_per_token, DECODE_MAX_TOKENS + 1, max_tokens)
        return tuple(sorted(found.values()))

    def use_ops(self, ops: DecodeOps) -> GptOssForCausalLM:
        """Run on ``ops`` (resolved once at load by :func:`replicas.models.registry.load_model`): every layer's
        MoE and the decode step use its kernels, and the experts are repacked in place when its MoE backend
        reads the repacked layout. Call once the weights are loaded, before any CUDA graph is captured;
        returns ``self``.

        Raises:
            ValueError: ``ops`` has no MoE backend."""
        if ops.moe is None:
            raise ValueError("GPT-OSS needs DecodeOps with a MoE backend")
        self.ops = ops
        for layer in self.model.layers:
            layer.mlp.ops = ops
            ops.moe.prepare(layer.mlp.experts)
        return self

    def fuse_qkv(self) -> GptOssForCausalLM:
        """Fuse every layer's q/k/v projections (:meth:`Attention.fuse_qkv`); returns ``self``."""
        for layer in self.model.layers:
            layer.self_attn.fuse_qkv()
        return self

    def decode_static(
        self, token: torch.Tensor, position: torch.Tensor, block_table: torch.Tensor, kv_planes: KVPlanes
    ) -> torch.Tensor:
        """One greedy-decode step with static shapes and no host sync (CUDA-graph capturable).

        Per layer on CUDA: fused qkv GEMV (1 launch at batch one in bf16/fp16: :func:`linear`), RoPE +
        KV write (1 Triton launch), split-K attention with sinks/window (2), o_proj GEMV (1), residual
        add + RMSNorm + router GEMV + top-k softmax (1 at batch one, else 3), MXFP4 gate_up + SwiGLU (1),
        MXFP4 down per expert (1); the experts' sum, the residual add and the next layer's RMSNorm are one more
        launch.
        Torch references of the same kernels on CPU. Call under ``torch.inference_mode()``.

        Args:
            token: ``[B]`` int64 pending tokens; position: ``[B]`` int64 their positions (committed KV
                lengths; -1 marks a padding row of a CUDA-graph batch, Triton kernels only).
            block_table: ``[B, max_blocks]`` (or ``[max_blocks]`` for ``B = 1``) int64 page ids.
            kv_planes: per layer ``(key_plane, value_plane)``.

        Returns:
            ``[B, vocab]`` logits for each sequence's next token, in the LM head's dtype (one
            conversion launch fewer per step; callers that sample convert).
        """
        ops = self.ops
        context_len = position + 1
        layers = self.model.layers
        x = self.model.embed_tokens(token)  # [B, hidden]
        _, h = ops.add_rmsnorm(x, None, layers[0].input_layernorm, True)
        # the post-attention norm also writes the MoE kernels' activation format when they read it
        mx = ops.mxfp4_for(x.shape[0])
        for i, (layer, (kp, vp)) in enumerate(zip(layers, kv_planes, strict=True)):
            attn = layer.self_attn
            q = ops.rope_kv_write(attn, h, self.rope_cos, self.rope_sin, position, block_table, kp, vp,
                                  qkv=attn.qkv_proj(h, ops.linear))  # [B, H, D]
            o = ops.decode_attention(q, kp, vp, block_table, context_len, attn.scale, sinks=attn.sinks,
                                     sliding_window=attn.sliding_window, workspace=self._decode_workspace)
            o = ops.linear(o.reshape(x.shape[0], -1), attn.o_proj.weight, attn.o_proj.bias)
            x, h, h_mx, weights, ids = ops.add_rmsnorm_route(x, o, layer.post_attention_layernorm, layer.mlp.router,
                                                             mxfp4_out=mx, workspace=self._decode_workspace)
            norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            x, h = ops.moe_add_rmsnorm(h, weights, ids, layer.mlp.experts, x, norm, True, x_mxfp4=h_mx)
        return ops.lm_head(h, self.lm_head.weight)  # the LM head's dtype: greedy quanta take the argmax as it is

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
        progress: bool = True,
    ) -> GptOssForCausalLM:
        """Build from an HF GPT-OSS directory (``config.json`` + safetensors with MXFP4 experts).

        Floating tensors are cast to ``dtype``; ``*_blocks``/``*_scales`` stay uint8.

        Raises:
            ValueError: a missing, unexpected, mis-shaped or mis-typed tensor
                (named in the message; :class:`MXFP4Error` for packed experts).
        """
        cfg = GptOssConfig.from_dir(path)
        for dim, name in ((cfg.hidden_size, "hidden_size"), (cfg.intermediate_size, "intermediate_size")):
            if dim % BLOCK_SIZE:
                raise ValueError(f"{name}={dim} is not a multiple of the MXFP4 block size {BLOCK_SIZE}")
        with torch.device("meta"):
            model = cls(cfg)
        weights = load_safetensors(Path(path), dtype, device, progress=progress)
        if cfg.tie_word_embeddings and "model.embed_tokens.weight" in weights:
            weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
        check_weights(model.state_dict(), weights, path)
        model.load_state_dict(weights, strict=True, assign=True)
        cos, sin = rope_tables(cfg)
        model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
        return model.eval().fuse_qkv()

    @classmethod
    def from_config(
        cls, cfg: GptOssConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0,
    ) -> GptOssForCausalLM:
        """A model of ``cfg``'s shape with random weights generated on ``device``
        (:func:`replicas.models.dummy.randomize_`: experts random packed MXFP4); ``load_format=dummy``."""
        from replicas.models.dummy import randomize_

        with torch.device("meta"):
            model = cls(cfg).to(dtype)
        model = randomize_(model.to_empty(device=device), seed)
        cos, sin = rope_tables(cfg)
        model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
        return model.eval().fuse_qkv()


def check_weights(expected: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], path) -> None:
    """Every expected tensor present with its shape and kind; raise ``ValueError`` naming the first bad one.

    ``expected`` is the (meta) model's state dict. Packed experts are checked
    pairwise by :func:`~replicas.kernels.moe.mxfp4.check_mxfp4`.
    """
    missing = sorted(expected.keys() - weights.keys())
    unexpected = sorted(weights.keys() - expected.keys())
    if missing or unexpected:
        dense = [n for n in unexpected if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
        hint = " (dense expert weights are not supported: expected MXFP4 *_blocks/*_scales)" if dense else ""
        raise ValueError(
            f"checkpoint {path} does not match gpt_oss: missing {missing[:5]}, unexpected {unexpected[:5]}{hint}"
        )
    for name, ref in expected.items():
        got = weights[name]
        if name.endswith("_blocks"):
            base = name.removesuffix("_blocks")
            scales = weights[base + "_scales"]
            logical = (*ref.shape[:-2], ref.shape[-2] * BLOCK_SIZE)
            try:
                check_mxfp4(got, scales, name=base, shape=logical)
            except MXFP4Error as exc:
                raise MXFP4Error(f"checkpoint {path}: {exc}") from None
        elif name.endswith("_scales"):
            continue  # checked with its blocks
        elif not got.is_floating_point():
            raise ValueError(f"checkpoint {path}: tensor {name} has dtype {got.dtype}, expected a floating dtype")
        elif got.shape != ref.shape:
            raise ValueError(
                f"checkpoint {path}: tensor {name} has shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
            )

"""Llama-family decoder over the paged KV cache (SmolLM2, Llama 2/3 without RoPE scaling).

Read top to bottom: RMSNorm → attention (RoPE, paged cache) → SwiGLU MLP →
decoder layer → model. Module names mirror transformers' ``LlamaForCausalLM``
except two fusions made at load (:func:`fuse_hf_weights`): q/k/v into one
``qkv_proj`` and gate/up into one ``gate_up_proj``, so a decode step runs
two GEMMs fewer per layer. transformers is our test reference, not our runtime. Shapes: ``T`` = new tokens in this forward,
``H`` = query heads, ``KVH`` = KV heads, ``D`` = head_dim.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from replicas.kernels.decode_ops import DecodeOps
from replicas.kernels.paged_attention import AttentionMetadata, paged_attention, write_kv
from replicas.models.base import MODELS, CausalLM
from replicas.models.config import ModelConfig
from replicas.models.layers import RMSNorm
from replicas.models.loader import load_safetensors

KVPlanes = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer ``(key_plane, value_plane)``, each ``[num_blocks, PAGE_SIZE, KVH, D]``."""


def rope_tables(head_dim: int, max_positions: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE cos/sin tables, ``[max_positions, head_dim]`` fp32 (RoFormer, half-split layout as in HF Llama)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, D]`` by per-token ``cos``/``sin`` ``[T, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention with one fused QKV projection (rows: q, then k, then v)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=bias)
        self.scale = cfg.head_dim**-0.5

    def project(self, x, cos, sin):
        """``x [T, hidden]`` → rotated ``q [T, H, D]``, ``k [T, KVH, D]`` and ``v [T, KVH, D]``."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)
        return q, k, v.view(t, self.num_kv_heads, self.head_dim)

    def forward(self, x, cos, sin, meta: AttentionMetadata, planes: tuple[torch.Tensor, torch.Tensor]):
        q, k, v = self.project(x, cos, sin)
        write_kv(k, v, planes[0], planes[1], meta.slot_mapping)
        o = paged_attention(q, planes[0], planes[1], meta, self.scale)  # [T, H, D]
        return self.o_proj(o.reshape(x.shape[0], -1))


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): ``down(silu(gate(x)) * up(x))``, gate and up fused in one GEMM."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def fuse_hf_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename an HF Llama state dict to our fused layout (in place, returned).

    ``q_proj``/``k_proj``/``v_proj`` rows are concatenated into ``qkv_proj``
    and ``gate_proj``/``up_proj`` into ``gate_up_proj`` (weights and biases).
    """
    groups = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
    layers = {k.split(".")[2] for k in weights if k.startswith("model.layers.")}
    for i in layers:
        for fused, parts in groups.items():
            for kind in ("weight", "bias"):
                names = [f"model.layers.{i}.{p}.{kind}" for p in parts]
                if all(n in weights for n in names):
                    weights[f"model.layers.{i}.{fused}.{kind}"] = torch.cat([weights.pop(n) for n in names])
    return weights


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, meta, planes):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, planes)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBackbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@MODELS.register("llama")
class LlamaForCausalLM(CausalLM):
    """Llama decoder with an LM head, running over a paged KV cache.

    ``forward(input_ids [T] int64, meta, kv_planes) -> logits [B, vocab]`` (fp32)
    for the last new token of each of the ``B`` sequences in ``meta``.
    """

    config_class = ModelConfig
    """The config type ``config.json`` parses into."""

    uses_moe = False
    """A dense model: its :class:`DecodeOps` have no MoE backend."""

    has_static_decode = True
    """:meth:`decode_static` is the capturable decode step."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaBackbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.ops = DecodeOps.reference()  # the kernels: use_ops() sets the ones resolved at load
        self._decode_workspace: dict = {}  # scratch of the Triton decode kernel, reused by every layer
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_planes: KVPlanes) -> torch.Tensor:
        if self.ops.batch_invariant:
            return self.forward_row_exact(input_ids, meta, kv_planes)
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        cos = self.rope_cos[meta.positions].to(x.dtype)  # [T, D]
        sin = self.rope_sin[meta.positions].to(x.dtype)
        for layer, planes in zip(self.model.layers, kv_planes, strict=True):
            x = layer(x, cos, sin, meta, planes)
        x = self.model.norm(x[meta.last_token_indices.to(x.device)])  # [B, hidden]
        return self.lm_head(x).float()  # [B, vocab]

    def forward_row_exact(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_planes: KVPlanes
                          ) -> torch.Tensor:
        """:meth:`forward` for prompt tokens with ``DecodeOps.batch_invariant`` (``docs/exactness.md``): every
        projection through the prefill family of row-exact GEMMs (:meth:`DecodeOps.prefill_linear`), each
        residual add + RMSNorm one Triton program per row (:meth:`DecodeOps.add_rmsnorm`; torch's reductions
        pick their split from the row count), the Triton prefill attention; elementwise steps in torch.

        Returns:
            ``[B, vocab]`` fp32 logits of each sequence's last new token.
        """
        ops = self.ops
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        t = x.shape[0]
        cos = self.rope_cos[meta.positions].to(x.dtype)  # [T, D]
        sin = self.rope_sin[meta.positions].to(x.dtype)
        m = None  # the MLP output not yet added to the residual stream x
        for layer, (kp, vp) in zip(self.model.layers, kv_planes, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            x, h = ops.add_rmsnorm(x, m, layer.input_layernorm, False)
            qkv = ops.prefill_linear(h, attn.qkv_proj.weight, attn.qkv_proj.bias)
            q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
            q = apply_rope(q.view(t, attn.num_heads, attn.head_dim), cos, sin)  # [T, H, D]
            k = apply_rope(k.view(t, attn.num_kv_heads, attn.head_dim), cos, sin)
            write_kv(k, v.reshape(t, attn.num_kv_heads, attn.head_dim), kp, vp, meta.slot_mapping)
            o = paged_attention(q, kp, vp, meta, attn.scale)  # [T, H, D]
            o = ops.prefill_linear(o.reshape(t, -1), attn.o_proj.weight, attn.o_proj.bias)
            x, h = ops.add_rmsnorm(x, o, layer.post_attention_layernorm, False)
            gate, up = ops.prefill_linear(h, mlp.gate_up_proj.weight).split(mlp.intermediate, dim=-1)
            m = ops.prefill_linear(F.silu(gate) * up, mlp.down_proj.weight)
        _, h = ops.add_rmsnorm(x, m, self.model.norm, False)
        return ops.lm_head(h[meta.last_token_indices.to(h.device)], self.lm_head.weight, prefill=True).float()

    def decode_static(
        self, token: torch.Tensor, position: torch.Tensor, block_table: torch.Tensor, kv_planes: KVPlanes
    ) -> torch.Tensor:
        """One greedy-decode step with static shapes and no host sync (CUDA-graph capturable).

        Per layer on CUDA at batch one in bf16/fp16 (:mod:`replicas.kernels.decode_ops`): residual add +
        RMSNorm + qkv GEMV (1 Triton launch), RoPE + KV write (1), split-K attention (2), o_proj GEMV (1),
        residual add + RMSNorm + gate_up GEMV with the SwiGLU in its epilogue (1), down GEMV (1); the last
        residual add + the final norm (1) before the LM head. Torch references of the same steps elsewhere
        (the same ops as :meth:`forward`). Call it under ``torch.inference_mode()``.

        Args:
            token: ``[B]`` int64, each sequence's pending token (its KV is not yet in the cache).
            position: ``[B]`` int64, its position (= committed KV length); -1 marks a padding row of
                a CUDA-graph batch (Triton kernels only: nothing is written, its logits are garbage).
            block_table: ``[B, max_blocks]`` (or ``[max_blocks]`` for ``B = 1``) int64 page ids.
            kv_planes: per layer ``(key_plane, value_plane)``.

        Returns:
            ``[B, vocab]`` logits for each sequence's next token, in the LM head's dtype (one
            conversion launch fewer per step; callers that sample convert).
        """
        ops = self.ops
        context_len = position + 1
        x = self.model.embed_tokens(token)  # [B, hidden]
        m = None  # the MLP output not yet added to the residual stream x
        for layer, (kp, vp) in zip(self.model.layers, kv_planes, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            x, qkv = ops.add_rmsnorm_linear(x, m, layer.input_layernorm, False, attn.qkv_proj.weight,
                                            attn.qkv_proj.bias)
            q = ops.rope_kv_write(attn, x, self.rope_cos, self.rope_sin, position, block_table, kp, vp,
                                  qkv=qkv)  # [B, H, D]; k and v are in the cache
            o = ops.decode_attention(q, kp, vp, block_table, context_len, attn.scale,
                                     workspace=self._decode_workspace)
            o = ops.linear(o.reshape(x.shape[0], -1), attn.o_proj.weight, attn.o_proj.bias)
            x, g = ops.add_rmsnorm_linear(x, o, layer.post_attention_layernorm, False, mlp.gate_up_proj.weight,
                                          swiglu=True)
            m = ops.linear(g, mlp.down_proj.weight)
        _, h = ops.add_rmsnorm(x, m, self.model.norm, False)
        return ops.lm_head(h, self.lm_head.weight)  # the LM head's dtype: greedy quanta take the argmax as it is

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
        progress: bool = True,
    ) -> LlamaForCausalLM:
        """Build from an HF directory (``config.json`` + safetensors).

        Raises:
            ValueError: missing or unexpected tensors (named in the message).
        """
        cfg = ModelConfig.from_dir(path)
        with torch.device("meta"):
            model = cls(cfg)
        weights = load_safetensors(Path(path), dtype, device, progress=progress)
        if cfg.tie_word_embeddings:
            weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
        fuse_hf_weights(weights)
        expected = set(model.state_dict().keys())
        missing, unexpected = expected - weights.keys(), weights.keys() - expected
        if missing or unexpected:
            raise ValueError(
                f"checkpoint {path} does not match {cfg.model_type}: "
                f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
            )
        model.load_state_dict(weights, strict=True, assign=True)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
        return model.eval()

    @classmethod
    def from_config(
        cls, cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0,
    ) -> LlamaForCausalLM:
        """A model of ``cfg``'s shape with random weights generated on ``device``
        (:func:`replicas.models.dummy.randomize_`); ``load_format=dummy``. Tied embeddings stay tied."""
        from replicas.models.dummy import randomize_

        with torch.device("meta"):
            model = cls(cfg).to(dtype)
        model = model.to_empty(device=device)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        randomize_(model, seed)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
        return model.eval()

    def use_ops(self, ops: DecodeOps) -> LlamaForCausalLM:
        """Run the decode step on ``ops`` (resolved once at load by :func:`replicas.models.registry.load_model`);
        returns ``self``."""
        self.ops = ops
        return self

"""Llama-family decoder over the paged KV cache (SmolLM2, Llama 2/3 without RoPE scaling).

Read top to bottom: RMSNorm → attention (RoPE, paged cache) → SwiGLU MLP →
decoder layer → model. Module names mirror transformers' ``LlamaForCausalLM``
so HF safetensors load with ``load_state_dict``; transformers is our test
reference, not our runtime. Shapes: ``T`` = new tokens in this forward,
``H`` = query heads, ``KVH`` = KV heads, ``D`` = head_dim.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from replicas.kernels.paged_attention import AttentionMetadata, paged_attention, write_kv
from replicas.kernels.static_decode import static_decode_attention, static_slot
from replicas.models.config import ModelConfig
from replicas.models.loader import load_safetensors

KVPlanes = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer ``(key_plane, value_plane)``, each ``[num_blocks, PAGE_SIZE, KVH, D]``."""


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in fp32 like transformers."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


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
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=bias)
        self.scale = cfg.head_dim**-0.5

    def forward(self, x, cos, sin, meta: AttentionMetadata, planes: tuple[torch.Tensor, torch.Tensor]):
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)  # [T, H, D]
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        write_kv(k, v, planes[0], planes[1], meta.slot_mapping)
        o = paged_attention(q, planes[0], planes[1], meta, self.scale)  # [T, H, D]
        return self.o_proj(o.reshape(t, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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


class LlamaForCausalLM(nn.Module):
    """Llama decoder with an LM head, running over a paged KV cache.

    ``forward(input_ids [T] int64, meta, kv_planes) -> logits [B, vocab]`` (fp32)
    for the last new token of each of the ``B`` sequences in ``meta``.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaBackbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_planes: KVPlanes) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        cos = self.rope_cos[meta.positions].to(x.dtype)  # [T, D]
        sin = self.rope_sin[meta.positions].to(x.dtype)
        for layer, planes in zip(self.model.layers, kv_planes, strict=True):
            x = layer(x, cos, sin, meta, planes)
        x = self.model.norm(x[meta.last_token_indices.to(x.device)])  # [B, hidden]
        return self.lm_head(x).float()  # [B, vocab]

    @torch.inference_mode()
    def decode_static(
        self, token: torch.Tensor, position: torch.Tensor, block_table: torch.Tensor, kv_planes: KVPlanes
    ) -> torch.Tensor:
        """One greedy-decode step with static shapes and no host sync (CUDA-graph capturable).

        Args:
            token: ``[1]`` int64, the pending token (its KV is not yet in the cache).
            position: ``[1]`` int64, its position (= committed KV length).
            block_table: ``[max_blocks]`` int64 page ids covering ``position``.
            kv_planes: per layer ``(key_plane, value_plane)``.

        Returns:
            ``[1, vocab]`` fp32 logits for the next token.
        """
        slot = static_slot(block_table, position)
        context_len = position + 1
        x = self.model.embed_tokens(token)  # [1, hidden]
        cos = self.rope_cos[position].to(x.dtype)  # [1, D]
        sin = self.rope_sin[position].to(x.dtype)
        for layer, (kp, vp) in zip(self.model.layers, kv_planes, strict=True):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(1, attn.num_heads, attn.head_dim)
            k = attn.k_proj(h).view(1, attn.num_kv_heads, attn.head_dim)
            v = attn.v_proj(h).view(1, attn.num_kv_heads, attn.head_dim)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            write_kv(k, v, kp, vp, slot)
            o = static_decode_attention(q, kp, vp, block_table, context_len, attn.scale)
            x = x + attn.o_proj(o.reshape(1, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.lm_head(self.model.norm(x)).float()

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

"""Model configuration read from an HF ``config.json``.

Only the fields our forward passes need are kept; everything is validated at
load time so a bad checkpoint fails with a clear message instead of a shape
error deep inside a forward pass.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("llama",)


def eos_token_ids(raw: dict, generation: dict | None = None) -> tuple[int, ...]:
    """EOS ids from ``generation_config.json`` then ``config.json`` (each an int or a list), deduplicated in order."""
    eos: list[int] = []
    for src in (generation or {}, raw):
        value = src.get("eos_token_id")
        for v in value if isinstance(value, list) else [value]:
            if v is not None and int(v) not in eos:
                eos.append(int(v))
    return tuple(eos)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture facts of a decoder-only transformer.

    Attributes:
        model_type: HF ``model_type`` (``"llama"``).
        vocab_size: number of token ids.
        hidden_size: residual width ``d_model``.
        intermediate_size: MLP inner width.
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (GQA: ``num_heads % num_kv_heads == 0``).
        head_dim: per-head width (defaults to ``hidden_size // num_heads``).
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base frequency (Su et al. 2021, "RoFormer").
        max_position_embeddings: longest position the model was trained for.
        tie_word_embeddings: ``lm_head`` shares the embedding matrix.
        attention_bias: q/k/v/o projections carry biases.
        eos_token_ids: end-of-sequence ids from config / generation_config.
        bos_token_id: beginning-of-sequence id, or None.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bos_token_id: int | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` (and ``generation_config.json`` if present).

        Raises:
            FileNotFoundError: no ``config.json`` in ``path``.
            ValueError: unsupported architecture or inconsistent head geometry.
        """
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{path} is not a model directory: config.json is missing")
        raw = json.loads(cfg_file.read_text())
        gen_file = path / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        return cls.from_dict(raw, gen)

    @classmethod
    def from_dict(cls, raw: dict, generation: dict | None = None) -> ModelConfig:
        """Build from parsed ``config.json`` (+ optional ``generation_config.json``) dicts.

        Raises:
            ValueError: unsupported ``model_type`` or bad head geometry.
        """
        model_type = raw.get("model_type", "")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = int(raw["num_attention_heads"])
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        hidden = int(raw["hidden_size"])
        head_dim = int(raw.get("head_dim") or hidden // num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
        rope = raw.get("rope_parameters") or {}
        rope_theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", (raw.get("rope_scaling") or {}).get("rope_type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"unsupported RoPE scaling {rope_type!r} for {model_type}")
        eos = eos_token_ids(raw, generation)
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            eos_token_ids=tuple(eos),
            bos_token_id=raw.get("bos_token_id"),
        )

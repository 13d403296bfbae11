"""GPT-OSS configuration read from an HF ``config.json`` (+ ``generation_config.json``).

Field names and defaults follow transformers' ``GptOssConfig``
(``models/gpt_oss/configuration_gpt_oss.py``); the engine-facing names
(``num_layers``, ``num_heads``, ``num_kv_heads``, ``eos_token_ids``, ...) are
the same as :class:`~replicas.models.config.ModelConfig`'s so the KV cache and
the engine treat both families alike. Everything is validated at load time.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from replicas.models.config import eos_token_ids

MODEL_TYPE = "gpt_oss"
SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)

DEFAULT_ROPE_THETA = 150000.0
"""transformers' ``GptOssConfig.default_theta``."""

DEFAULT_YARN = {
    "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
    "original_max_position_embeddings": 4096,
}
"""RoPE scaling when ``config.json`` names none (transformers' ``GptOssConfig.__post_init__``)."""


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling (Peng et al. 2023, "YaRN", arXiv:2309.00071; transformers' ``_compute_yarn_parameters``).

    Attributes:
        factor: context extension factor ``s`` (GPT-OSS: 32).
        beta_fast: rotations per original context above which a frequency is kept (extrapolated), 32.
        beta_slow: rotations below which a frequency is divided by ``factor`` (interpolated), 1.
        original_max_position_embeddings: pre-training context ``L`` (GPT-OSS: 4096).
        truncate: floor/ceil the ramp bounds to whole dims. transformers defaults it
            to True when the key is absent; GPT-OSS's config.json sets False.
        attention_factor: cos/sin multiplier; ``0.1 * ln(factor) + 1`` when None (YaRN eq. 22).
    """

    factor: float
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position_embeddings: int = 4096
    truncate: bool = True
    attention_factor: float | None = None

    @property
    def mscale(self) -> float:
        """The attention (cos/sin) scaling actually applied."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0


@dataclass(frozen=True)
class GptOssConfig:
    """Architecture facts of a GPT-OSS checkpoint.

    Attributes:
        model_type: ``"gpt_oss"``.
        vocab_size: token ids (201088 for the released models).
        hidden_size: residual width (2880).
        intermediate_size: per-expert inner width (2880).
        num_layers: decoder layers (24 for 20b, 36 for 120b).
        num_heads: query heads (64).
        num_kv_heads: key/value heads (8).
        head_dim: per-head width (64; not ``hidden_size / num_heads``).
        rms_norm_eps: RMSNorm epsilon (1e-5).
        max_position_embeddings: longest position (131072 = 32 x 4096).
        num_experts: experts per layer (HF ``num_local_experts``; 32 or 128).
        experts_per_token: routed experts per token (HF ``num_experts_per_tok``; 4).
        sliding_window: window of ``sliding_attention`` layers in tokens (128);
            position ``p`` attends to keys in ``(p - sliding_window, p]``.
        layer_types: per layer ``"sliding_attention"`` or ``"full_attention"``
            (default: sliding on even layers, full on odd, as transformers).
        rope_theta: RoPE base (150000).
        rope_scaling: YaRN parameters, or None for plain RoPE.
        swiglu_alpha: sigmoid gain of the experts' clamped SwiGLU (1.702).
        swiglu_limit: clamp of that SwiGLU (7.0).
        attention_bias: q/k/v/o carry biases (True).
        tie_word_embeddings: ``lm_head`` shares the embedding (False).
        quant_method: ``config.json`` ``quantization_config.quant_method`` (``"mxfp4"``) or None.
        eos_token_ids: from generation_config.json then config.json, de-duplicated, in order.
        bos_token_id: or None.
        pad_token_id: or None.
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
    max_position_embeddings: int
    num_experts: int
    experts_per_token: int
    sliding_window: int | None
    layer_types: tuple[str, ...]
    rope_theta: float = DEFAULT_ROPE_THETA
    rope_scaling: YarnScaling | None = None
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_bias: bool = True
    tie_word_embeddings: bool = False
    quant_method: str | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bos_token_id: int | None = None
    pad_token_id: int | None = None

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` in tokens, or None for full attention."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    @classmethod
    def from_dir(cls, path: str | Path) -> GptOssConfig:
        """Read ``config.json`` (and ``generation_config.json`` if present).

        Raises:
            FileNotFoundError: no ``config.json`` in ``path``.
            ValueError: not a GPT-OSS config, or inconsistent fields (named).
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
    def from_dict(cls, raw: dict, generation: dict | None = None) -> GptOssConfig:
        """Build from parsed ``config.json`` (+ ``generation_config.json``) dicts.

        RoPE comes from ``rope_parameters`` (transformers >= 5) or
        ``rope_scaling`` (the released checkpoints) with ``rope_theta`` inside
        it or at the top level.

        Raises:
            ValueError: wrong ``model_type``, unsupported RoPE or quantization,
                bad head geometry or ``layer_types`` (the message names the field).
        """
        if raw.get("model_type") != MODEL_TYPE:
            raise ValueError(f"model_type {raw.get('model_type')!r} is not {MODEL_TYPE!r}")
        num_layers = int(raw["num_hidden_layers"])
        num_heads = int(raw["num_attention_heads"])
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        hidden = int(raw["hidden_size"])
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
        layer_types = tuple(raw.get("layer_types") or (SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)))
        if len(layer_types) != num_layers or any(t not in LAYER_TYPES for t in layer_types):
            raise ValueError(f"layer_types must list {num_layers} entries from {LAYER_TYPES}, got {list(layer_types)}")
        sliding_window = raw.get("sliding_window", 128)
        if SLIDING in layer_types and not (isinstance(sliding_window, int) and sliding_window >= 1):
            raise ValueError(f"sliding_window must be a positive int for sliding layers, got {sliding_window!r}")
        theta, scaling = _rope(raw)
        quant = raw.get("quantization_config") or {}
        quant_method = quant.get("quant_method")
        if quant_method not in (None, "mxfp4"):
            raise ValueError(f"quantization_config.quant_method {quant_method!r} is not supported (only mxfp4)")
        top_k = int(raw.get("num_experts_per_tok") or raw.get("experts_per_token") or 4)
        num_experts = int(raw.get("num_local_experts") or raw.get("num_experts"))
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_local_experts={num_experts}]")
        eos = eos_token_ids(raw, generation)
        return cls(
            model_type=MODEL_TYPE,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 131072)),
            num_experts=num_experts,
            experts_per_token=top_k,
            sliding_window=sliding_window,
            layer_types=layer_types,
            rope_theta=theta,
            rope_scaling=scaling,
            swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
            attention_bias=bool(raw.get("attention_bias", True)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            quant_method=quant_method,
            eos_token_ids=tuple(eos),
            bos_token_id=raw.get("bos_token_id"),
            pad_token_id=raw.get("pad_token_id"),
        )


def _rope(raw: dict) -> tuple[float, YarnScaling | None]:
    """``(rope_theta, YaRN scaling or None)`` from ``rope_parameters`` or ``rope_scaling``."""
    given = raw.get("rope_parameters") or raw.get("rope_scaling")
    rope = dict(given) if given else dict(DEFAULT_YARN)
    theta = float(rope.get("rope_theta", raw.get("rope_theta", DEFAULT_ROPE_THETA)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise ValueError(f"unsupported RoPE scaling {rope_type!r} for gpt_oss (yarn or default)")
    if rope.get("mscale") or rope.get("mscale_all_dim"):
        raise ValueError("YaRN mscale/mscale_all_dim are not used by GPT-OSS and not supported")
    max_pos = int(raw.get("max_position_embeddings", 131072))
    original = int(rope.get("original_max_position_embeddings") or max_pos)
    factor = rope.get("factor")
    return theta, YarnScaling(
        factor=float(factor) if factor is not None else max_pos / original,
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
        original_max_position_embeddings=original,
        truncate=bool(rope.get("truncate", True)),
        attention_factor=rope.get("attention_factor"),
    )

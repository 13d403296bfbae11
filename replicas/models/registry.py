"""Pick the model class for a checkpoint directory by its ``config.json`` ``model_type``.

Every model class offers ``from_pretrained(path, dtype, device, progress)``, a
``config`` with at least ``model_type``, ``vocab_size``, ``num_layers``,
``num_kv_heads``, ``head_dim``, ``max_position_embeddings`` and
``eos_token_ids``, and ``forward(input_ids [T], meta, kv_planes) -> [B, vocab]``
fp32 logits over the paged KV cache.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch

MODEL_CLASSES: dict[str, str] = {
    "llama": "replicas.models.llama:LlamaForCausalLM",
    "gpt_oss": "replicas.models.gpt_oss:GptOssForCausalLM",
}
"""``model_type`` → ``module:Class``."""


def model_class(path: str | Path):
    """The class that serves the checkpoint at ``path``.

    Raises:
        FileNotFoundError: no ``config.json``.
        ValueError: a ``model_type`` we do not serve.
    """
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        raise FileNotFoundError(f"{path} is not a model directory: config.json is missing")
    model_type = json.loads(cfg.read_text()).get("model_type", "")
    if model_type not in MODEL_CLASSES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(MODEL_CLASSES))}")
    module, name = MODEL_CLASSES[model_type].split(":")
    return getattr(importlib.import_module(module), name)


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device | str, progress: bool = True):
    """Build the right model class for ``path`` and load its weights."""
    return model_class(path).from_pretrained(path, dtype=dtype, device=device, progress=progress)

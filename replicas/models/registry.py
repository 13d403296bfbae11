"""Pick the model class for a checkpoint directory by its ``config.json`` ``model_type``, load it, and
give it the kernels resolved for this device.

Every model class is a :class:`~replicas.models.base.CausalLM` registered in
:data:`~replicas.models.base.MODELS` by its own file (imported on the registry's first lookup); the
protocol (methods, config fields, capabilities) is in that class's docstring and is checked once here, at
load (:func:`~replicas.models.base.check_model`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from replicas.kernels.decode_ops import DecodeOps
from replicas.models.base import MODELS, check_model


def __getattr__(name: str):
    if name == "MODEL_TYPES":  # the ``config.json`` ``model_type`` values we serve
        return MODELS.names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    if model_type not in MODELS:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(MODELS.names())}")
    return MODELS.get(model_type)


def model_config(path: str | Path):
    """The parsed ``config.json`` of ``path`` in its model class's config type."""
    cls = model_class(path)
    return cls.config_class.from_dir(path)


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device | str, progress: bool = True,
               load_format: str = "auto", seed: int = 0, *, pdl: bool = True, moe_backend: str = "auto",
               moe_repack: bool = True, moe_tiles: dict[str, int] | None = None, prefill_kernels: bool = True,
               batch_invariant: bool = False):
    """Build the model class for ``path``, load its weights (``load_format`` ``auto``) or generate random ones
    from its ``config.json`` (``dummy``, seeded by ``seed``), then give it its kernels, resolved once here
    (:meth:`~replicas.kernels.decode_ops.DecodeOps.build` with the engine config's ``pdl`` and, for models
    with experts, ``moe_backend``, ``moe_repack`` and ``moe_tiles``; ``prefill_kernels``; ``batch_invariant``).

    Raises:
        FileNotFoundError: no ``config.json``.
        ValueError: an unsupported architecture, a mismatched checkpoint, or an unknown ``load_format``.
        TypeError: the model class does not implement :class:`~replicas.models.base.CausalLM`'s protocol.
        replicas.kernels.moe.MoEBackendError: the MoE backend cannot run on this device.
    """
    cls = model_class(path)
    if load_format == "auto":
        model = cls.from_pretrained(path, dtype=dtype, device=device, progress=progress)
    elif load_format == "dummy":
        model = cls.from_config(cls.config_class.from_dir(path), dtype=dtype, device=device, seed=seed)
    else:
        raise ValueError(f"unknown load_format {load_format!r}; choose auto or dummy")
    ops = DecodeOps.build(device, dtype, pdl=pdl, moe_backend=moe_backend if cls.uses_moe else None,
                          moe_repack=moe_repack, moe_tiles=moe_tiles, prefill_kernels=prefill_kernels,
                          batch_invariant=batch_invariant)
    return check_model(model.use_ops(ops))

"""Load a Triton kernel wrapper lazily, hidden from ``torch.compile``; None where Triton is missing."""

from __future__ import annotations

import importlib

import torch

_CACHE: dict[tuple[str, str], object] = {}


def lazy_kernel(module: str, name: str):
    """``module.name`` wrapped in ``torch.compiler.disable`` (it runs inside our CUDA graphs, not Inductor's),
    or None when the module cannot be imported (no Triton). Imported once per process."""
    key = (module, name)
    if key not in _CACHE:
        try:
            fn = getattr(importlib.import_module(module), name)
        except ImportError:
            _CACHE[key] = None
        else:
            _CACHE[key] = torch.compiler.disable(fn)
    return _CACHE[key]

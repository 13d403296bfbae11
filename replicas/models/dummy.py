"""Random weights for ``load_format=dummy``: a model built from its ``config.json`` alone.

What vLLM calls ``--load-format dummy``: benchmarks and GPU runs of the GPT-OSS shapes need no 60 GB
checkpoint. Everything is generated on the model's device (gpt-oss-120b: ~65 GB, nothing on the host),
from a seeded generator, so two builds with the same seed hold the same weights.
"""

from __future__ import annotations

import torch
from torch import nn

DENSE_STD = 0.02
"""Standard deviation of dense weights (transformers' ``initializer_range`` default for both families)."""

SCALE_CODES = (118, 124)
"""E8M0 scale codes of random MXFP4 experts, ``[low, high)``: scales 2**-9 .. 2**-4, so element magnitudes
reach 6 * 2**-4, like trained GPT-OSS experts."""


@torch.no_grad()
def randomize_(model: nn.Module, seed: int = 0) -> nn.Module:
    """Fill ``model``'s parameters and buffers in place, on their device: packed MXFP4 ``*_blocks`` with
    random bytes and ``*_scales`` with codes in :data:`SCALE_CODES`, norm weights with 1, attention sinks
    ``N(0, 1)``, every other floating tensor ``N(0, DENSE_STD)``; ``rope_*`` tables are left alone.
    Returns ``model``."""
    device = next(iter(model.parameters())).device
    gen = torch.Generator(device).manual_seed(seed)
    seen: set[int] = set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) in seen or name.startswith("rope_"):
            continue  # tied weights are filled once
        seen.add(id(t))
        if name.endswith("_blocks"):
            t.random_(0, 256, generator=gen)
        elif name.endswith("_scales"):
            t.random_(*SCALE_CODES, generator=gen)
        elif "norm" in name:
            t.fill_(1.0)
        elif name.endswith("sinks"):
            t.normal_(0.0, 1.0, generator=gen)
        elif t.is_floating_point():
            t.normal_(0.0, DENSE_STD, generator=gen)
    return model

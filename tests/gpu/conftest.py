"""Helpers of the GPU tests: engine cores built as a replica builds them, with random weights."""

from __future__ import annotations

import tempfile

import torch

from ops.tools.model_shapes import write_config_dir


def dummy_core(shape: str | dict, dtype: torch.dtype = torch.float32, max_model_len: int = 512, **overrides):
    """:meth:`replicas.engine.EngineCore.load` with ``load_format=dummy`` over ``shape`` (a name of
    :mod:`ops.tools.model_shapes` or a ``config.json`` dict) on the GPU; ``overrides`` are engine config
    fields. The KV cache holds two ``max_model_len`` sequences; prefix caching is off."""
    from replicas.config import EngineConfig
    from replicas.engine import EngineCore

    directory = write_config_dir(shape, tempfile.mkdtemp(prefix="dummy-model-"))
    settings = {"device": "cuda", "dtype": str(dtype).removeprefix("torch."), "max_model_len": max_model_len,
                "num_kv_blocks": 2 * -(-max_model_len // 16) + 8, "enable_prefix_caching": False,
                "progress": False, **overrides}
    return EngineCore.load(EngineConfig(model=str(directory), load_format="dummy", **settings))


def prompts_for(core, n: int, seed: int = 7) -> list[list[int]]:
    """``n`` random prompts in ``core``'s vocabulary (:func:`ops.tools.fixtures.random_prompts`)."""
    from ops.tools.fixtures import random_prompts

    return random_prompts(core.model.config.vocab_size, n, seed)


def standard_tokens(core, prompts: list[list[int]], tokens: int = 128, budget: int = 4096) -> list[list[int]]:
    """:func:`ops.tools.fixtures.standard_greedy`."""
    from ops.tools.fixtures import standard_greedy

    return standard_greedy(core, prompts, tokens, budget)


def persistent_tokens(core, prompts: list[list[int]], tokens: int = 128) -> list[list[int]]:
    """:func:`ops.tools.fixtures.persistent_greedy` (``cuda_graph`` quanta on the GPU)."""
    from ops.tools.fixtures import persistent_greedy

    return persistent_greedy(core, prompts, tokens)

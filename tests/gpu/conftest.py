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
    """``n`` random prompts of 20..299 token ids in ``core``'s vocabulary."""
    g = torch.Generator().manual_seed(seed)
    vocab = core.model.config.vocab_size
    return [torch.randint(3, vocab, (int(k),), generator=g).tolist() for k in torch.randint(20, 300, (n,), generator=g)]


def standard_tokens(core, prompts: list[list[int]], tokens: int = 128, budget: int = 4096) -> list[list[int]]:
    """Greedy tokens of ``prompts`` all added at once to one standard-lane engine (chunked prefill under
    ``budget`` tokens per step, mixed with decodes); asserts every KV page came back."""
    from replicas.engine import LLMEngine
    from replicas.request import SamplingParams
    from replicas.scheduler import SchedulerConfig

    engine = LLMEngine(core, SchedulerConfig(256, budget, True))
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, params)
    out: dict[str, list[int]] = {f"s{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for ch in engine.step():
            out[ch.request_id] += ch.token_ids
    assert core.allocator.num_used == 0
    return [out[f"s{i}"] for i in range(len(prompts))]


def persistent_tokens(core, prompts: list[list[int]], tokens: int = 128) -> list[list[int]]:
    """Greedy tokens of ``prompts`` one at a time on the persistent lane (``cuda_graph`` quanta)."""
    from replicas.messages import GenerateRequest
    from replicas.persistent.cuda_graph import CudaGraphBackend
    from replicas.persistent.lane import PersistentLane
    from replicas.request import SamplingParams

    lane = PersistentLane(core, CudaGraphBackend(core.model, torch.device("cuda"), core.config.max_model_len))
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    out = [[t for ch in lane.generate(GenerateRequest(f"p{i}", p, params)) for t in ch.token_ids]
           for i, p in enumerate(prompts)]
    assert core.allocator.num_used == 0
    return out

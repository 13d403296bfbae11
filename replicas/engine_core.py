"""The engine core: what both lanes of a replica share (model, tokenizer, KV cache, page allocator, model
runner), loaded and assembled in one place.

The standard lane (:class:`replicas.engine.LLMEngine`) and the persistent lane
(:class:`replicas.persistent.lane.PersistentLane`) each run over one core; a co-located engine actor runs
both over the same one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replicas.config import EngineConfig
from replicas.kernels.paged_attention import PAGE_SIZE
from replicas.kv_cache import KVCache, PageAllocator
from replicas.model_runner import ModelRunner
from replicas.models.loader import resolve_model
from replicas.models.registry import load_model
from replicas.structured_output import GrammarCompiler


@dataclass
class EngineCore:
    """What both lanes of a replica share: model, tokenizer, KV cache and its pages."""

    config: EngineConfig
    model: torch.nn.Module
    tokenizer: object
    kv_cache: KVCache
    allocator: PageAllocator
    runner: ModelRunner
    eos_token_ids: frozenset[int]
    _grammars: GrammarCompiler | None = None

    @property
    def grammars(self) -> GrammarCompiler:
        """Structured outputs' grammar compiler over this tokenizer (built at first use)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer)
        return self._grammars

    @classmethod
    def load(cls, config: EngineConfig, enable_prefix_caching: bool | None = None) -> EngineCore:
        """Resolve (and convert once) the model, load its weights (or random ones with ``load_format=dummy``),
        resolve its kernels, then :meth:`build`. ``enable_prefix_caching`` overrides
        ``config.enable_prefix_caching`` (a persistent replica turns it off for the mk1 backend, as MK1
        requires).

        Raises:
            ModelNotFoundError: the model cannot be found.
            ValueError: unsupported architecture, mismatched checkpoint, or ``max_model_len`` beyond the
                model's positions.
            replicas.kernels.moe.MoEBackendError: ``moe_backend`` cannot run on this device.
        """
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        device, dtype = config.resolved_device(), config.resolved_dtype()
        path = resolve_model(config.model, progress=config.progress)
        model = load_model(path, dtype=dtype, device=device, progress=config.progress,
                           load_format=config.load_format, **config.kernel_options())
        return cls.build(config, model, load_tokenizer(path, required=config.load_format != "dummy"),
                         enable_prefix_caching=enable_prefix_caching)

    @classmethod
    def build(cls, config: EngineConfig, model: torch.nn.Module, tokenizer=None,
              enable_prefix_caching: bool | None = None, eos_token_ids: frozenset[int] | None = None) -> EngineCore:
        """The one place an engine core is assembled: the KV cache for ``model`` (``num_kv_blocks`` pages of
        ``config``), its page allocator, and the model runner with the standard lane's decode graphs
        (:func:`decode_graphs`).

        Args:
            config: the engine settings (device, dtype, cache size, prefix caching, graphs).
            model: a loaded model (:func:`replicas.models.registry.load_model`).
            tokenizer: the model's tokenizer; None: token ids only (:class:`NullTokenizer`).
            enable_prefix_caching: overrides ``config.enable_prefix_caching``.
            eos_token_ids: overrides the model's and the tokenizer's EOS ids.

        Raises:
            ValueError: ``max_model_len`` exceeds the model's ``max_position_embeddings``.
        """
        if config.max_model_len > model.config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's "
                f"max_position_embeddings={model.config.max_position_embeddings}"
            )
        if enable_prefix_caching is None:
            enable_prefix_caching = config.enable_prefix_caching
        tokenizer = tokenizer if tokenizer is not None else NullTokenizer()
        if eos_token_ids is None:
            eos = set(model.config.eos_token_ids)
            if getattr(tokenizer, "eos_token_id", None) is not None:
                eos.add(int(tokenizer.eos_token_id))
            eos_token_ids = frozenset(eos)
        device = config.resolved_device()
        kv = KVCache(model.config, config.resolved_num_kv_blocks(), config.resolved_dtype(), device)
        return cls(
            config=config, model=model, tokenizer=tokenizer, kv_cache=kv,
            allocator=PageAllocator(kv.num_blocks, enable_prefix_caching=enable_prefix_caching),
            runner=ModelRunner(model, kv.planes(), device, graphs=decode_graphs(config, model, kv, device),
                               inputs=step_inputs(config, device),
                               kernels=model.ops.prefill_kernels, batch_invariant=model.ops.batch_invariant),
            eos_token_ids=eos_token_ids,
        )

    def describe_kernels(self) -> dict:
        """What runs the model here, resolved at load (``/debug/stats``, span attributes): the decode ops'
        kernels and MoE backend, and whether the standard lane replays decode graphs."""
        out = self.model.ops.describe()
        out["decode_graphs"] = list(self.runner.graphs.batch_sizes) if self.runner.graphs is not None else []
        return out

    def validate_prompt(self, prompt_token_ids: list[int], max_tokens: int) -> None:
        """Raise ``ValueError`` naming the limits if the prompt cannot run here."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.config.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens; this model's context is {self.config.max_model_len} tokens "
                "(prompt + at least 1 output token must fit)"
            )
        vocab = self.model.config.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")


class NullTokenizer:
    """The tokenizer of an engine that serves token ids only (a ``load_format=dummy`` model directory
    without tokenizer files, benchmarks): no EOS id, and every id decodes to the empty string."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""


def load_tokenizer(path, required: bool = True):
    """transformers' tokenizer of the model directory ``path``; with ``required`` False, None when the
    directory has no tokenizer files.

    Raises:
        OSError: no tokenizer at ``path`` (and ``required``)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not required and not any((Path(path) / f).is_file() for f in files):
        return None
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        if required:
            raise
        return None



def decode_graphs(config: EngineConfig, model, kv, device):
    """The standard lane's per-bucket decode CUDA graphs for this engine, or None (CPU, ``enforce_eager``,
    or a model without a static decode step). Buckets above ``max_num_seqs`` are not kept."""
    if torch.device(device).type != "cuda" or config.enforce_eager or not model.has_static_decode:
        return None
    from replicas.decode_graphs import DecodeGraphs

    sizes = tuple(b for b in config.cuda_graph_batch_sizes if b <= config.max_num_seqs) or (1,)
    graphs = DecodeGraphs(model, kv.planes(), device, config.max_model_len, sizes)
    return graphs if graphs.batch_sizes else None


def step_inputs(config: EngineConfig, device):
    """The model runner's persistent step buffers (:class:`~replicas.step_inputs.StepInputs`) for this engine:
    block tables as wide as ``max_model_len`` (the decode graphs' width), rows for twice ``max_num_seqs``."""
    from replicas.step_inputs import StepInputs

    return StepInputs(device, -(-config.max_model_len // PAGE_SIZE), max_rows=2 * config.max_num_seqs + 8)

"""The standard lane's engine: continuous batching over the replica's KV cache.

``step()`` reads as schedule → run → postprocess (nano-vllm style). The
:class:`EngineCore` (model, tokenizer, KV cache, page allocator, runner) is
shared with the persistent lane, which lives in ``replicas/persistent/``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replicas.config import EngineConfig
from replicas.detokenizer import IncrementalDetokenizer
from replicas.kv_cache import KVCache, PageAllocator
from replicas.messages import GenerationChunk
from replicas.model_runner import ModelRunner
from replicas.models.llama import LlamaForCausalLM
from replicas.models.loader import resolve_model
from replicas.request import FinishReason, Request, SamplingParams
from replicas.sampler import make_generator, sample
from replicas.scheduler import Scheduler, SchedulerConfig
from replicas.stops import check_stop


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

    @classmethod
    def load(cls, config: EngineConfig) -> EngineCore:
        """Resolve (and convert once) the model, load weights, allocate the KV cache.

        Raises:
            ModelNotFoundError: the model cannot be found.
            ValueError: unsupported architecture or mismatched checkpoint.
        """
        from transformers import AutoTokenizer

        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        device, dtype = config.resolved_device(), config.resolved_dtype()
        path = resolve_model(config.model, progress=config.progress)
        model = LlamaForCausalLM.from_pretrained(path, dtype=dtype, device=device, progress=config.progress)
        if config.max_model_len > model.config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's "
                f"max_position_embeddings={model.config.max_position_embeddings}"
            )
        tokenizer = AutoTokenizer.from_pretrained(path)
        eos = set(model.config.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        kv = KVCache(model.config, config.resolved_num_kv_blocks(), dtype, device)
        return cls(
            config=config, model=model, tokenizer=tokenizer, kv_cache=kv,
            allocator=PageAllocator(kv.num_blocks), runner=ModelRunner(model, kv.planes(), device),
            eos_token_ids=frozenset(eos),
        )

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


class _Tracked:
    """Per-request bookkeeping of the standard engine."""

    __slots__ = ("req", "detok", "generator", "sent_tokens")

    def __init__(self, req: Request, detok: IncrementalDetokenizer, generator):
        self.req, self.detok, self.generator, self.sent_tokens = req, detok, generator, 0


class LLMEngine:
    """Continuous-batching engine (the standard lane)."""

    lane = "standard"

    def __init__(self, core: EngineCore, scheduler_config: SchedulerConfig | None = None):
        cfg = core.config
        self.core = core
        self.scheduler = Scheduler(
            scheduler_config or SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens), core.allocator
        )
        self._tracked: dict[str, _Tracked] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request. Raises ``ValueError`` for a bad prompt or a duplicate id."""
        if request_id in self._tracked:
            raise ValueError(f"duplicate request id {request_id}")
        self.core.validate_prompt(prompt_token_ids, params.max_tokens)
        req = Request(request_id, list(prompt_token_ids), params)
        detok = IncrementalDetokenizer(self.core.tokenizer, params.stop)
        self._tracked[request_id] = _Tracked(req, detok, make_generator(params, self.core.runner.device))
        self.scheduler.add(req)

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its pages; False if it is unknown or already done."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return False
        self.scheduler.finish(tracked.req)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[GenerationChunk]:
        """One engine iteration; returns a chunk per request that produced a token."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        logits = self.core.runner.execute(batch)
        tracked = [self._tracked[r.request_id] for r, _ in batch]
        tokens = sample(logits, [t.req.params for t in tracked], [t.generator for t in tracked])
        return [self._postprocess(t, n, tok) for t, (_, n), tok in zip(tracked, batch, tokens, strict=True)]

    def _postprocess(self, t: _Tracked, num_new: int, token: int) -> GenerationChunk:
        req = t.req
        req.num_computed_tokens += num_new
        req.output_token_ids.append(token)
        finish = check_stop(req, self.core.eos_token_ids, self.core.config.max_model_len)
        text = t.detok.append([token], final=finish is not None)
        if t.detok.stopped_on is not None:
            finish = FinishReason.STOP
        chunk = GenerationChunk(
            request_id=req.request_id, token_ids=[token], text=text,
            finish_reason=finish.value if finish else None,
            num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens, lane=self.lane,
        )
        if finish is not None:
            self.scheduler.finish(req)
            del self._tracked[req.request_id]
        return chunk

    def stats(self) -> dict:
        a = self.core.allocator
        return {
            "lane": self.lane, "kv_pages_total": a.num_blocks, "kv_pages_free": a.num_free,
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
        }

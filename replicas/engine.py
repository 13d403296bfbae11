"""The standard lane's engine: continuous batching over the replica's KV cache.

``step()`` reads as schedule → run → postprocess (nano-vllm style). The
:class:`EngineCore` (model, tokenizer, KV cache, page allocator, runner) is
shared with the persistent lane, which lives in ``replicas/persistent/``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from replicas.config import EngineConfig
from replicas.detokenizer import IncrementalDetokenizer
from replicas.kernels.paged_attention import PAGE_SIZE
from replicas.kv_cache import KVCache, PageAllocator
from replicas.messages import GenerationChunk, TokenLogprobs
from replicas.model_runner import ModelRunner
from replicas.models.loader import resolve_model
from replicas.models.registry import load_model
from replicas.request import Request, SamplingParams
from replicas.sampler import (
    SamplingRow,
    make_generator,
    prompt_token_logprobs,
    sample_rows,
)
from replicas.scheduler import Scheduler, SchedulerConfig
from replicas.stops import accept_tokens, stop_token_set
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


class _Tracked:
    """Per-sequence bookkeeping of the standard engine (one per choice of an ``n > 1`` request)."""

    __slots__ = ("req", "parent_id", "detok", "generator", "constraint")

    def __init__(self, req: Request, parent_id: str, detok: IncrementalDetokenizer, generator, constraint=None):
        self.req, self.parent_id, self.detok, self.generator = req, parent_id, detok, generator
        self.constraint = constraint  # a structured output's TokenConstraint, or None


class LLMEngine:
    """Continuous-batching engine (the standard lane).

    ``add_request`` takes a request id and its ``n`` completions run as ``n``
    sequences (ids ``<id>#<i>``) sharing the prompt's pages through the prefix
    cache; chunks come back under the request id with ``index = i``.
    """

    lane = "standard"

    def __init__(self, core: EngineCore, scheduler_config: SchedulerConfig | None = None, on_scheduled=None):
        """``on_scheduled(request_id)``, if given, is called (engine thread) for every sequence of
        ``request_id`` in every scheduled batch (a prefix-cache hit may start a request with computed
        tokens, so "first schedule" is the first call). The engine actor turns the first call into
        the queue-time metric."""
        cfg = core.config
        self.on_scheduled = on_scheduled
        self.core = core
        self.scheduler = Scheduler(
            scheduler_config or SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.enable_chunked_prefill),
            core.allocator,
        )
        self._tracked: dict[str, _Tracked] = {}
        self._children: dict[str, list[str]] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request (``params.n`` sequences).

        Raises:
            ValueError: a bad prompt, a duplicate id, or a structured output whose grammar does not compile.
        """
        if request_id in self._children:
            raise ValueError(f"duplicate request id {request_id}")
        self.core.validate_prompt(prompt_token_ids, params.max_tokens)
        spec = params.structured_output
        constraints = [self.core.grammars.constraint(spec) if spec else None for _ in range(params.n)]
        leader = None
        children = []
        for i in range(params.n):
            p = params if params.n == 1 else replace(
                params, n=1, seed=None if params.seed is None else params.seed + i
            )
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(seq_id, list(prompt_token_ids), p, index=i, leader=leader)
            if p.prompt_logprobs is not None:
                req.prompt_logprobs = [None]  # nothing predicts the first prompt token
            if leader is None and params.n > 1 and self.core.allocator.enable_prefix_caching:
                leader = req
            detok = IncrementalDetokenizer(self.core.tokenizer, p.stop, p.include_stop_str_in_output)
            self._tracked[seq_id] = _Tracked(req, request_id, detok, make_generator(p, self.core.runner.device),
                                             constraints[i])
            children.append(seq_id)
            self.scheduler.add(req)
        self._children[request_id] = children

    def abort(self, request_id: str) -> bool:
        """Drop a request (all its sequences) and free its pages; False if it is unknown or already done."""
        children = self._children.pop(request_id, None)
        if children is None:
            return False
        for seq_id in children:
            tracked = self._tracked.pop(seq_id, None)
            if tracked is not None:
                self.scheduler.finish(tracked.req)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[GenerationChunk]:
        """One iteration: schedule → run → postprocess. Returns a chunk per sequence that produced a token."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        if self.on_scheduled is not None:
            for req, _ in batch:
                self.on_scheduled(self._tracked[req.request_id].parent_id)
        want = [req.needs_prompt_logits and req.num_computed_tokens < req.num_prompt_tokens for req, _ in batch]
        if any(want):
            logits, prompt_rows = self.core.runner.execute_with_prompt_logits(batch, want)
        else:
            logits, prompt_rows = self.core.runner.execute(batch), None
        rows, sampled = [], []
        for i, (req, n) in enumerate(batch):
            if prompt_rows is not None and prompt_rows[i] is not None:
                self._record_prompt_logprobs(req, req.num_computed_tokens, prompt_rows[i])
            self.scheduler.commit_computed(req, n)
            if req.num_computed_tokens == req.num_tokens:  # prompt done (or decoding): sample
                sampled.append(i)
                rows.append(self._sampling_row(self._tracked[req.request_id]))
        if not sampled:
            return []
        out = sample_rows(logits if len(sampled) == len(batch) else logits[sampled], rows)  # pure decode: no gather
        chunks = []
        for j, i in enumerate(sampled):
            tracked = self._tracked[batch[i][0].request_id]
            chunks.append(self._postprocess(tracked, out.token_ids[j], out.logprobs[j]))
        return chunks

    @staticmethod
    def _record_prompt_logprobs(req: Request, start: int, logits: torch.Tensor) -> None:
        """Add the prompt logprobs a chunk's logits give: row ``j`` (position ``start + j``) predicts the prompt
        token at ``start + j + 1``. Positions already recorded (before a preemption) are not added again;
        the prompt's last position predicts the first output token (sampled, not a prompt logprob)."""
        have = len(req.prompt_logprobs)
        first, stop = max(have, start + 1), min(start + logits.shape[0], req.num_prompt_tokens - 1) + 1
        if first >= stop:
            return
        rows = logits[first - 1 - start: stop - 1 - start]
        req.prompt_logprobs.extend(prompt_token_logprobs(rows, req.prompt_token_ids[first:stop],
                                                         req.params.prompt_logprobs))

    def _sampling_row(self, t: _Tracked) -> SamplingRow:
        req, p = t.req, t.req.params
        # min_tokens: every id that would end the request is banned until then (vLLM's rule)
        banned = stop_token_set(p, self.core.eos_token_ids) if req.num_output_tokens < p.min_tokens else frozenset()
        mask = None
        if t.constraint is not None:
            mask = t.constraint.allowed(self.core.model.config.vocab_size, self.core.runner.device)
        return SamplingRow(p, t.generator, req.prompt_token_ids, req.output_token_ids, banned, mask)

    def _postprocess(self, t: _Tracked, token: int, logprobs: TokenLogprobs | None) -> GenerationChunk:
        req = t.req
        if t.constraint is not None:
            t.constraint.accept(token)
        accepted = accept_tokens(req, t.detok, [token], self.core.eos_token_ids, self.core.config.max_model_len)
        finish, text = accepted.finish, accepted.text
        chunk = GenerationChunk(
            request_id=t.parent_id, token_ids=[token], text=text,
            finish_reason=finish.value if finish else None,
            num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens, lane=self.lane,
            index=req.index, logprobs=[logprobs] if logprobs is not None else None,
            prompt_logprobs=req.prompt_logprobs if req.num_output_tokens == 1 else None,
        )
        if finish is not None:
            self.scheduler.finish(req)
            del self._tracked[req.request_id]
            siblings = self._children.get(t.parent_id, [])
            if all(s not in self._tracked for s in siblings):
                self._children.pop(t.parent_id, None)
        return chunk

    def warm_up(self, capture_graphs: bool = True, lengths: tuple[int, ...] = (16, 100, 128, 1024),
                batch: int = 8, batch_len: int = 256, new_tokens: int = 4) -> dict:
        """Run the kernels once before serving: capture every decode-graph bucket (largest first, with
        ``capture_graphs``), then greedy throwaway requests of random token ids (seeded): one step of each of
        ``lengths`` prompt tokens, then ``batch`` prompts of ``batch_len`` tokens at once, ``new_tokens`` each.
        Their Triton kernels compile and their graphs replay here instead of inside the first requests.
        A model with ``warm_up_prompt_lengths(max_tokens)`` (GPT-OSS: one token count per M-block height of its
        grouped MoE GEMMs, each height its own compiled kernel) adds its counts, up to the most tokens one step
        takes (``max_num_batched_tokens``): a served burst's step packs several prompts, more tokens than any
        one prompt has. A count longer than one prompt may be (``max_model_len``, half the KV pool) is split
        over several prompts added together, which the scheduler prefills in one step. Counts are capped to
        what one step (``max_num_batched_tokens``, ``max_num_seqs`` prompts) and half the KV pool hold; 100 is
        not a multiple of 16. Call it while the engine holds no request.

        Returns ``{"graphs_failed": [...], "prompts": n, "seconds": s}``.

        Raises:
            RuntimeError: the engine holds requests.
        """
        import time

        if self.has_unfinished():
            raise RuntimeError("warm_up needs an idle engine")
        start = time.perf_counter()
        graphs = self.core.runner.graphs
        failed = graphs.capture_all() if graphs is not None and capture_graphs else []
        cfg, alloc = self.core.config, self.core.allocator
        vocab = self.core.model.config.vocab_size
        sched = self.scheduler.config
        pool = alloc.num_blocks * PAGE_SIZE // 2
        longest = max(1, min(cfg.max_model_len - new_tokens, pool))  # one prompt
        step = max(1, min(sched.max_num_batched_tokens, pool, sched.max_num_seqs * longest))  # one step's
        # the token counts that reach each of the model's kernel variants (none for most models)
        lengths = (*lengths, *self.core.model.warm_up_prompt_lengths(step))
        rounds = []
        for n in dict.fromkeys(min(n, step) for n in lengths):  # capped, duplicates once
            k = -(-n // longest)  # prompts sharing the step (at most max_num_seqs: step caps n)
            rounds.append([n // k + (i < n % k) for i in range(k)])
        rounds.append([min(batch_len, max(1, longest // batch))] * batch)
        generator = torch.Generator().manual_seed(0)
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        count = 0
        for r, sizes in enumerate(rounds):
            for i, n in enumerate(sizes):
                prompt = torch.randint(0, vocab, (n,), generator=generator).tolist()
                self.add_request(f"warmup-{r}-{i}", prompt, params)
                count += 1
            while self.has_unfinished():
                self.step()
        if self.core.runner.device.type == "cuda":
            torch.cuda.synchronize(self.core.runner.device)
        return {"graphs_failed": failed, "prompts": count, "seconds": round(time.perf_counter() - start, 3)}

    def pages_in_use(self) -> int:
        """Distinct KV pages the requests of this engine hold (a page shared by prefix caching counts once)."""
        pages: set[int] = set()
        for t in list(self._tracked.values()):
            pages.update(t.req.block_table)
        return len(pages)

    def stats(self) -> dict:
        a = self.core.allocator
        return {
            "lane": self.lane, "kv_pages_total": a.num_blocks, "kv_pages_free": a.num_free,
            "kv_pages_cached": a.num_cached, "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting), "num_preemptions": self.scheduler.num_preemptions,
        }


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

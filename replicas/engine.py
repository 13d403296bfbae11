"""The standard lane's engine: continuous batching over the replica's KV cache.

``step()`` reads as schedule → run → postprocess (nano-vllm style). The
:class:`~replicas.engine_core.EngineCore` (model, tokenizer, KV cache, page
allocator, runner) lives in ``replicas/engine_core.py`` and is shared with the
persistent lane (``replicas/persistent/``); it is re-exported here for the
importers that predate the split.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from replicas.engine_core import (  # noqa: F401 - re-exported: EngineCore's importers from before the split
    EngineCore,
    NullTokenizer,
    decode_graphs,
    load_tokenizer,
    step_inputs,
)
from replicas.kernels.paged_attention import PAGE_SIZE
from replicas.messages import GenerationChunk, TokenLogprobs
from replicas.request import Request, SamplingParams
from replicas.sampler import (
    SamplingRow,
    make_generator,
    prompt_token_logprobs,
    sample_rows,
)
from replicas.scheduler import Scheduler, SchedulerConfig
from replicas.stops import accept_tokens, stop_token_set


class _Tracked:
    """Per-sequence bookkeeping of the standard engine (one per choice of an ``n > 1`` request)."""

    __slots__ = ("req", "parent_id", "generator", "constraint")

    def __init__(self, req: Request, parent_id: str, generator, constraint=None):
        self.req, self.parent_id, self.generator = req, parent_id, generator
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
        self.tokens_generated = 0  # output tokens sampled (a reader may cut some later, at a stop string)
        # EngineConfig.blocking_sync: one reusable event; the wait sleeps (cudaEventBlockingSync) and drops the GIL
        self._forward_done = (torch.cuda.Event(blocking=True)
                              if cfg.blocking_sync and core.runner.device.type == "cuda" else None)

    def _wait_for_device(self) -> None:
        """Sleep until the step's forward and picks are done (``EngineConfig.blocking_sync``): called by the
        sampler after it queued the picks, so the picks run right behind the forward, not after the wake-up."""
        self._forward_done.record()
        self._forward_done.synchronize()

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
            self._tracked[seq_id] = _Tracked(req, request_id, make_generator(p, self.core.runner.device),
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

    @property
    def blocking_sync(self) -> bool:
        """The engine waits for each forward on a blocking event (``EngineConfig.blocking_sync`` on a GPU)."""
        return self._forward_done is not None

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
        out = sample_rows(logits if len(sampled) == len(batch) else logits[sampled], rows,  # pure decode: no gather
                          before_read=self._wait_for_device if self._forward_done is not None else None)
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
        finish = accept_tokens(req, [token], self.core.eos_token_ids, self.core.config.max_model_len).finish
        self.tokens_generated += 1
        chunk = GenerationChunk(  # token ids only: text and stop strings are the reader's (replicas.output_processor)
            request_id=t.parent_id, token_ids=[token],
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
            "tokens_generated": self.tokens_generated,
        }

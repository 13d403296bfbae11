"""The standard lane's engine: continuous batching over the replica's KV cache.

``step()`` reads as schedule → run → postprocess (nano-vllm style); with
``EngineConfig.async_scheduling`` a decode step is launched before the previous
step's tokens are read (:meth:`LLMEngine._plan_ahead` says when). The
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
from replicas.kv_cache import pages_for
from replicas.messages import GenerationChunk, TokenLogprobs
from replicas.request import Request, SamplingParams
from replicas.sampler import (
    QueuedPicks,
    SamplingRow,
    device_index,
    make_generator,
    prompt_token_logprobs,
    queue_picks,
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


class _InFlight:
    """A step launched and not read yet (async scheduling): its sequences, every one sampled in it, in batch
    order, and their queued picks."""

    __slots__ = ("rows", "picks")

    def __init__(self, rows: list[_Tracked], picks: QueuedPicks):
        self.rows, self.picks = rows, picks


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
        self.async_scheduling = cfg.async_scheduling
        self._inflight: _InFlight | None = None  # async scheduling: the step launched and not read yet

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
        """Drop a request (all its sequences) and free its pages; False if it is unknown or already done.

        A step in flight for it (async scheduling) still runs on the device and writes its KV into the
        freed pages; any step that reuses them is queued behind it on the same stream, so it sees them
        after that write. The step's pick for it is dropped when read: no chunk follows the abort. A step in
        flight with no live row left is forgotten at once (nothing of it will be read), so aborting every
        request leaves ``has_unfinished()`` False, as without async scheduling."""
        children = self._children.pop(request_id, None)
        if children is None:
            return False
        for seq_id in children:
            tracked = self._tracked.pop(seq_id, None)
            if tracked is not None:
                self.scheduler.finish(tracked.req)
        held = self._inflight
        if held is not None and not any(self._tracked.get(t.req.request_id) is t for t in held.rows):
            self._inflight = None
        return True

    @property
    def blocking_sync(self) -> bool:
        """The engine waits for each forward on a blocking event (``EngineConfig.blocking_sync`` on a GPU)."""
        return self._forward_done is not None

    def has_unfinished(self) -> bool:
        """Whether a request waits or runs, or a step is in flight (its tokens not returned yet)."""
        return self.scheduler.num_unfinished > 0 or self._inflight is not None

    def step(self) -> list[GenerationChunk]:
        """One iteration; returns a chunk per sequence that produced a token (the chunks of one step, or
        with async scheduling possibly of two: the step read, then one scheduled after a drain).

        Synchronous (``EngineConfig.async_scheduling`` off): schedule → run → sample → postprocess.

        With ``async_scheduling``: if a step is in flight and :meth:`_plan_ahead` allows, the next decode step
        is launched first (its input tokens gathered on the device from the in-flight picks), then the
        in-flight picks are read and postprocessed, and their chunks returned; the new step stays in
        flight. Otherwise the in-flight step (if any) is read first, then this call schedules as the
        synchronous step does, and leaves that step in flight instead of reading it when its rows may run
        ahead (:meth:`_leave_in_flight`). A call with nothing new to schedule still reads and returns the
        step in flight, so steps until ``has_unfinished()`` is False return every chunk.

        Raises:
            ValueError: a row bans the whole vocabulary (from the sampler).
        """
        chunks: list[GenerationChunk] = []
        prev, self._inflight = self._inflight, None
        if prev is not None:
            plan = self._plan_ahead(prev)
            if plan is not None:
                self._inflight = self._launch_ahead(prev, plan)
            chunks = self._collect(prev)
            if self._inflight is not None:
                return chunks
        batch = self.scheduler.schedule()
        if not batch:
            return chunks
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
            return chunks
        if self.async_scheduling and prompt_rows is None and len(sampled) == len(batch):
            seqs = [self._tracked[req.request_id] for req, _ in batch]
            if self._leave_in_flight(seqs):
                self._inflight = _InFlight(seqs, queue_picks(logits, rows, blocking=self.blocking_sync))
                return chunks
        out = sample_rows(logits if len(sampled) == len(batch) else logits[sampled], rows,  # pure decode: no gather
                          before_read=self._wait_for_device if self._forward_done is not None else None)
        for j, i in enumerate(sampled):
            tracked = self._tracked[batch[i][0].request_id]
            chunks.append(self._postprocess(tracked, out.token_ids[j], out.logprobs[j]))
        return chunks

    # ---- async scheduling ------------------------------------------------------------------------------
    def _ends_by_length(self, req: Request) -> bool:
        """The token being picked for ``req`` (not read yet) will end it by ``max_tokens`` or ``max_model_len``."""
        return (req.num_output_tokens + 1 >= req.params.max_tokens
                or req.num_tokens + 1 >= self.core.config.max_model_len)

    @staticmethod
    def _runs_ahead(t: _Tracked) -> bool:
        """``t``'s next pick needs no host state that the token being picked (not read yet) changes."""
        p = t.req.params
        return not p.has_penalties and t.constraint is None and t.req.num_output_tokens + 1 >= p.min_tokens

    def _leave_in_flight(self, seqs: list[_Tracked]) -> bool:
        """Whether a step just launched synchronously, every row of it sampled and none with prompt logits,
        is left in flight rather than read now: some row will continue after it and every such row may
        run ahead (:meth:`_plan_ahead`'s per-row conditions)."""
        ahead = [t for t in seqs if not self._ends_by_length(t.req)]
        return bool(ahead) and all(self._runs_ahead(t) for t in ahead)

    def _plan_ahead(self, prev: _InFlight) -> list[tuple[int, _Tracked]] | None:
        """The async-scheduling rule, in one place: the sequences of the step launched before ``prev``'s
        picks are read, or None to read ``prev`` first and take the synchronous path.

        The step ahead is the batch the scheduler would build once ``prev`` is read, less the rows ``prev``
        ends: every running sequence feeds the token ``prev`` is picking for it, one token each, in the
        scheduler's running order. So it is None (synchronous) when:

        * a request waits (a new one, an ``n > 1`` sibling waiting for its leader's prompt, a preempted
          one): the scheduler would admit prompt rows;
        * a running sequence is not a row of ``prev`` (a prompt chunk still to run, or a decode the step's
          limits left out);
        * a row that continues uses a repetition, presence or frequency penalty (they count the token
          history on the host), a structured output (the grammar's next mask needs the newest token
          accepted on the host), or is under ``min_tokens`` even with the token being picked (the ban
          depends on the count). Prompt logprobs never reach here: a step that records them is read at once;
        * the pages for one more token of every row that continues are not all free (the scheduler would
          preempt, which only the synchronous path does);
        * no row continues.

        A row whose pending token ends it by length (``max_tokens``, ``max_model_len``) is left out of the
        step ahead, never launched speculatively. One whose pending token is an EOS or stop id cannot be
        told apart before the read: it runs ahead, and :meth:`_collect` frees its pages and drops its result;
        the other rows' results stand. With row-exact kernels (``batch_invariant`` on a GPU) they are the
        synchronous path's bit for bit; otherwise a row's logits move in their last bits with the rows beside
        it, as they do whenever a request joins or leaves a step (docs/decisions/0031-async-scheduling.md).
        Greedy and temperature / top-k / top-p / min-p rows run ahead; a seeded row's generator advances on
        the device in launch order, so its draws are those of the synchronous path.

        Returns:
            ``(index of the sequence in prev.rows, sequence)`` per row of the step ahead, in running order.
        """
        if self.scheduler.waiting:
            return None
        where = {id(t.req): j for j, t in enumerate(prev.rows) if self._tracked.get(t.req.request_id) is t}
        plan: list[tuple[int, _Tracked]] = []
        pages = 0
        for req in self.scheduler.running:
            j = where.get(id(req))
            if j is None:
                return None
            if self._ends_by_length(req):
                continue
            t = prev.rows[j]
            if not self._runs_ahead(t):
                return None
            pages += max(0, pages_for(req.num_computed_tokens + 1) - len(req.block_table))
            plan.append((j, t))
        if not plan or pages > self.core.allocator.num_free:
            return None
        return plan

    def _launch_ahead(self, prev: _InFlight, plan: list[tuple[int, _Tracked]]) -> _InFlight:
        """Launch the step :meth:`_plan_ahead` planned: pages grown for one more token per row, positions,
        slots and block tables from the host (each row is one token further than the host has read), the
        input tokens gathered on the device from ``prev``'s picks; forward and picks queued, nothing read."""
        batch = []
        for _, t in plan:
            self.core.allocator.grow(t.req.block_table, t.req.num_computed_tokens + 1)
            batch.append((t.req, 1))
        tokens = prev.picks.tokens
        index = [j for j, _ in plan]
        if index != list(range(len(prev.rows))):
            tokens = tokens.index_select(0, device_index(index, tokens.device))
        if self.on_scheduled is not None:
            for _, t in plan:
                self.on_scheduled(t.parent_id)
        logits = self.core.runner.execute(batch, input_tokens=tokens)
        for req, _ in batch:
            self.scheduler.commit_computed(req, 1)  # a page the pending token completes is registered on read
        rows = [self._sampling_row(t, pending=1) for _, t in plan]
        return _InFlight([t for _, t in plan], queue_picks(logits, rows, blocking=self.blocking_sync))

    def _collect(self, prev: _InFlight) -> list[GenerationChunk]:
        """Read ``prev``'s picks and postprocess them (stops, finish, chunks). A sequence aborted since the
        launch gets no chunk. A sequence that ends here may also be a row of the step now in flight: that
        row's result is dropped when read, and its pages are freed here already; a later step that takes
        them is queued after the in-flight one on the same CUDA stream, so its reads and writes come after
        the in-flight step's KV writes (the same holds on the CPU, where steps run one after the other).
        If every row of the step in flight has ended, it is forgotten (nothing of it will be read)."""
        out = prev.picks.read()
        chunks = []
        for j, t in enumerate(prev.rows):
            if self._tracked.get(t.req.request_id) is not t:
                continue  # aborted while in flight
            chunks.append(self._postprocess(t, out.token_ids[j], out.logprobs[j]))
        ahead = self._inflight
        if ahead is not None:
            live = sum(self._tracked.get(t.req.request_id) is t for t in ahead.rows)
            if live == 0:
                self._inflight = None
        for t in prev.rows:
            if self._tracked.get(t.req.request_id) is t:
                self.scheduler.commit_computed(t.req, 0)  # the page the token just read completed, if any
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

    def _sampling_row(self, t: _Tracked, pending: int = 0) -> SamplingRow:
        """``t``'s row for the sampler; ``pending``: its tokens picked and not read yet (they count for
        ``min_tokens``)."""
        req, p = t.req, t.req.params
        # min_tokens: every id that would end the request is banned until then (vLLM's rule)
        banned = (stop_token_set(p, self.core.eos_token_ids) if req.num_output_tokens + pending < p.min_tokens
                  else frozenset())
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

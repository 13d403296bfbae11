"""The persistent lane: one greedy request at a time, decoded in quanta.

The lane is stepped like :class:`~replicas.engine.LLMEngine` (the engine actor's one loop drives it):
:meth:`PersistentLane.add` runs admission (``policy``) and reserves the prompt pages (with prefix caching:
the longest cached prefix's pages are shared, so only the rest of the prompt is prefilled); each
:meth:`PersistentLane.step` advances the request by one item: the prefill with the engine's model runner
(the first token), then one quantum per step (size it with ``policy.quantum_size``, reserve its pages,
launch, collect, validate, accept its tokens on the host, stream it as one chunk); the step whose item ends
the request frees the pages; :meth:`PersistentLane.abort` drops the request in any phase. The
per-request state is a :class:`PersistentRequestState`.

With a :class:`PipelinedBackend` (``cuda_graph``) and ``EngineConfig.pipeline_quanta`` (pipeline depth 1,
chosen once at construction; otherwise depth 0: each quantum launched and collected in its step) the next
quantum is sized,
given its pages and launched *before* the current one is read, as if the
current one emits all its tokens; it starts from the token and position the
current one leaves on the device. When the current quantum ends the request
(or stops early) the follower is discarded; a follower the backend refuses
before launch is simply not queued, and the next quantum launches on its own.

Prefix caching (the engine core's :class:`~replicas.kv_cache.PageAllocator`
has it on, and the backend ``takes_cached_pages``): the prompt's full pages are
looked up by their chained hashes (:func:`~replicas.kv_cache.page_hashes`, the
standard lane's scheme), leaving at least one token to prefill (its logits give
the first token); after the prefill the prompt's full pages are registered, and
when the request ends without a failure after launch, the pages its decode
filled too (positions below the committed KV length), so the next turn of a
conversation finds the whole previous exchange cached. Cached pages are only
read: every write of the request lands at positions at or past its prompt.

Errors: a rejection before anything ran is a :class:`Rejection` (the router
falls back to the standard lane). A :class:`PrelaunchError` on a later quantum
(not on a follower) leaves the cache untouched, so the request continues on the
reference decode path in this replica and the chunk carries ``fallback_reason``. A
:class:`BackendLaunchError` (or an invalid result) is terminal for the request
and marks the decoder unhealthy (:func:`classify_failure` names the reason).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from policy import check_admission, quantum_size
from replicas.engine_core import EngineCore
from replicas.kernels.paged_attention import PAGE_SIZE
from replicas.kv_cache import page_hashes, pages_for
from replicas.messages import GenerateRequest, GenerationChunk, GenerationError, Rejection
from replicas.output_processor import OutputProcessor
from replicas.persistent.contract import (
    BackendLaunchError,
    CacheBinding,
    PersistentBackend,
    PipelinedBackend,
    PrelaunchError,
    QuantumRequest,
    validate_result,
)
from replicas.persistent.eager import EagerBackend
from replicas.request import FinishReason, Request
from replicas.sampler import SamplingRow, sample_rows
from replicas.stops import accept_tokens, stop_token_set

LANE = "persistent"

Item = GenerationChunk | Rejection | GenerationError


def classify_failure(exc: BaseException) -> str:
    """The one classification of a failure after a native launch (a launch, a collection, a follower's launch,
    an invalid result, a failed discard): the exception's contract ``reason`` (``backend_launch_error``,
    ``invalid_quantum_result``, ...), or ``backend_launch_error`` for any other exception. The decoder is marked
    unhealthy with this reason and the request's :class:`GenerationError` carries it."""
    return getattr(exc, "reason", None) or BackendLaunchError.reason


class Phase(enum.Enum):
    """Where a persistent request is: its prompt pages reserved and the prefill not run yet (``PREFILL``),
    decoding quanta (``DECODE``), or over (``DONE``: its pages are back in the pool)."""

    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


@dataclass
class PersistentRequestState:
    """One persistent request's state between two :meth:`PersistentLane.step` calls.

    ``req`` holds the tokens, the pages (``block_table``) and ``num_computed_tokens`` (the KV written below
    it). ``ahead`` is a quantum launched behind the one being read (pipelined lanes only) with its launch
    time in ns. ``fallback`` is the reason the request left the backend for the reference decode path
    (a :class:`PrelaunchError` on a quantum), reported once on the chunk of that quantum. ``clean`` is False
    once a failure after launch may have written anything into the cache: then none of its pages are
    registered in the prefix cache.
    """

    req: Request
    cancel: threading.Event | None = None
    telemetry: object | None = None
    phase: Phase = Phase.PREFILL
    fallback: str | None = None
    fallback_reported: bool = False
    ahead: tuple[QuantumRequest, int] | None = None
    clean: bool = True

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()


class PersistentLane:
    """Runs requests through a persistent backend bound to ``core``'s KV cache, one at a time, step by step
    (as :class:`~replicas.engine.LLMEngine`): :meth:`add` admits a request, each :meth:`step` advances it by
    one item (its prefill, or one quantum) and returns what it streams, :meth:`abort` drops it.

    How a quantum step runs is chosen once here (as vLLM binds ``step_fn``): pipeline depth 1 on a
    :class:`PipelinedBackend` with ``EngineConfig.pipeline_quanta`` (launch the next quantum, then collect
    this one), depth 0 otherwise (launch and collect one quantum).

    Args:
        core: the replica's engine core (model, KV cache, pages).
        backend: a bound-on-construction backend, or None when it failed to load.
        load_error: why the backend is missing (reported as unhealthy).

    Raises:
        PersistentDecoderError: the backend cannot bind the KV cache.
    """

    def __init__(self, core: EngineCore, backend: PersistentBackend | None, load_error: str | None = None):
        self.core = core
        self.backend = backend
        self.unhealthy_reason: str | None = load_error if backend is None else None
        self._current: PersistentRequestState | None = None
        self._reference: EagerBackend | None = None
        self.quanta_run = 0
        self.tokens_generated = 0  # output tokens taken in the engine (a reader may cut some later)
        self.min_tokens_recomputes = 0
        """Positions recomputed on the host because the device's argmax took an id ``min_tokens`` bans there."""
        self.prefix_hit_tokens = 0
        """Prompt tokens served from the prefix cache, summed over requests."""
        self.pipeline_depth = 1 if core.config.pipeline_quanta and isinstance(backend, PipelinedBackend) else 0
        """Quanta launched behind the one being read: 1 (pipelined) or 0 (synchronous), fixed at load."""
        self._quantum_step = self._step_pipelined if self.pipeline_depth else self._step_synchronous
        if backend is not None:
            backend.bind_cache(CacheBinding.from_kv_tensor(core.kv_cache.tensor))

    @property
    def healthy(self) -> bool:
        return self.unhealthy_reason is None

    @property
    def busy(self) -> bool:
        """Whether a request holds the lane (admitted and not over)."""
        return self._current is not None

    def has_unfinished(self) -> bool:
        """Whether :meth:`step` has work (a request admitted and not over)."""
        return self._current is not None

    @property
    def current_request_id(self) -> str | None:
        return self._current.request_id if self._current is not None else None

    def _admission(self, request: GenerateRequest) -> str | None:
        reason = check_admission(request.admission_input(
            self.core.config.max_model_len, queued_requests=1 if self.busy else 0))
        if reason is not None:
            return reason.value
        if self.backend is None:
            return "unsupported_envelope"
        if not self.healthy:
            return "decoder_unhealthy"
        return None

    # --- the step API ------------------------------------------------------------------------------

    def add(self, request: GenerateRequest, cancel: threading.Event | None = None,
            telemetry=None) -> Rejection | GenerationError | None:
        """Admit ``request`` and reserve its prompt pages; its outputs then come from :meth:`step`.

        Args:
            request: the request.
            cancel: set by the caller to end the request with an ``abort`` chunk before its next quantum (and
                handed to the backend as the quantum's ``cancellation_flag``).
            telemetry: optional ``ops.telemetry.engine_telemetry.RequestTelemetry``, told when the prefill
                starts (``scheduled()``) and about every quantum (``quantum(...)``).

        Returns:
            None when the request is admitted; otherwise its only output, and nothing was taken: a
            :class:`GenerationError` (``invalid_request``) for a prompt that cannot run here, or a
            prelaunch :class:`Rejection` (an admission reason, ``queued_work`` while another request holds
            the lane, ``persistent_capacity`` when the prompt's pages are not free).
        """
        try:
            self.core.validate_prompt(request.prompt_token_ids, request.params.max_tokens)
        except ValueError as exc:
            return GenerationError(request.request_id, str(exc), LANE, stage="validation", reason="invalid_request")
        reason = self._admission(request)
        if reason is not None:
            detail = (self.unhealthy_reason or "") if reason in ("unsupported_envelope", "decoder_unhealthy") else ""
            return Rejection(request.request_id, reason, lane=LANE, detail=detail)
        req = Request(request.request_id, list(request.prompt_token_ids), request.params)
        if not self._reserve_prompt(req):
            return Rejection(req.request_id, "persistent_capacity", lane=LANE, detail="no free KV pages for the prompt")
        self.prefix_hit_tokens += req.num_cached_tokens
        self._current = PersistentRequestState(req, cancel, telemetry)
        return None

    def step(self) -> list[Item]:
        """Advance the current request by one item: its prefill (the first token), or one quantum (a chunk
        of up to 8 tokens; an ``abort`` chunk when its cancel flag is set), or its end with an error.

        Returns:
            The items to stream, in order (empty when no request is current). When the last item ends the
            request (a chunk with a ``finish_reason`` or a :class:`GenerationError`), the request is already
            over: a pipelined follower discarded, its pages registered (unless a failure after launch) and
            back in the pool.
        """
        s = self._current
        if s is None:
            return []
        out = self._prefill(s) if s.phase is Phase.PREFILL else self._decode(s)
        if out and _is_last(out[-1]):
            self._finish(s)
        return out

    def abort(self, request_id: str) -> bool:
        """Drop the current request if it is ``request_id`` (its caller went away), whatever its phase: a
        follower in flight is discarded and its pages go back. Nothing is streamed. False if it is not current."""
        s = self._current
        if s is None or s.request_id != request_id:
            return False
        self._finish(s)
        return True

    def generate(
        self, request: GenerateRequest, cancel: threading.Event | None = None, telemetry=None
    ) -> Iterator[Item]:
        """Serve one request to the end, built on :meth:`add` and :meth:`step` (benchmarks and tests; the engine
        actor steps the lane itself). Yields a Rejection, or chunks, or chunks then an error; the chunks carry
        their text, made as the served path's reader makes it (:class:`~replicas.output_processor.OutputProcessor`
        over the engine's tokenizer), and a stop string ends the request as it does there (an abort).
        Closing the generator early aborts the request (its pages go back)."""
        refused = self.add(request, cancel, telemetry)
        if refused is not None:
            yield refused
            return
        processor = OutputProcessor(self.core.tokenizer, request.params)
        done = False
        try:
            while not done:
                for item in self.step():
                    done = done or _is_last(item)
                    if isinstance(item, GenerationChunk):
                        item = processor.process(item)
                        if item is None:
                            continue
                    yield item
                    if processor.finished:
                        return
        finally:
            if not done:
                self.abort(request.request_id)

    # --- one step ------------------------------------------------------------------------------------

    def _prefill(self, s: PersistentRequestState) -> list[Item]:
        """Prefill what the prefix cache did not hold and pick the first token."""
        req = s.req
        if s.telemetry is not None:
            s.telemetry.scheduled()
        try:
            logits = self.core.runner.execute([(req, req.num_prompt_tokens - req.num_computed_tokens)])
        except Exception as exc:  # noqa: BLE001 - reported to the client, replica stays up
            s.clean = False
            return [GenerationError(req.request_id, f"prefill failed: {exc}", LANE, stage="prefill",
                                    reason="prefill_error")]
        req.num_computed_tokens = req.num_prompt_tokens
        self._register_pages(req, req.num_prompt_tokens)
        s.phase = Phase.DECODE
        return [self._emit(req, [self._pick(req, logits)])]

    def _decode(self, s: PersistentRequestState) -> list[Item]:
        """One quantum of the request (or its ``abort`` chunk when cancelled)."""
        if s.cancelled:
            return [self._chunk(s.req, [], FinishReason.ABORT)]
        return self._quantum_step(s)

    def _step_synchronous(self, s: PersistentRequestState) -> list[Item]:
        """Depth 0: reserve, run one quantum (launch and collect), accept its tokens. A prelaunch rejection
        moves the request to the reference decode path and runs the quantum there."""
        while True:
            backend = self._reference if s.fallback else self.backend
            quantum_request = self._reserve(s.req, s.req.num_computed_tokens, s.req.remaining_output_tokens,
                                            s.req.output_token_ids[-1], s.cancel)
            if quantum_request is None:
                return [self._out_of_pages(s)]
            start_ns = time.time_ns()
            try:
                result = backend.run_quantum(quantum_request)
            except PrelaunchError as exc:
                refused = self._rejected_before_launch(s, backend, quantum_request, exc, start_ns)
                if refused is not None:
                    return [refused]
                continue
            except Exception as exc:  # noqa: BLE001 - failed after launch: terminal
                return [self._terminal(s, backend, quantum_request, exc, start_ns)]
            return self._accept(s, backend, quantum_request, result, start_ns)

    def _step_pipelined(self, s: PersistentRequestState) -> list[Item]:
        """Depth 1: launch this quantum (unless it already runs as the previous one's follower), launch the
        next behind it, collect this one, accept its tokens. After a fallback the reference path runs
        synchronously."""
        if s.fallback:
            return self._step_synchronous(s)
        backend = self.backend
        if s.ahead is not None:
            (quantum_request, start_ns), s.ahead = s.ahead, None
        else:
            quantum_request = self._reserve(s.req, s.req.num_computed_tokens, s.req.remaining_output_tokens,
                                            s.req.output_token_ids[-1], s.cancel)
            if quantum_request is None:
                return [self._out_of_pages(s)]
            start_ns = time.time_ns()
            try:
                backend.launch_quantum(quantum_request)
            except PrelaunchError as exc:
                refused = self._rejected_before_launch(s, backend, quantum_request, exc, start_ns)
                return [refused] if refused is not None else self._step_synchronous(s)
            except Exception as exc:  # noqa: BLE001 - failed after launch: terminal
                return [self._terminal(s, backend, quantum_request, exc, start_ns)]
        try:
            s.ahead = self._launch_follower(s.req, backend, quantum_request, s.cancel)
            result = backend.collect_quantum()
        except Exception as exc:  # noqa: BLE001 - the follower's launch or this collection failed: terminal
            return [self._terminal(s, backend, quantum_request, exc, start_ns)]
        return self._accept(s, backend, quantum_request, result, start_ns)

    def _accept(self, s: PersistentRequestState, backend: PersistentBackend, quantum_request: QuantumRequest,
                result, start_ns: int) -> list[Item]:
        """Validate a collected quantum, then take its tokens through the host checks into one chunk (a
        ``min_tokens`` ban inside it recomputed on the host); a follower that started from a wrong guess is
        discarded."""
        req = s.req
        try:
            validate_result(quantum_request, result)
        except Exception as exc:  # noqa: BLE001
            return [self._terminal(s, backend, quantum_request, exc, start_ns)]
        if s.telemetry is not None:
            s.telemetry.quantum(quantum_request.max_tokens, len(result.emitted_tokens), result.finish_reason,
                                start_ns, time.time_ns(), backend=backend.name)
        self.quanta_run += 1
        banned_at = self._min_tokens_ban_index(req, result.emitted_tokens)
        if banned_at is not None:  # the device's argmax took a stop id that min_tokens bans there
            if s.ahead is not None:
                backend.discard_quanta()  # it started from the banned token
                s.ahead = None
            try:
                chunk = self._emit_with_ban(req, result.emitted_tokens[:banned_at],
                                            quantum_request.committed_kv_length + banned_at)
            except Exception as exc:  # noqa: BLE001 - a host forward failed; the decoder is fine
                s.clean = False
                return [GenerationError(req.request_id, f"decode step failed: {exc}", LANE, stage="decode",
                                        reason="engine_error")]
        else:
            req.num_computed_tokens = result.committed_kv_length
            if s.ahead is not None and s.ahead[0].committed_kv_length != result.committed_kv_length:
                backend.discard_quanta()  # this quantum stopped early: the follower started from a wrong guess
                s.ahead = None
            if s.ahead is not None:  # it started from this result's last token
                s.ahead = (replace(s.ahead[0], pending_token=result.pending_token), s.ahead[1])
            chunk = self._emit(req, result.emitted_tokens)
        if s.fallback and not s.fallback_reported:
            chunk.fallback_reason, s.fallback_reported = s.fallback, True
        return [chunk]

    def _rejected_before_launch(self, s: PersistentRequestState, backend: PersistentBackend,
                                quantum_request: QuantumRequest, exc: PrelaunchError,
                                start_ns: int) -> GenerationError | None:
        """A quantum refused before launch (the cache untouched): the request continues on the reference
        decode path (None: retry the quantum there), or, when the reference refused too, ends with an error."""
        if s.telemetry is not None:
            s.telemetry.quantum(quantum_request.max_tokens, 0, None, start_ns, time.time_ns(),
                                backend=backend.name, error=exc.reason)
        if s.fallback:  # the reference path rejected too: nothing more to try
            return GenerationError(s.request_id, str(exc), LANE, stage="prelaunch", reason=exc.reason)
        s.fallback = exc.reason
        if self._reference is None:
            self._reference = EagerBackend(self.core.model, self.core.runner.device)
            self._reference.bind_cache(CacheBinding.from_kv_tensor(self.core.kv_cache.tensor))
        return None

    def _out_of_pages(self, s: PersistentRequestState) -> GenerationError:
        return GenerationError(s.request_id, "out of KV pages mid-request", LANE, stage="prelaunch",
                               reason="persistent_capacity")

    def _finish(self, s: PersistentRequestState) -> None:
        """End ``s``: discard a follower still on the device (a failure there marks the decoder unhealthy),
        register its valid pages (no failure after launch), free every page, free the lane."""
        if isinstance(self.backend, PipelinedBackend):
            try:
                self.backend.discard_quanta()  # a follower still running: before its pages are freed
            except Exception as exc:  # noqa: BLE001 - the device failed: no more quanta on this decoder
                self.unhealthy_reason = classify_failure(exc)
        s.ahead = None
        req = s.req
        try:
            if s.clean and req.block_table:
                self._register_pages(req, min(req.num_computed_tokens, req.num_tokens))
        finally:
            self.core.allocator.release(req.block_table)
            s.phase = Phase.DONE
            if self._current is s:
                self._current = None

    @property
    def prefix_caching(self) -> bool:
        """Whether requests share prefix-cached pages here (the allocator's prefix cache is on and the backend
        takes cached pages)."""
        return self.core.allocator.enable_prefix_caching and (
            self.backend is None or getattr(self.backend, "takes_cached_pages", True))

    def _reserve_prompt(self, req: Request) -> bool:
        """Give ``req`` pages for its prompt: the longest cached prefix shared (at least one token left to
        prefill), the rest fresh; sets ``num_computed_tokens`` to the cached length. False (nothing taken)
        when the pages are not there."""
        alloc = self.core.allocator
        hits, hashes = [], []
        if self.prefix_caching:
            usable = (req.num_prompt_tokens - 1) // PAGE_SIZE
            hashes = page_hashes(req.prompt_token_ids[: usable * PAGE_SIZE])
            hits = alloc.match_prefix(hashes)
        need = pages_for(req.num_prompt_tokens) - len(hits)
        if not alloc.can_share_and_allocate(hits, need):
            return False
        alloc.share(hits)
        req.block_table = list(hits) + alloc.allocate(need)
        req.num_computed_tokens = req.num_cached_tokens = len(hits) * PAGE_SIZE
        req.page_hashes = hashes[: len(hits)]
        return True

    def _register_pages(self, req: Request, valid: int) -> None:
        """Register ``req``'s full pages below position ``valid`` (their KV written) in the prefix cache."""
        if not self.prefix_caching:
            return
        full = min(valid // PAGE_SIZE, len(req.block_table))
        if full <= len(req.page_hashes):
            return
        parent = req.page_hashes[-1] if req.page_hashes else None
        new = page_hashes(req.all_token_ids[: full * PAGE_SIZE], start=len(req.page_hashes), parent=parent)
        for i, h in enumerate(new, start=len(req.page_hashes)):
            self.core.allocator.register(req.block_table[i], h)
        req.page_hashes.extend(new)

    def _reserve(self, req: Request, committed: int, remaining: int, pending: int, cancel) -> QuantumRequest | None:
        """Size the quantum that starts at ``committed`` with ``remaining`` tokens to go, reserve its pages,
        and build its request; None when the pages are not there."""
        core = self.core
        # The host checks every emitted token against the whole stop set (stops.accept_tokens) and cuts the
        # output at the first stop, so a backend that stops on one id only (mk1) still runs full quanta: it
        # may decode past another stop id, and those tokens are dropped like the rest of a cut quantum.
        size = quantum_size(remaining, core.config.max_model_len, committed)
        if not core.allocator.can_grow(req.block_table, committed + size):
            return None
        core.allocator.grow(req.block_table, committed + size)
        return self._quantum_request(req, pending, committed, size, cancel)

    def _launch_follower(self, req: Request, backend: PipelinedBackend, quantum_request: QuantumRequest,
                         cancel) -> tuple[QuantumRequest, int] | None:
        """Queue the quantum after ``quantum_request`` (still running) as if ``quantum_request`` emits all its tokens; None when
        nothing would follow (the request ends with ``quantum_request``, pages are short, or the backend refuses before
        launch: the next quantum then launches on its own once ``quantum_request`` is read).

        Raises:
            BackendLaunchError: the follower's launch failed (terminal for the request).
        """
        remaining = req.remaining_output_tokens - quantum_request.max_tokens
        committed = quantum_request.committed_kv_length + quantum_request.max_tokens
        if remaining <= 0 or committed >= self.core.config.max_model_len - 1:
            return None
        if cancel is not None and cancel.is_set():
            return None
        nxt = self._reserve(req, committed, remaining, quantum_request.pending_token, cancel)
        if nxt is None:
            return None
        start_ns = time.time_ns()
        try:
            backend.launch_quantum(nxt, True)
        except PrelaunchError:
            return None  # run it unchained once this one is read (it may fall back then)
        return nxt, start_ns

    def _terminal(self, s: PersistentRequestState, backend: PersistentBackend, quantum_request: QuantumRequest,
                  exc: Exception, start_ns: int) -> GenerationError:
        """A failure after launch (or an invalid result): the decoder is marked unhealthy (reason from
        :func:`classify_failure`), the request ends; none of its pages will be registered."""
        reason = classify_failure(exc)
        if s.telemetry is not None:
            s.telemetry.quantum(quantum_request.max_tokens, 0, None, start_ns, time.time_ns(), backend=backend.name,
                                error=getattr(exc, "reason", type(exc).__name__))
        s.clean = False  # the cache may hold anything past the prompt now: register none of it
        self.unhealthy_reason = reason
        return GenerationError(s.request_id, f"persistent decoder failed after launch: {exc}", LANE,
                               stage="postlaunch", reason=reason)

    def _quantum_request(self, req: Request, pending: int, committed: int, size: int, cancel) -> QuantumRequest:
        return QuantumRequest(
            pending_token=pending,
            committed_kv_length=committed,
            max_sequence_length=self.core.config.max_model_len,
            max_tokens=size,
            full_block_map=torch.tensor(req.block_table, dtype=torch.int32),
            cancellation_flag=cancel,
            stop_token_ids=tuple(sorted(stop_token_set(req.params, self.core.eos_token_ids))),
        )

    def _banned_ids(self, req: Request) -> frozenset[int]:
        """The ids ``min_tokens`` bans for ``req``'s next token: every stop id until then (the standard lane's rule)."""
        if req.num_output_tokens >= req.params.min_tokens:
            return frozenset()
        return stop_token_set(req.params, self.core.eos_token_ids)

    def _pick(self, req: Request, logits: torch.Tensor) -> int:
        """The next token from ``logits`` ``[1, vocab]``: the argmax, with the ids ``min_tokens`` bans for this
        position masked first (the standard lane's sampler, on the same row)."""
        banned = self._banned_ids(req)
        if not banned:
            return int(logits[0].argmax())
        row = SamplingRow(req.params, None, req.prompt_token_ids, req.output_token_ids, banned)
        return sample_rows(logits[:1], [row]).token_ids[0]

    def _min_tokens_ban_index(self, req: Request, tokens: list[int]) -> int | None:
        """Index of the first of a quantum's ``tokens`` that ``min_tokens`` bans at its position (an EOS or stop
        id while fewer than ``min_tokens`` tokens precede it), or None. The device's argmax does not mask
        them; the standard lane would have taken the best other token there."""
        banned, room = self._banned_ids(req), req.params.min_tokens - req.num_output_tokens
        return next((j for j, tok in enumerate(tokens[:room]) if tok in banned), None)

    def _emit_with_ban(self, req: Request, head: list[int], committed: int) -> GenerationChunk:
        """Take a quantum's ``head`` (the tokens before a banned one), then recompute the banned position on the
        host: one forward of the model runner over the last taken token (position ``committed``, whose KV the
        quantum already wrote: written again, the same), the ban applied, the argmax taken. The quantum's
        later tokens are dropped; their KV positions are written again by the next quantum before any read."""
        eos, limit = self.core.eos_token_ids, self.core.config.max_model_len
        accepted = accept_tokens(req, head, eos, limit)
        tokens, finish = list(accepted.token_ids), accepted.finish
        req.num_computed_tokens = committed
        if finish is None:
            self.min_tokens_recomputes += 1
            logits = self.core.runner.execute([(req, 1)])  # feeds all_token_ids[committed]
            req.num_computed_tokens = committed + 1
            fixed = accept_tokens(req, [self._pick(req, logits)], eos, limit)
            tokens, finish = tokens + fixed.token_ids, fixed.finish
        self.tokens_generated += len(tokens)
        return self._chunk(req, tokens, finish)

    def _emit(self, req: Request, tokens: list[int]) -> GenerationChunk:
        """Append tokens, cut at the first that ends the request (EOS, stop id or length, checked token by
        token on the host as the standard lane does: ``stops.accept_tokens``), and build the chunk. Tokens
        after the cut are dropped: their KV is beyond the end, in pages the request holds until it ends.
        Stop strings are the reader's (``replicas.output_processor``), which ends the stream on one."""
        accepted = accept_tokens(req, tokens, self.core.eos_token_ids, self.core.config.max_model_len)
        self.tokens_generated += len(accepted.token_ids)
        return self._chunk(req, accepted.token_ids, accepted.finish)

    def _chunk(self, req: Request, tokens, finish: FinishReason | None) -> GenerationChunk:
        return GenerationChunk(  # token ids only: the reader makes the text
            request_id=req.request_id, token_ids=tokens,
            finish_reason=finish.value if finish else None,
            num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens, lane=LANE,
        )

    def stats(self) -> dict:
        """Pages, health, counters and the backend of this lane (``/debug/stats``)."""
        a = self.core.allocator
        return {
            "lane": LANE, "kv_pages_total": a.num_blocks, "kv_pages_free": a.num_free,
            "running": int(self.busy), "waiting": 0, "decoder_healthy": self.healthy,
            "unhealthy_reason": self.unhealthy_reason, "quanta_run": self.quanta_run,
            "tokens_generated": self.tokens_generated,
            "min_tokens_recomputes": self.min_tokens_recomputes,
            "backend": self.backend.name if self.backend else None,
            "prefix_caching": self.prefix_caching, "kv_pages_cached": a.num_cached,
            "prefix_hit_tokens": self.prefix_hit_tokens,
        }


def _is_last(item: Item) -> bool:
    """Whether ``item`` ends its request (an error or rejection, or a chunk with a finish reason)."""
    return not isinstance(item, GenerationChunk) or item.finish_reason is not None

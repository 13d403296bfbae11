"""The persistent lane: one greedy request at a time, decoded in quanta.

Flow per request: admission (``policy``) → reserve prompt pages (with prefix
caching: the longest cached prefix's pages are shared, so only the rest of the
prompt is prefilled) → prefill with the engine's model runner → stream the
first token → repeat { size the quantum
(``policy.quantum_size``), reserve its pages, launch, validate the result,
stream the quantum as one chunk } → free the pages.

With a :class:`PipelinedBackend` (``cuda_graph``) the next quantum is sized,
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
and marks the decoder unhealthy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import torch

from policy import check_admission, quantum_size
from replicas.detokenizer import IncrementalDetokenizer
from replicas.engine_core import EngineCore
from replicas.kernels.paged_attention import PAGE_SIZE
from replicas.kv_cache import page_hashes, pages_for
from replicas.messages import GenerateRequest, GenerationChunk, GenerationError, Rejection
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

class PersistentLane:
    """Runs requests through a persistent backend bound to ``core``'s KV cache.

    Args:
        core: the replica's engine core (model, KV cache, pages).
        backend: a bound-on-construction backend, or None when it failed to load.
        load_error: why the backend is missing (reported as unhealthy).
    """

    def __init__(self, core: EngineCore, backend: PersistentBackend | None, load_error: str | None = None):
        self.core = core
        self.backend = backend
        self.unhealthy_reason: str | None = load_error if backend is None else None
        self._busy = threading.Lock()
        self._reference: EagerBackend | None = None
        self.quanta_run = 0
        self.min_tokens_recomputes = 0
        """Positions recomputed on the host because the device's argmax took an id ``min_tokens`` bans there."""
        self.prefix_hit_tokens = 0
        """Prompt tokens served from the prefix cache, summed over requests."""
        self._clean = True  # the current request's KV is valid below its committed length (no failure after launch)
        if backend is not None:
            backend.bind_cache(CacheBinding.from_kv_tensor(core.kv_cache.tensor))

    @property
    def healthy(self) -> bool:
        return self.unhealthy_reason is None

    @property
    def busy(self) -> bool:
        return self._busy.locked()

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

    def generate(
        self, request: GenerateRequest, cancel: threading.Event | None = None, telemetry=None
    ) -> Iterator[GenerationChunk | Rejection | GenerationError]:
        """Serve one request; yields a Rejection, or chunks, or chunks then an error.

        ``telemetry`` (optional, injected by the engine actor: ``ops.telemetry.engine_telemetry.RequestTelemetry``)
        is told when the prefill starts (``scheduled()``) and about every quantum (``quantum(...)``).
        """
        try:
            self.core.validate_prompt(request.prompt_token_ids, request.params.max_tokens)
        except ValueError as exc:
            yield GenerationError(request.request_id, str(exc), LANE, stage="validation", reason="invalid_request")
            return
        reason = self._admission(request)
        if reason is not None:
            detail = (self.unhealthy_reason or "") if reason in ("unsupported_envelope", "decoder_unhealthy") else ""
            yield Rejection(request.request_id, reason, lane=LANE, detail=detail)
            return
        if not self._busy.acquire(blocking=False):
            yield Rejection(request.request_id, "queued_work", lane=LANE)
            return
        req = Request(request.request_id, list(request.prompt_token_ids), request.params)
        self._clean = True
        try:
            yield from self._run(req, cancel, telemetry)
        finally:
            if self._clean and req.block_table:
                self._register_pages(req, min(req.num_computed_tokens, req.num_tokens))
            self.core.allocator.release(req.block_table)
            self._busy.release()

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

    def _run(self, req: Request, cancel: threading.Event | None, telemetry=None):
        core = self.core
        if not self._reserve_prompt(req):
            yield Rejection(req.request_id, "persistent_capacity", lane=LANE, detail="no free KV pages for the prompt")
            return
        self.prefix_hit_tokens += req.num_cached_tokens
        detok = IncrementalDetokenizer(core.tokenizer, req.params.stop, req.params.include_stop_str_in_output)
        if telemetry is not None:
            telemetry.scheduled()
        try:  # prefill what the prefix cache did not hold
            logits = core.runner.execute([(req, req.num_prompt_tokens - req.num_computed_tokens)])
        except Exception as exc:  # noqa: BLE001 - reported to the client, replica stays up
            self._clean = False
            yield GenerationError(req.request_id, f"prefill failed: {exc}", LANE, stage="prefill", reason="prefill_error")
            return
        req.num_computed_tokens = req.num_prompt_tokens
        self._register_pages(req, req.num_prompt_tokens)
        chunk = self._emit(req, detok, [self._pick(req, logits)])
        yield chunk
        fallback: str | None = None
        fallback_reported = False
        ahead: tuple[QuantumRequest, int] | None = None  # a quantum launched behind the one being collected
        # launch each quantum behind the one being read when the backend can (engine config pipeline_quanta)
        pipeline = core.config.pipeline_quanta and isinstance(self.backend, PipelinedBackend)  # fixed per request
        try:
            while chunk.finish_reason is None:
                if cancel is not None and cancel.is_set():
                    yield self._chunk(req, [], "", FinishReason.ABORT)
                    return
                backend = self._reference if fallback else self.backend
                pipelined = pipeline and not fallback
                if ahead is not None:
                    (quantum_request, start_ns), ahead = ahead, None
                else:
                    quantum_request = self._reserve(req, req.num_computed_tokens, req.remaining_output_tokens,
                                         req.output_token_ids[-1], cancel)
                    if quantum_request is None:
                        yield GenerationError(req.request_id, "out of KV pages mid-request", LANE,
                                              stage="prelaunch", reason="persistent_capacity")
                        return
                    start_ns = time.time_ns()
                    try:
                        if pipelined:
                            backend.launch_quantum(quantum_request)
                            result = None
                        else:
                            result = backend.run_quantum(quantum_request)
                    except PrelaunchError as exc:
                        if telemetry is not None:
                            telemetry.quantum(quantum_request.max_tokens, 0, None, start_ns, time.time_ns(),
                                              backend=backend.name, error=exc.reason)
                        if fallback:  # the reference path rejected too: nothing more to try
                            yield GenerationError(req.request_id, str(exc), LANE, stage="prelaunch", reason=exc.reason)
                            return
                        fallback = exc.reason
                        if self._reference is None:
                            self._reference = EagerBackend(core.model, core.runner.device)
                            self._reference.bind_cache(CacheBinding.from_kv_tensor(core.kv_cache.tensor))
                        continue
                    except Exception as exc:  # noqa: BLE001 - failed after launch: terminal
                        yield self._terminal(req, backend, quantum_request, exc, start_ns, telemetry)
                        return
                if pipelined:
                    try:
                        ahead = self._launch_follower(req, backend, quantum_request, cancel)
                    except Exception as exc:  # noqa: BLE001 - the follower's launch failed: terminal
                        yield self._terminal(req, backend, quantum_request, exc, start_ns, telemetry)
                        return
                    try:
                        result = backend.collect_quantum()
                    except Exception as exc:  # noqa: BLE001
                        yield self._terminal(req, backend, quantum_request, exc, start_ns, telemetry)
                        return
                try:
                    validate_result(quantum_request, result)
                except Exception as exc:  # noqa: BLE001
                    yield self._terminal(req, backend, quantum_request, exc, start_ns, telemetry)
                    return
                if telemetry is not None:
                    telemetry.quantum(quantum_request.max_tokens, len(result.emitted_tokens), result.finish_reason, start_ns,
                                      time.time_ns(), backend=backend.name)
                self.quanta_run += 1
                banned_at = self._min_tokens_ban_index(req, result.emitted_tokens)
                if banned_at is not None:  # the device's argmax took a stop id that min_tokens bans there
                    if ahead is not None:
                        backend.discard_quanta()  # it started from the banned token
                        ahead = None
                    try:
                        chunk = self._emit_with_ban(req, detok, result.emitted_tokens[:banned_at],
                                                    quantum_request.committed_kv_length + banned_at)
                    except Exception as exc:  # noqa: BLE001 - a host forward failed; the decoder is fine
                        self._clean = False
                        yield GenerationError(req.request_id, f"decode step failed: {exc}", LANE, stage="decode",
                                              reason="engine_error")
                        return
                else:
                    req.num_computed_tokens = result.committed_kv_length
                    if ahead is not None and ahead[0].committed_kv_length != result.committed_kv_length:
                        backend.discard_quanta()  # this quantum stopped early: the follower started from a wrong guess
                        ahead = None
                    if ahead is not None:  # it started from this result's last token
                        ahead = (replace(ahead[0], pending_token=result.pending_token), ahead[1])
                    chunk = self._emit(req, detok, result.emitted_tokens)
                if fallback and not fallback_reported:
                    chunk.fallback_reason, fallback_reported = fallback, True
                yield chunk
        finally:
            if isinstance(self.backend, PipelinedBackend):
                try:
                    self.backend.discard_quanta()  # a follower still running: before generate() frees its pages
                except Exception as exc:  # noqa: BLE001 - the device failed: no more quanta on this decoder
                    self.unhealthy_reason = getattr(exc, "reason", BackendLaunchError.reason)

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

    def _terminal(self, req: Request, backend: PersistentBackend, quantum_request: QuantumRequest, exc: Exception,
                  start_ns: int, telemetry) -> GenerationError:
        """A failure after launch (or an invalid result): the decoder is marked unhealthy, the request ends."""
        if telemetry is not None:
            telemetry.quantum(quantum_request.max_tokens, 0, None, start_ns, time.time_ns(), backend=backend.name,
                              error=getattr(exc, "reason", type(exc).__name__))
        self._clean = False  # the cache may hold anything past the prompt now: register none of it
        self.unhealthy_reason = getattr(exc, "reason", BackendLaunchError.reason)
        return GenerationError(req.request_id, f"persistent decoder failed after launch: {exc}", LANE,
                               stage="postlaunch", reason=self.unhealthy_reason)

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

    def _emit_with_ban(self, req: Request, detok: IncrementalDetokenizer, head: list[int],
                       committed: int) -> GenerationChunk:
        """Take a quantum's ``head`` (the tokens before a banned one), then recompute the banned position on the
        host: one forward of the model runner over the last taken token (position ``committed``, whose KV the
        quantum already wrote: written again, the same), the ban applied, the argmax taken. The quantum's
        later tokens are dropped; their KV positions are written again by the next quantum before any read."""
        accepted = accept_tokens(req, detok, head, self.core.eos_token_ids, self.core.config.max_model_len)
        tokens, text, finish = list(accepted.token_ids), accepted.text, accepted.finish
        req.num_computed_tokens = committed
        if finish is None:
            self.min_tokens_recomputes += 1
            logits = self.core.runner.execute([(req, 1)])  # feeds all_token_ids[committed]
            req.num_computed_tokens = committed + 1
            fixed = accept_tokens(req, detok, [self._pick(req, logits)], self.core.eos_token_ids,
                                  self.core.config.max_model_len)
            tokens, text, finish = tokens + fixed.token_ids, text + fixed.text, fixed.finish
        return self._chunk(req, tokens, text, finish)

    def _emit(self, req: Request, detok: IncrementalDetokenizer, tokens: list[int]) -> GenerationChunk:
        """Append tokens, cut at the first that ends the request (EOS, stop id, length or stop string,
        checked token by token on the host as the standard lane does: ``stops.accept_tokens``),
        detokenize, and build the chunk. Tokens after the cut are dropped: their KV is beyond the end, in
        pages the request holds until :meth:`generate` frees them."""
        accepted = accept_tokens(req, detok, tokens, self.core.eos_token_ids, self.core.config.max_model_len)
        return self._chunk(req, accepted.token_ids, accepted.text, accepted.finish)

    def _chunk(self, req: Request, tokens, text, finish: FinishReason | None) -> GenerationChunk:
        return GenerationChunk(
            request_id=req.request_id, token_ids=tokens, text=text,
            finish_reason=finish.value if finish else None,
            num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens, lane=LANE,
        )

    def stats(self) -> dict:
        a = self.core.allocator
        return {
            "lane": LANE, "kv_pages_total": a.num_blocks, "kv_pages_free": a.num_free,
            "running": int(self.busy), "waiting": 0, "decoder_healthy": self.healthy,
            "unhealthy_reason": self.unhealthy_reason, "quanta_run": self.quanta_run,
            "min_tokens_recomputes": self.min_tokens_recomputes,
            "backend": self.backend.name if self.backend else None,
            "prefix_caching": self.prefix_caching, "kv_pages_cached": a.num_cached,
            "prefix_hit_tokens": self.prefix_hit_tokens,
        }

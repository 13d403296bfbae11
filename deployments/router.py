"""The router: picks a lane per request (asking ``policy``), spills and retries, and handles fallbacks.

It runs inside the ingress process, so routing adds no Ray hop: the request goes ingress → replica → engine
actor. Its jobs live in one module each:

* lane choice, spillover, fallbacks and retries: this module (:class:`Router`);
* the persistent pool as this router sees it, fed by the engines' pushed load records:
  :mod:`deployments.pool_view` (the model itself, pure: :mod:`policy.pool`);
* sending a request to a replica and reading its items over either output transport:
  :mod:`deployments.dispatch`;
* readiness (``/health``): :mod:`deployments.readiness`.

Every request gets a ``route`` span; every request that could have gone persistent but did not gets a
``fallback`` span with the reason and stage (``ops.telemetry.tracing``) and increments
``fallbacks_total{reason,stage}`` (``ops.telemetry.metrics``). The ``route`` span's trace context travels to the
replica inside ``GenerateRequest.trace_context`` (with the ``sampled`` flag forced once the request falls back,
so fallback traces are kept).

A client may force the lane (``GenerateRequest.lane_override``, from the ``x-lane`` request header):
``standard`` skips the persistent lane without a fallback; ``persistent`` is the normal choice (the response's
``x-lane`` says where it ran).

Spillover (``policy.spillover``): the router counts its own persistent requests (dispatches included) and the
other routers' requests the engines' records show against the persistent replicas with a healthy decoder
(:class:`~deployments.pool_view.PoolView`). With a replica free, an eligible request is dispatched there
(bounded by ``spillover_wait_s``). With every replica busy it goes standard at once, unless its estimates say a
persistent replica frees up and gives the first token sooner than the standard lane would; then it waits at
most that long. When only other routers' requests keep the replicas busy it reads the board once more first.
Either way a spill is reason ``persistent_capacity``: a ``fallback`` span and the counter
``persistent_serve_spillovers_total``; the standard lane marks such requests (``GenerateRequest.spilled``) so
the persistent pool's autoscaling policy counts them as demand (``deployments.autoscaling``). An empty
persistent pool (scaled to zero) is still queued on for up to ``spillover_wait_s``, so Serve's queue wakes it.

Co-located mode: one deployment hosts both lanes; the router sends persistent traffic to its
``generate_persistent`` entry and standard traffic to its ``generate`` entry (same handle). A busy co-located
persistent lane answers at once with a ``queued_work`` rejection, which is a spill.

Failures: a replica that dies under a request (the handle raises) ends that request's stream with a
``GenerationError`` (``replica_died``) rather than an exception, so the client gets an error event. A
standard-lane request whose replica or engine died before any of its output was passed on is sent again
(``STANDARD_RETRIES``), since the client cannot tell; on the persistent lane a failure after ``Started`` stays
terminal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator

from opentelemetry import trace
from ray.serve.exceptions import BackPressureError

from deployments.dispatch import REPLICA_DIED, Dispatch, OutputStreams
from deployments.pool_view import PoolView
from deployments.readiness import Readiness
from ops.telemetry.metrics import RequestClock, get_metrics
from ops.telemetry.tracing import (
    ATTR_GEN_AI_TEMPERATURE,
    ATTR_LANE,
    ATTR_REASON,
    SPAN_ROUTE,
    get_tracer,
    inject_context,
    record_fallback,
)
from policy import (
    Lane,
    LaneDecision,
    Mode,
    PersistentLaneStatus,
    Reason,
    check_admission,
    choose_lane,
)
from policy.spillover import SpilloverEstimator
from replicas.messages import GenerateRequest, GenerationChunk, GenerationError, Rejection

__all__ = ["OVERLOADED", "REPLICA_DIED", "REPLICA_UNAVAILABLE", "STANDARD_RETRIES", "Router"]

OVERLOADED = "overloaded"
"""``GenerationError.reason`` when the standard pool's queue is full (HTTP 503 + Retry-After)."""

REPLICA_UNAVAILABLE = "replica_unavailable"
"""``GenerationError.reason`` when no live standard replica could take the request (HTTP 503 + Retry-After)."""

STANDARD_RETRIES = 2
"""Times a standard-lane request is sent again when its replica or engine died before any output
reached the client (nothing was delivered, so the client cannot tell). Never after output."""

UNHEALTHY_RETRY_S = 5.0
"""After a replica reports an unhealthy or unusable decoder, skip the persistent lane this long
(Serve replaces an unhealthy replica meanwhile), then try it again."""


def spillover_counter():
    """Prometheus counter ``persistent_serve_spillovers_total{reason}`` (Ray's metrics API)."""
    from ray.util.metrics import Counter

    return Counter("persistent_serve_spillovers_total",
                   description="Eligible requests sent to the standard lane because every persistent "
                   "replica was busy.", tag_keys=("reason",))


class Router:
    """Lane choice, spillover and fallback for one ingress replica.

    Args:
        mode: persistent-decoder mode.
        persistent: Serve handle of the persistent deployment (None when off); in co-located mode the
            co-located deployment's handle.
        standard: Serve handle of the standard deployment (co-located: the same handle).
        max_model_len: context limit used for admission.
        spillover_wait_s: the longest an eligible request waits for a persistent replica to take it
            (a dispatch to a replica believed free, or a wait the estimates justify); past it, it
            spills to the standard lane with reason ``persistent_capacity``.
        app_name: the Serve application, whose pool board this router watches (None: no view; the router
            then treats a replica as free unless its own requests fill it).
        colocated: both lanes in one deployment (``generate_persistent`` / ``generate`` entries).
        wait_for_persistent: readiness needs the persistent pool too (False when it may have no replica).
        direct_stream: engines send each request's output straight to this router's listener
            (:mod:`replicas.stream_channel`) instead of back through the replica; False: through Ray.
    """

    def __init__(self, mode: Mode, persistent, standard, max_model_len: int, spillover_wait_s: float = 0.5,
                 app_name: str | None = None, colocated: bool = False, wait_for_persistent: bool = True,
                 direct_stream: bool = True):
        self.mode = mode
        self.persistent = persistent
        self.standard = standard
        self.max_model_len = max_model_len
        self.spillover_wait_s = spillover_wait_s
        self.app_name = app_name
        self.colocated = colocated
        self.persistent_entry = "generate_persistent" if colocated else "generate"
        self.in_flight = 0
        self.dispatching = 0
        self.spillovers = 0
        self.overloaded = 0
        self.served = {Lane.PERSISTENT.value: 0, Lane.STANDARD.value: 0}
        """Requests whose output came from each lane (counted at their first chunk)."""
        self.caller = _this_actor()
        self.estimator = SpilloverEstimator()
        self._spill_counter = spillover_counter()
        self._unhealthy_until = 0.0
        self._unsupported_until = 0.0
        self.pool = PoolView(app_name if persistent is not None else None, "colocated" if colocated else "persistent")
        self.streams = OutputStreams(direct_stream)
        pools = {"standard": standard}
        if persistent is not None and wait_for_persistent:
            pools["persistent"] = persistent
        self.ready = Readiness(pools, prepare=self.streams.start, after_ping={"persistent": self.pool.refresh},
                               started=self.pool.start)

    @property
    def direct_stream(self) -> bool:
        """Whether engines send this router's output over its listener (False once the listener failed)."""
        return self.streams.direct_stream

    def _status(self) -> PersistentLaneStatus:
        # capacity is decided per request by the spillover rule (_wait_budget), not here
        return PersistentLaneStatus(
            available=self.persistent is not None,
            healthy=time.monotonic() >= self._unhealthy_until,
            envelope_supported=time.monotonic() >= self._unsupported_until,
            has_capacity=True,
        )

    def stats(self) -> dict:
        """Router counters, the pool as seen (:meth:`PoolView.stats`) and spillover estimates for ``/debug/stats``.

        Starts the pool view if nothing did yet (it starts on the router's first request or readiness probe;
        with several ingress replicas one may be asked for its stats before either): call on the event loop."""
        self.pool.start()
        return {"router_id": self.caller[0] if self.caller else None, "persistent_in_flight": self.in_flight, "spillovers": self.spillovers,
                "direct_stream": self.streams.stats(), "overloaded": self.overloaded, "served": dict(self.served),
                **self.pool.stats(), "estimates": self.estimator.snapshot()}

    async def missing_pools(self) -> list[str]:
        """The pools this router has not reached yet (``[]``: ready); see :meth:`Readiness.missing_pools`."""
        return await self.ready.missing_pools()

    async def readiness(self) -> list[str]:
        """What ``/health`` reports within about ``HEALTH_WAIT_S`` (:meth:`Readiness.readiness`)."""
        return await self.ready.readiness()

    def _wait_budget(self) -> float | None:
        """How long this eligible request may wait for a persistent replica; None: spill now."""
        free = self.pool.free_replicas()
        if free is None or self.pool.replicas() == 0:
            return self.spillover_wait_s  # pool unknown, or empty: queue so Serve's demand can wake it
        return self.estimator.wait_budget(free, self.spillover_wait_s, time.monotonic())

    # ---- routing ---------------------------------------------------------------------------
    def decide(self, request: GenerateRequest):
        """The lane decision for ``request`` (pure: policy admission + lane choice)."""
        if request.lane_override == Lane.STANDARD.value:
            return LaneDecision(Lane.STANDARD, None)
        enabled = self.mode is not Mode.OFF and self.persistent is not None
        reason = check_admission(request.admission_input(self.max_model_len, enabled=enabled))
        return choose_lane(self.mode, reason, self._status())

    async def _take_persistent(self, request: GenerateRequest, wait_s: float) -> Dispatch | None:
        """Send ``request`` to the persistent pool; the dispatch once a replica took it (first item
        :class:`Started`), else None (still queued after ``wait_s``, or refused by Serve's
        ``max_queued_requests``)."""
        entry = getattr(self.persistent.options(stream=True), self.persistent_entry)
        dispatch = self.streams.send(entry, request, Lane.PERSISTENT.value)
        return dispatch if await dispatch.started(wait_s) else None

    async def generate(self, request: GenerateRequest, parent=None,
                       arrival: float | None = None) -> AsyncIterator[GenerationChunk | GenerationError]:
        """Stream the request's chunks from whichever lane serves it (fallbacks included).

        Yields a :class:`GenerationError` with reason ``overloaded`` (stage ``admission``)
        when the standard pool refuses the request (Serve back-pressure).

        Args:
            request: the request.
            parent: OpenTelemetry context of the caller's span (the HTTP request span), or None.
            arrival: ``time.monotonic()`` when the HTTP request arrived (latency metrics), or now.
        """
        self.pool.start()
        await self.streams.start()
        await self.ready.first_requests_probe()
        decision = self.decide(request)
        span = get_tracer().start_span(SPAN_ROUTE, context=parent, attributes={
            ATTR_LANE: decision.lane.value, "mode": self.mode.value, "request.id": request.request_id,
            ATTR_GEN_AI_TEMPERATURE: request.params.temperature,
            **({ATTR_REASON: decision.reason.value} if decision.reason else {}),
            **({"lane.forced": request.lane_override} if request.lane_override else {}),
        })
        clock = RequestClock(arrival)
        fell_back = False  # once true, downstream hops are sampled (fallback traces are always kept)
        counted = False

        def count(item) -> None:
            nonlocal counted
            if not counted and isinstance(item, GenerationChunk) and item.lane in self.served:
                self.served[item.lane] += 1
                counted = True

        def hop(outgoing: GenerateRequest) -> GenerateRequest:
            return dataclasses.replace(outgoing, trace_context=inject_context(span, force_sample=fell_back),
                                       caller=self.caller)

        try:
            lane = decision.lane
            if lane is Lane.STANDARD and decision.reason is not None and self.mode is not Mode.OFF:
                self._fallback(span, decision.reason.value, "prelaunch", request.request_id)
                fell_back = True
            if lane is Lane.PERSISTENT:
                served = _Outcome(done=True)
                async with contextlib.aclosing(self._persistent(request, hop, span, clock)) as items:
                    async for item in items:
                        if isinstance(item, _Outcome):
                            served = item
                        else:
                            count(item)
                            yield item
                if served.spilled:
                    request = dataclasses.replace(request, spilled=True)
                if served.fell_back:
                    fell_back = True
                if served.done:
                    return
            async for item in self._standard(hop(request), span):
                clock.chunk(item)
                count(item)
                yield item
        finally:
            clock.finish(get_metrics())
            span.end()

    async def _standard(self, request: GenerateRequest, span) -> AsyncIterator[GenerationChunk | GenerationError]:
        """The standard lane's stream for ``request``; sent again (``STANDARD_RETRIES``) when its replica or engine
        died before any output, an error event when it died after, 503 items when Serve refuses it."""
        for attempt in range(STANDARD_RETRIES + 1):
            delivered, timed = False, False
            dispatched = time.monotonic()
            dispatch = self.streams.send(self.standard.options(stream=True).generate, request, Lane.STANDARD.value)
            stream = dispatch.items()
            try:
                async for item in stream:
                    lost = isinstance(item, GenerationError) and item.reason in (REPLICA_DIED, "engine_died")
                    if lost and not delivered and attempt < STANDARD_RETRIES:
                        span.add_event("retry", {"reason": item.reason, "attempt": attempt + 1})
                        break  # nothing reached the client: send it again
                    if lost and not delivered:
                        item = dataclasses.replace(item, stage="admission", reason=REPLICA_UNAVAILABLE)
                    if not timed and getattr(item, "token_ids", None):
                        self.estimator.standard_first_chunk(time.monotonic() - dispatched)
                        timed = True
                    delivered = True
                    yield item
                else:
                    return
            except BackPressureError as exc:
                self.overloaded += 1
                span.set_attribute("overloaded", True)
                yield GenerationError(request.request_id, f"the server is overloaded, retry later ({exc})",
                                      Lane.STANDARD.value, stage="admission", reason=OVERLOADED)
                return
            finally:
                await stream.aclose()

    async def _persistent(self, request: GenerateRequest, hop, span, clock):
        """Try the persistent lane: yields its items, then one :class:`_Outcome` (served there, or
        go standard: spilled for capacity or fell back after a rejection)."""
        wait_s = self._wait_budget()
        if wait_s is None and self.pool.busy_with_others():  # other routers' requests may have ended: ask again
            await self.pool.recheck()
            wait_s = self._wait_budget()
        dispatch, started = None, time.monotonic()
        self.pool.claim(request.request_id)  # counts against the pool from now, until released below
        try:
            if wait_s is not None:
                self.dispatching += 1
                try:
                    dispatch = await self._take_persistent(hop(request), wait_s)
                finally:
                    self.dispatching -= 1
            if dispatch is None:
                self._spill(span, request.request_id, time.monotonic() - started if wait_s is not None else 0.0)
                yield _Outcome(done=False, spilled=True, fell_back=True)
                return
            rejected = None
            async with contextlib.aclosing(self._served_persistent(dispatch, request, span, clock, started)) as items:
                async for item in items:
                    if isinstance(item, Rejection):
                        rejected = item
                        break
                    yield item
        finally:
            if dispatch is not None:
                dispatch.close()  # no-op once its items ended; else the Serve call is cancelled
            self.pool.release(request.request_id)
        if rejected is None:
            yield _Outcome(done=True)
            return
        if rejected.reason == Reason.QUEUED_WORK.value:  # the replica was busy after all: a spill
            self._spill(span, request.request_id, time.monotonic() - started)
            yield _Outcome(done=False, spilled=True, fell_back=True)
            return
        if rejected.reason == Reason.DECODER_UNHEALTHY.value:
            self._unhealthy_until = time.monotonic() + UNHEALTHY_RETRY_S
        elif rejected.reason == Reason.UNSUPPORTED_ENVELOPE.value:
            self._unsupported_until = time.monotonic() + UNHEALTHY_RETRY_S
        self._fallback(span, rejected.reason, "prelaunch", request.request_id)
        span.set_attribute(ATTR_LANE, Lane.STANDARD.value)
        span.set_attribute(ATTR_REASON, rejected.reason)
        yield _Outcome(done=False, fell_back=True)

    async def _served_persistent(self, dispatch: Dispatch, request: GenerateRequest, span, clock, started: float):
        """A persistent replica took ``request``: its items (a :class:`Rejection` is the last one), traced and
        timed for the spillover estimates."""
        self.in_flight += 1
        self.estimator.started(request.request_id, request.params.max_tokens, started)
        try:
            async with contextlib.aclosing(dispatch.items()) as items:
                async for item in items:
                    if isinstance(item, GenerationError) and item.stage == "postlaunch":
                        # terminal for this request: traced, never retried on another lane
                        self._fallback(span, item.reason, "postlaunch", request.request_id, lane=None)
                        if item.reason != "stream_lost":  # the way back broke, not the decoder
                            self._unhealthy_until = time.monotonic() + UNHEALTHY_RETRY_S
                    elif isinstance(item, GenerationChunk):
                        self.estimator.persistent_chunk(request.request_id, len(item.token_ids), time.monotonic())
                        if item.fallback_reason:
                            self._fallback(span, item.fallback_reason, "prelaunch", request.request_id,
                                           lane="persistent", continued_on="reference_decode")
                    if not isinstance(item, Rejection):
                        clock.chunk(item)
                    yield item
                    if isinstance(item, Rejection):
                        return
        finally:
            self.in_flight -= 1
            self.estimator.finished(request.request_id)

    def _spill(self, span, request_id: str, waited_s: float) -> None:
        """Every persistent replica is busy: go standard, traced (with how long it waited) and counted."""
        reason = Reason.PERSISTENT_CAPACITY.value
        self.spillovers += 1
        self._spill_counter.inc(tags={"reason": reason})
        self._fallback(span, reason, "prelaunch", request_id, waited_s=round(waited_s, 6))
        span.set_attribute(ATTR_LANE, Lane.STANDARD.value)
        span.set_attribute(ATTR_REASON, reason)

    @staticmethod
    def _fallback(span, reason: str, stage: str, request_id: str, lane: str | None = "standard", **attrs) -> None:
        with trace.use_span(span, end_on_exit=False):
            record_fallback(reason, stage, request_id, lane=lane, **attrs)
        get_metrics().fallback(reason, stage)


def _this_actor():
    """``(actor id, handle)`` of the actor this router runs in (the ingress replica), or None outside one:
    replicas watch it and stop the work of requests whose ingress died (``deployments/replicas.py``)."""
    import ray

    if not ray.is_initialized():
        return None
    ctx = ray.get_runtime_context()
    actor_id = ctx.get_actor_id()
    return (actor_id, ctx.current_actor) if actor_id else None


@dataclasses.dataclass
class _Outcome:
    """How a persistent attempt ended: ``done`` (served there), else go standard (``spilled`` for
    capacity, ``fell_back`` when the standard hop must be sampled)."""

    done: bool
    spilled: bool = False
    fell_back: bool = False

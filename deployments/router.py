"""The router: picks a lane per request (asking ``policy``) and handles fallbacks.

It runs inside the ingress process, so routing adds no Ray hop: the request
goes ingress → replica → engine actor. Every request gets a ``route`` span;
every request that could have gone persistent but did not gets a ``fallback``
span with the reason and stage (``ops.telemetry.tracing``) and increments
``fallbacks_total{reason,stage}`` (``ops.telemetry.metrics``). The ``route`` span's trace
context travels to the replica inside ``GenerateRequest.trace_context`` (with the
``sampled`` flag forced once the request falls back, so fallback traces are kept).

A client may force the lane (``GenerateRequest.lane_override``, from the
``x-lane`` request header): ``standard`` skips the persistent lane without a
fallback; ``persistent`` is the normal choice (the response's ``x-lane`` says
where it ran).

Spillover: an eligible request is queued on the persistent pool (Serve holds
it until a replica, ``max_ongoing_requests=1``, is free; that queue is what
the pool autoscales on). If no replica takes it within ``spillover_wait_s``,
or Serve's ``max_queued_requests`` refuses it, it goes to the standard lane
with reason ``persistent_capacity``: a ``fallback`` span and the counter
``persistent_serve_spillovers_total``.

Failures: a replica that dies under a request (the handle raises) ends that request's
stream with a ``GenerationError`` (``replica_died``) rather than an exception, so the
client gets an error event. A standard-lane request whose replica or engine died before
any of its output was passed on is sent again (``STANDARD_RETRIES``), since the client
cannot tell; on the persistent lane a failure after ``Started`` stays terminal.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from opentelemetry import trace
from ray.exceptions import RayActorError
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
)

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
from replicas.messages import GenerateRequest, GenerationChunk, GenerationError, Rejection, Started

logger = logging.getLogger(__name__)

OVERLOADED = "overloaded"
"""``GenerationError.reason`` when the standard pool's queue is full (HTTP 503 + Retry-After)."""

REPLICA_DIED = "replica_died"
"""``GenerationError.reason`` when the replica serving a request died under it (Ray/Serve raised)."""

REPLICA_UNAVAILABLE = "replica_unavailable"
"""``GenerationError.reason`` when no live standard replica could take the request (HTTP 503 + Retry-After)."""

STANDARD_RETRIES = 2
"""Times a standard-lane request is sent again when its replica or engine died before any output
reached the client (nothing was delivered, so the client cannot tell). Never after output."""

_REPLICA_FAILURES = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)

UNHEALTHY_RETRY_S = 5.0
"""After a replica reports an unhealthy or unusable decoder, skip the persistent lane this long
(Serve replaces an unhealthy replica meanwhile), then try it again."""


def spillover_counter():
    """Prometheus counter ``persistent_serve_spillovers_total{reason}`` (Ray's metrics API)."""
    from ray.util.metrics import Counter

    return Counter("persistent_serve_spillovers_total",
                   description="Eligible requests sent to the standard lane because every persistent "
                   "replica stayed busy for spillover_wait_s.", tag_keys=("reason",))


class Router:
    """Lane choice, spillover and fallback for one ingress replica.

    Args:
        mode: persistent-decoder mode.
        persistent: Serve handle of the persistent deployment (None when off).
        standard: Serve handle of the standard deployment.
        max_model_len: context limit used for admission.
        spillover_wait_s: how long an eligible request waits for a persistent
            replica to take it (Serve queues it meanwhile, which is also the
            demand signal the pool autoscales on) before it spills to the
            standard lane with reason ``persistent_capacity``.
    """

    def __init__(self, mode: Mode, persistent, standard, max_model_len: int, spillover_wait_s: float = 0.5):
        self.mode = mode
        self.persistent = persistent
        self.standard = standard
        self.max_model_len = max_model_len
        self.spillover_wait_s = spillover_wait_s
        self.in_flight = 0
        self.spillovers = 0
        self.overloaded = 0
        self.served = {Lane.PERSISTENT.value: 0, Lane.STANDARD.value: 0}
        """Requests whose output came from each lane (counted at their first chunk)."""
        self._spill_counter = spillover_counter()
        self._unhealthy_until = 0.0
        self._unsupported_until = 0.0
        self.caller = _this_actor()

    def _status(self) -> PersistentLaneStatus:
        # capacity is not guessed here: an eligible request queues for a replica and spills on timeout
        return PersistentLaneStatus(
            available=self.persistent is not None,
            healthy=time.monotonic() >= self._unhealthy_until,
            envelope_supported=time.monotonic() >= self._unsupported_until,
            has_capacity=True,
        )

    def stats(self) -> dict:
        """Router counters for ``/debug/stats``."""
        return {"persistent_in_flight": self.in_flight, "spillovers": self.spillovers,
                "overloaded": self.overloaded, "served": dict(self.served)}

    def decide(self, g: GenerateRequest):
        """The lane decision for ``g`` (pure: policy admission + lane choice)."""
        if g.lane_override == Lane.STANDARD.value:
            return LaneDecision(Lane.STANDARD, None)
        enabled = self.mode is not Mode.OFF and self.persistent is not None
        reason = check_admission(g.admission_input(self.max_model_len, enabled=enabled))
        return choose_lane(self.mode, reason, self._status())

    async def _take_persistent(self, g: GenerateRequest):
        """Queue ``g`` on the persistent pool; the stream once a replica took it, or None on spillover."""
        stream = self.persistent.options(stream=True).generate.remote(g)
        first = asyncio.ensure_future(stream.__anext__())
        try:
            done, _ = await asyncio.wait({first}, timeout=self.spillover_wait_s)
        except asyncio.CancelledError:  # the client went away while queued
            stream.cancel()
            first.cancel()
            raise
        if done and first.exception() is None and isinstance(first.result(), Started):
            return stream
        stream.cancel()  # still queued (or refused by Serve's max_queued_requests): drop it
        if not done:
            first.cancel()
        with contextlib.suppress(BaseException):
            await first
        return None

    async def generate(self, g: GenerateRequest, parent=None,
                       arrival: float | None = None) -> AsyncIterator[GenerationChunk | GenerationError]:
        """Stream the request's chunks from whichever lane serves it (fallbacks included).

        Yields a :class:`GenerationError` with reason ``overloaded`` (stage ``admission``)
        when the standard pool refuses the request (Serve back-pressure).

        Args:
            g: the request.
            parent: OpenTelemetry context of the caller's span (the HTTP request span), or None.
            arrival: ``time.monotonic()`` when the HTTP request arrived (latency metrics), or now.
        """
        decision = self.decide(g)
        span = get_tracer().start_span(SPAN_ROUTE, context=parent, attributes={
            ATTR_LANE: decision.lane.value, "mode": self.mode.value, "request.id": g.request_id,
            ATTR_GEN_AI_TEMPERATURE: g.params.temperature,
            **({ATTR_REASON: decision.reason.value} if decision.reason else {}),
            **({"lane.forced": g.lane_override} if g.lane_override else {}),
        })
        clock = RequestClock(arrival)
        fell_back = False  # once true, downstream hops are sampled (fallback traces are always kept)
        counted = False

        def count(item) -> None:
            nonlocal counted
            if not counted and isinstance(item, GenerationChunk) and item.lane in self.served:
                self.served[item.lane] += 1
                counted = True

        def hop(request: GenerateRequest) -> GenerateRequest:
            return dataclasses.replace(request, trace_context=inject_context(span, force_sample=fell_back),
                                       caller=self.caller)

        try:
            lane = decision.lane
            if lane is Lane.STANDARD and decision.reason is not None and self.mode is not Mode.OFF:
                self._fallback(span, decision.reason.value, "prelaunch", g.request_id)
                fell_back = True
            if lane is Lane.PERSISTENT:
                stream = await self._take_persistent(hop(g))
                if stream is None:
                    self._spill(span, g.request_id)
                    fell_back = True
                else:
                    rejected = None
                    self.in_flight += 1
                    try:
                        async for item in _ended_by_error(stream, g.request_id, Lane.PERSISTENT.value):
                            if isinstance(item, Rejection):
                                rejected = item
                                break
                            if isinstance(item, GenerationError) and item.stage == "postlaunch":
                                # terminal for this request: traced, never retried on another lane
                                self._fallback(span, item.reason, "postlaunch", g.request_id, lane=None)
                                self._unhealthy_until = time.monotonic() + UNHEALTHY_RETRY_S
                            elif isinstance(item, GenerationChunk) and item.fallback_reason:
                                self._fallback(span, item.fallback_reason, "prelaunch", g.request_id,
                                               lane="persistent", continued_on="reference_decode")
                            clock.chunk(item)
                            count(item)
                            yield item
                    finally:
                        self.in_flight -= 1
                    if rejected is None:
                        return
                    if rejected.reason == Reason.DECODER_UNHEALTHY.value:
                        self._unhealthy_until = time.monotonic() + UNHEALTHY_RETRY_S
                    elif rejected.reason == Reason.UNSUPPORTED_ENVELOPE.value:
                        self._unsupported_until = time.monotonic() + UNHEALTHY_RETRY_S
                    self._fallback(span, rejected.reason, "prelaunch", g.request_id)
                    fell_back = True
                    span.set_attribute(ATTR_LANE, Lane.STANDARD.value)
                    span.set_attribute(ATTR_REASON, rejected.reason)
            async for item in self._standard(hop(g), span):
                clock.chunk(item)
                count(item)
                yield item
        finally:
            clock.finish(get_metrics())
            span.end()

    async def _standard(self, g: GenerateRequest, span) -> AsyncIterator[GenerationChunk | GenerationError]:
        """The standard lane's stream for ``g``; sent again (``STANDARD_RETRIES``) when its replica or engine
        died before any output, an error event when it died after, 503 items when Serve refuses it."""
        for attempt in range(STANDARD_RETRIES + 1):
            delivered = False
            stream = _ended_by_error(self.standard.options(stream=True).generate.remote(g), g.request_id,
                                     Lane.STANDARD.value)
            try:
                async for item in stream:
                    lost = isinstance(item, GenerationError) and item.reason in (REPLICA_DIED, "engine_died")
                    if lost and not delivered and attempt < STANDARD_RETRIES:
                        span.add_event("retry", {"reason": item.reason, "attempt": attempt + 1})
                        break  # nothing reached the client: send it again
                    if lost and not delivered:
                        item = dataclasses.replace(item, stage="admission", reason=REPLICA_UNAVAILABLE)
                    delivered = True
                    yield item
                else:
                    return
            except BackPressureError as exc:
                self.overloaded += 1
                span.set_attribute("overloaded", True)
                yield GenerationError(g.request_id, f"the server is overloaded, retry later ({exc})",
                                      Lane.STANDARD.value, stage="admission", reason=OVERLOADED)
                return
            finally:
                await stream.aclose()

    def _spill(self, span, request_id: str) -> None:
        """Every persistent replica stayed busy for ``spillover_wait_s``: go standard, traced and counted."""
        reason = Reason.PERSISTENT_CAPACITY.value
        self.spillovers += 1
        self._spill_counter.inc(tags={"reason": reason})
        self._fallback(span, reason, "prelaunch", request_id, waited_s=self.spillover_wait_s)
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


async def _ended_by_error(stream, request_id: str, lane: str):
    """Pass ``stream``'s items through; a replica that dies under it (Ray/Serve raise) ends it with a
    :class:`GenerationError` (reason ``replica_died``, or ``internal_error`` for anything unexpected)
    instead of an exception, so the client gets an error event and the end of its stream."""
    try:
        async for item in stream:
            yield item
    except BackPressureError:
        raise
    except _REPLICA_FAILURES as exc:
        logger.warning("request %s: the %s replica serving it died or vanished: %s", request_id, lane,
                       type(exc).__name__)
        yield GenerationError(request_id, f"the {lane} replica serving this request died ({type(exc).__name__}); "
                              "the request was lost, retry it", lane, "postlaunch", REPLICA_DIED)
    except Exception as exc:  # noqa: BLE001 - never end a client's stream without an error event
        logger.exception("request %s failed on the %s lane", request_id, lane)
        yield GenerationError(request_id, f"internal error on the {lane} lane ({type(exc).__name__})", lane,
                              "postlaunch", "internal_error")

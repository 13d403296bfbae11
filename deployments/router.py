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

Spillover (``policy.spillover``): the router counts the persistent requests it has in flight
(dispatches included) against the persistent replicas it last saw (it reads their engines every
``POOL_REFRESH_S``). With a replica free, an eligible request is dispatched there (bounded by
``spillover_wait_s``). With every replica busy it goes standard at once, unless its estimates say a
persistent replica frees up and gives the first token sooner than the standard lane would; then it
waits at most that long. Either way a spill is reason ``persistent_capacity``: a ``fallback`` span
and the counter ``persistent_serve_spillovers_total``; the standard lane marks such requests
(``GenerateRequest.spilled``) so the persistent pool's autoscaling policy counts them as demand
(``deployments.autoscaling``). An empty persistent pool (scaled to zero) is still queued on for up
to ``spillover_wait_s``, so Serve's queue wakes it.

Readiness: :meth:`Router.missing_pools` names the pools the router has not reached yet (one real
call through each handle, which also resolves the handle's replicas); ``/health`` answers 503 until
it is empty, from :meth:`Router.readiness` (the probe runs in the background; ``/health`` answers
within about ``HEALTH_WAIT_S`` from the last known state).

Co-located mode: one deployment hosts both lanes; the router sends persistent traffic to its
``generate_persistent`` entry and standard traffic to its ``generate`` entry (same handle). A busy
co-located persistent lane answers at once with a ``queued_work`` rejection, which is a spill.

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
from policy.spillover import SpilloverEstimator
from replicas.messages import GenerateRequest, GenerationChunk, GenerationError, Rejection, Started
from replicas.stream_channel import Relayed, StreamListener

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

POOL_REFRESH_S = 1.0
"""Seconds between the router's reads of the persistent engines (replica count, busy, healthy)."""
POOL_RECHECK_S = 0.05
"""A view of the persistent engines older than this that shows them busy with other routers' requests is
read again before an eligible request spills (``Router._persistent``): another router's request may have
ended since, and only the 1 s poll would tell."""
POOL_RECHECK_TIMEOUT_S = 0.25
"""How long that second read may take; past it the request goes by the view it has."""
READY_PROBE_TIMEOUT_S = 2.0
"""How long one readiness probe (a ``ping`` through a pool's handle) may take; past it ``/health`` answers
503 and the next call probes again."""
HEALTH_WAIT_S = 0.02
"""How long ``/health`` waits for a running readiness probe before it answers from the last known state."""
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
        app_name: the Serve application, to find the persistent engines (None: never read them; the
            router then treats a replica as free unless its own requests fill it).
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
        self.engine_lane = "colocated" if colocated else "persistent"
        self.in_flight = 0
        self.dispatching = 0
        self.spillovers = 0
        self.overloaded = 0
        self.pool_rechecks = 0  # second reads of the persistent engines before a spill (POOL_RECHECK_S)
        self.served = {Lane.PERSISTENT.value: 0, Lane.STANDARD.value: 0}
        """Requests whose output came from each lane (counted at their first chunk)."""
        self.caller = _this_actor()
        self.estimator = SpilloverEstimator()
        self._spill_counter = spillover_counter()
        self._unhealthy_until = 0.0
        self._unsupported_until = 0.0
        # the persistent pool as last read from its engines: (replicas, running there, ours running then)
        self._pool: tuple[int, int, int] | None = None
        self._pool_read_at = 0.0  # time.monotonic() of the read behind _pool
        self._engine_actors: list | None = None  # the persistent engines' handles, from the last full read
        self._poller: asyncio.Task | None = None
        self._pools_needed = ["standard"] + (["persistent"] if persistent is not None and wait_for_persistent else [])
        self._reached: set[str] = set()
        self._probe_lock = asyncio.Lock()
        self._first_probe: asyncio.Future | None = None  # the one probe a request waits for (first_requests_probe)
        self._health_probe: asyncio.Future | None = None  # the background probe /health reports on (readiness)
        self.direct_stream = direct_stream
        self._listener: StreamListener | None = None
        self._listener_lock = asyncio.Lock()
        self.direct_dispatches = 0
        """Dispatches whose output came over the direct stream (the rest came back through Ray)."""

    def _status(self) -> PersistentLaneStatus:
        # capacity is decided per request by the spillover rule (_wait_budget), not here
        return PersistentLaneStatus(
            available=self.persistent is not None,
            healthy=time.monotonic() >= self._unhealthy_until,
            envelope_supported=time.monotonic() >= self._unsupported_until,
            has_capacity=True,
        )

    def stats(self) -> dict:
        """Router counters and spillover estimates for ``/debug/stats``."""
        replicas = None if self._pool is None else self._pool[0]
        direct = {"enabled": self.direct_stream, "dispatches": self.direct_dispatches,
                  **(self._listener.stats() if self._listener is not None else {})}
        return {"persistent_in_flight": self.in_flight, "spillovers": self.spillovers, "direct_stream": direct,
                "overloaded": self.overloaded, "served": dict(self.served), "persistent_replicas_seen": replicas,
                "pool_rechecks": self.pool_rechecks,
                "persistent_free": self._free_replicas(), "estimates": self.estimator.snapshot()}

    # ---- readiness and the persistent pool's view ----------------------------------------
    async def missing_pools(self) -> list[str]:
        """The pools this router has not reached yet (``[]``: ready). Each missing pool gets one ``ping``
        through its handle (the same handle requests use, so its replicas are resolved afterwards), all at
        once, each waiting at most ``READY_PROBE_TIMEOUT_S``; so this may take that long."""
        await self._ensure_listener()
        async with self._probe_lock:
            todo = [name for name in self._pools_needed if name not in self._reached]
            reached = await asyncio.gather(*(self._probe(name) for name in todo))
            self._ensure_poller()
            return [name for name, ok in zip(todo, reached, strict=True) if not ok]

    async def _probe(self, name: str) -> bool:
        """One ``ping`` through pool ``name``'s handle; True (and the pool marked reached) when it answered."""
        handle = self.standard if name == "standard" else self.persistent
        try:
            await asyncio.wait_for(handle.ping.remote(), timeout=READY_PROBE_TIMEOUT_S)
            if name == "persistent":
                await self._refresh_pool()  # know the pool before the first request
        except Exception:  # noqa: BLE001 - not reachable yet (deploying, replaced, timed out)
            return False
        self._reached.add(name)
        return True

    async def readiness(self) -> list[str]:
        """What ``/health`` reports, within about ``HEALTH_WAIT_S``: the pools not reached yet (``[]``: ready).

        While a pool is missing, a probe (:meth:`missing_pools`) runs in the background, one at a time; this
        waits for it at most ``HEALTH_WAIT_S`` and answers from the last known state, so a readiness probe
        with a short timeout (Kubernetes' default is 1 s) gets its 503 instead of a timeout. Once every pool
        was reached the answer is ``[]`` at once, for good."""
        if len(self._reached) == len(self._pools_needed) and self._poller is not None:
            return []
        if self._health_probe is None or self._health_probe.done():
            self._health_probe = asyncio.ensure_future(self.missing_pools())
            self._health_probe.add_done_callback(_consume_exception)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self._health_probe), timeout=HEALTH_WAIT_S)
        return [name for name in self._pools_needed if name not in self._reached]

    async def _first_requests_probe(self) -> None:
        """Before this router's first requests: reach the pools once (:meth:`missing_pools`), unless
        ``/health`` on this ingress already reached them all. With several ingress replicas, ``/health``
        answered by one of them says nothing of the others' routers, and a router whose persistent handle has
        not resolved its replicas would spill a first greedy request to the standard lane. Requests arriving
        meanwhile share that one probe (each missing pool's ping waits at most ``READY_PROBE_TIMEOUT_S``, so
        a pool that is not up costs the first requests that much once); after it, reached or not, nobody
        waits for it again."""
        if self._first_probe is None:
            if len(self._reached) == len(self._pools_needed):
                return
            self._first_probe = asyncio.ensure_future(self.missing_pools())
        if not self._first_probe.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(self._first_probe)

    async def _ensure_listener(self) -> None:
        """Start this router's direct-stream listener on its node's address (once; off: never)."""
        if not self.direct_stream or self._listener is not None:
            return
        async with self._listener_lock:
            if self._listener is not None:
                return
            listener = StreamListener(_node_address())
            try:
                await listener.start()
            except OSError as exc:
                logger.warning("direct stream: cannot listen on %s (%s); output comes back through Ray",
                               listener.host, exc)
                self.direct_stream = False
                return
            self._listener = listener

    def _dispatch(self, request: GenerateRequest) -> tuple[GenerateRequest, asyncio.Queue | None]:
        """``request`` as one dispatch sends it: with a fresh :class:`ReplyTo` and its queue when the
        direct stream is on (close it with :meth:`_merged`, or ``_listener.close``), else unchanged."""
        if self._listener is None:
            return request, None
        reply_to, queue = self._listener.open()
        return dataclasses.replace(request, reply_to=reply_to), queue

    async def _merged(self, response, request: GenerateRequest, queue: asyncio.Queue | None, lane: str):
        """One dispatch's items: those its Serve stream ``response`` yields (replica failures turned into
        :class:`GenerationError` as :func:`_ended_by_error`) and, with ``queue``, those its engine sent
        over the direct stream.

        Ends at the engine's final frame (not waiting for the Ray call to return), or when the Serve
        stream ends and every item its :class:`Relayed` announced has arrived; one that has not within
        ``DIRECT_GRACE_S`` of the Serve stream's end ends the request with a ``stream_lost`` error.
        Closed early (client gone, caller stopped reading), it cancels the Serve stream.
        """
        ray_items = _ended_by_error(response, request.request_id, lane)
        if queue is None:
            async with contextlib.aclosing(ray_items) as items:
                async for item in items:
                    yield item
            return
        key = request.reply_to.key
        pump = asyncio.ensure_future(_pump(ray_items, queue))
        ended, expected, got, ray_ended = False, None, 0, False
        try:
            while not ended:
                if ray_ended:
                    try:
                        entry = await asyncio.wait_for(queue.get(), DIRECT_GRACE_S)
                    except asyncio.TimeoutError:
                        ended = True
                        yield GenerationError(request.request_id, "the engine's direct stream lost output; retry the "
                                              "request", lane, "postlaunch", "stream_lost")
                        return
                else:
                    entry = await queue.get()
                if entry is _RAY_END:
                    ray_ended = True
                    ended = expected is None or got >= expected
                elif isinstance(entry, _RayItem):
                    item = entry.item
                    if isinstance(item, BaseException):
                        ended = True
                        raise item
                    if isinstance(item, Relayed):
                        expected = item.items
                        ended = got >= expected
                        continue
                    # a rejection or an error ends it; chunks through Ray (no connection yet) end with the Ray call
                    ended = isinstance(item, (Rejection, GenerationError))
                    yield item
                else:
                    items, final = entry
                    self.direct_dispatches += not got
                    got += len(items)
                    ended = final
                    for item in items:
                        yield item
        finally:
            self._listener.close(key)
            if not ended:  # stopped early (the client went away): stop the dispatch too
                pump.cancel()
                response.cancel()

    def _ensure_poller(self) -> None:
        if self._poller is None and self.persistent is not None and self.app_name is not None:
            self._poller = asyncio.get_running_loop().create_task(self._poll_pool())

    async def _poll_pool(self) -> None:
        while True:
            try:
                await self._refresh_pool()
            except Exception:  # noqa: BLE001 - keep the last view; the next read may work
                pass
            await asyncio.sleep(POOL_REFRESH_S)

    async def _refresh_pool(self, recheck: bool = False) -> None:
        """Read the persistent engines: how many are healthy and how many of them are busy. ``recheck``:
        ask the engines of the last full read again, without the GCS look-up (the request path)."""
        if self.app_name is None:
            return
        from deployments.replicas import STATS_TIMEOUT_S, engine_actor_stats, engine_actors

        before, read_at = self.in_flight, time.monotonic()
        if not recheck or self._engine_actors is None:
            self._engine_actors = await engine_actors(self.engine_lane, self.app_name)
        engines = await engine_actor_stats(self.engine_lane, self.app_name, STATS_TIMEOUT_S, self._engine_actors)
        lanes = [e.get("lanes", {}).get("persistent", e) for e in engines]
        healthy = [e for e in lanes if e.get("decoder_healthy", True)]
        # ours that the engines may count: a request of ours started during the read would otherwise count
        # twice (as another router's and as ours) and hide a free replica for up to POOL_REFRESH_S
        mine = max(before, self.in_flight)
        self._pool = (len(healthy), sum(int(e.get("running", 0)) for e in healthy), mine)
        self._pool_read_at = read_at

    def _busy_view_is_stale(self) -> bool:
        """The last read showed other routers' requests on the persistent engines and is older than
        ``POOL_RECHECK_S``."""
        if self._pool is None:
            return False
        _, running, mine_then = self._pool
        return running > mine_then and time.monotonic() - self._pool_read_at > POOL_RECHECK_S

    def _free_replicas(self) -> int | None:
        """Persistent replicas believed free now: those last seen, less this router's requests (running
        and being dispatched) and the others' seen running then; None before the first read."""
        if self._pool is None:
            return None
        replicas, running, mine_then = self._pool
        others = max(0, running - mine_then)
        return replicas - others - self.in_flight - self.dispatching

    def _wait_budget(self) -> float | None:
        """How long this eligible request may wait for a persistent replica; None: spill now."""
        free = self._free_replicas()
        if free is None or (self._pool is not None and self._pool[0] == 0):
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

    async def _take_persistent(self, request: GenerateRequest, wait_s: float):
        """Send ``request`` to the persistent pool; the stream once a replica took it (first item
        :class:`Started`), else None (still queued after ``wait_s``, or refused by Serve's
        ``max_queued_requests``)."""
        entry = getattr(self.persistent.options(stream=True), self.persistent_entry)
        request, queue = self._dispatch(request)
        stream = entry.remote(request)
        first = asyncio.ensure_future(stream.__anext__())
        try:
            done, _ = await asyncio.wait({first}, timeout=wait_s)
        except asyncio.CancelledError:  # the client went away while queued
            stream.cancel()
            first.cancel()
            if queue is not None:
                self._listener.close(request.reply_to.key)
            raise
        if done and first.exception() is None and isinstance(first.result(), Started):
            return self._merged(stream, request, queue, Lane.PERSISTENT.value)
        if queue is not None:
            self._listener.close(request.reply_to.key)
        stream.cancel()  # still queued (or refused by Serve's max_queued_requests): drop it
        if not done:
            first.cancel()
        with contextlib.suppress(BaseException):
            await first
        return None

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
        self._ensure_poller()
        await self._ensure_listener()
        await self._first_requests_probe()
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
            sent, queue = self._dispatch(request)
            stream = self._merged(self.standard.options(stream=True).generate.remote(sent), sent, queue,
                                  Lane.STANDARD.value)
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
        if wait_s is None and self._busy_view_is_stale():  # busy with others' work, as of a while ago: look again
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._refresh_pool(recheck=True), POOL_RECHECK_TIMEOUT_S)
            self.pool_rechecks += 1
            wait_s = self._wait_budget()
        stream, started = None, time.monotonic()
        if wait_s is not None:
            self.dispatching += 1
            try:
                stream = await self._take_persistent(hop(request), wait_s)
            finally:
                self.dispatching -= 1
        if stream is None:
            self._spill(span, request.request_id, time.monotonic() - started if wait_s is not None else 0.0)
            yield _Outcome(done=False, spilled=True, fell_back=True)
            return
        rejected = None
        self.in_flight += 1
        self.estimator.started(request.request_id, request.params.max_tokens, started)
        try:
            async with contextlib.aclosing(stream) as items:
                async for item in items:
                    if isinstance(item, Rejection):
                        rejected = item
                        break
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
                    clock.chunk(item)
                    yield item
        finally:
            self.in_flight -= 1
            self.estimator.finished(request.request_id)
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


DIRECT_GRACE_S = 5.0
"""How long a dispatch whose Serve stream has ended waits for the rest of its direct-stream output before it
ends with a ``stream_lost`` error (the frames were written before the Ray call returned, so they are normally
there first)."""


class _RayItem:
    """An item (or exception) from a dispatch's Serve stream, in the dispatch's queue."""

    __slots__ = ("item",)

    def __init__(self, item):
        self.item = item


_RAY_END = object()
"""Queue entry: the dispatch's Serve stream has ended."""


def _consume_exception(future: asyncio.Future) -> None:
    """Done callback of a background probe: its exception (if any) is read, so asyncio does not log it."""
    if not future.cancelled():
        future.exception()


async def _pump(items, queue: asyncio.Queue) -> None:
    """Move a Serve stream's items (and an exception it raises) into a dispatch's queue, then ``_RAY_END``."""
    try:
        async for item in items:
            queue.put_nowait(_RayItem(item))
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # noqa: BLE001 - handed to the reader, which raises it
        queue.put_nowait(_RayItem(exc))
    queue.put_nowait(_RAY_END)


def _node_address() -> str:
    """This process's Ray node IP address (engines on other nodes can reach it), or 127.0.0.1 outside Ray."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


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


@dataclasses.dataclass
class _Outcome:
    """How a persistent attempt ended: ``done`` (served there), else go standard (``spilled`` for
    capacity, ``fell_back`` when the standard hop must be sampled)."""

    done: bool
    spilled: bool = False
    fell_back: bool = False

"""``PersistentReplica``, ``StandardReplica`` and ``ColocatedReplica``: Serve deployments wrapping an
engine actor.

Each replica is a thin async shell. Its engine (model, KV cache, lane) lives in
a Ray actor created in bundle 1 of the replica's own placement group, so one
replica = one bundle = one GPU on GPU machines, and the actor fate-shares with
its replica. The replica's health check fails when its persistent decoder was
marked unhealthy after a launch failure, so Serve replaces it.

When the engine process dies (a crash, the OOM killer, ``SIGKILL``), the requests
it was serving get a :class:`GenerationError` with reason ``engine_died`` (an
error event and the end of their stream), and Ray restarts the engine in the same
bundle (``ENGINE_MAX_RESTARTS``; its constructor reloads the model, the KV pool
starts full). Until it is back, the persistent replica rejects new requests
(``decoder_unhealthy``: they fall back to the standard lane) and the standard
replica's new requests wait for it. Once the restarts are used up the engine
stays dead, the health check fails and Serve replaces the replica.

When the ingress replica reading a stream dies, nothing tells the replica (Ray does not
cancel a streaming call whose caller died), so each replica polls the callers it streams to
(``CALLER_CHECK_S``) and cancels the engine work of a dead one's requests, freeing their pages.

``ColocatedReplica`` (``colocated=true``) hosts both lanes over one engine (one copy of the
weights, one KV page pool): ``generate`` is its standard entry, ``generate_persistent`` its
persistent one. After a persistent failure it keeps serving the standard lane and fails its health
check once that lane is idle, or ``COLOCATED_DRAIN_S`` after the failure, whichever comes first.

Every engine pushes its load record (:class:`policy.pool.LoadRecord`) to the application's pool board
(:mod:`replicas.pool_board`); the routers watch it (:mod:`deployments.pool_view`). Persistent replicas
report ``eligible_demand`` to Serve's autoscaler (``record_autoscaling_stats``), read from the same board:
the persistent requests running plus the eligible requests the routers spilled to the standard lane
(``deployments.autoscaling`` scales the pool on it). A replica's health check reads its own engine's record.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

import ray
from ray import serve
from ray.util import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ops.telemetry.tracing import (
    ATTR_LANE,
    ATTR_REQUEST_ID,
    SPAN_REPLICA,
    extract_context,
    get_tracer,
    inject_context,
    setup_tracing,
)
from policy.pool import PoolModel
from replicas.engine_actor import EngineActor
from replicas.messages import GenerateRequest, GenerationError, Rejection, Started
from replicas.pool_board import board_actor, board_name

ENGINE_MAX_RESTARTS = 3
"""How many times Ray restarts a replica's engine actor in place after its process died; after that
the replica's health check fails and Serve replaces the replica."""

ENGINE_DIED = "engine_died"
"""``GenerationError.reason`` of a request whose engine process died while serving it."""

CALLER_CHECK_S = 2.0
"""How often a replica checks that the ingress replicas it streams to are alive; the engine work of a
dead one's requests is cancelled (their pages freed) within about this long."""

ENGINE_ACTOR_PREFIX = "persistent-serve-engine-"
"""Engine actors are named ``<prefix><lane>-<id>@<app>`` so operators, benchmarks and the
ingress's ``/debug/stats`` can find them (see :func:`engine_actor_stats`)."""


STATS_TIMEOUT_S = 1.0
"""How long ``/debug/stats`` waits for one engine's stats (one that does not answer this fast, dead, restarting
or still loading its model, is left out), and the autoscaling metric for the pool board's snapshot."""
COLOCATED_DRAIN_S = 30.0
"""A co-located replica whose persistent decoder failed fails its health check (so Serve replaces it)
once its standard lane is idle, or this many seconds after the failure."""


def engine_actor_name(lane: str, app: str) -> str:
    """A fresh engine actor name for ``lane`` in the Serve application ``app``."""
    return f"{ENGINE_ACTOR_PREFIX}{lane}-{uuid.uuid4().hex[:8]}@{app}"


def _live_engine_actors(lane: str, app: str) -> list:
    """Handles of ``app``'s engine actors of ``lane`` (blocking GCS look-ups: call off the event loop)."""
    out = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if name.startswith(f"{ENGINE_ACTOR_PREFIX}{lane}-") and name.endswith(f"@{app}"):
            try:
                out.append(ray.get_actor(name, namespace=entry["namespace"]))
            except ValueError:  # gone since the listing (its replica was replaced)
                pass
    return out


async def engine_actor_stats(lane: str, app: str, timeout_s: float = STATS_TIMEOUT_S,
                             actors: list | None = None) -> list[dict]:
    """``stats()`` of every live engine actor of ``lane`` in ``app``, read from the actors directly.

    Not through the Serve handle: a persistent replica holds one request at a
    time (``max_ongoing_requests=1``), so a stats call would queue behind it.
    An actor dying meanwhile is skipped, and so is one that does not answer within
    ``timeout_s`` seconds (an engine still loading its model answers only once loaded).
    ``actors``: these handles (from :func:`engine_actors`) instead of a fresh GCS look-up.
    """
    if actors is None:
        actors = await engine_actors(lane, app)
    results = await asyncio.gather(*(asyncio.wait_for(_ask_stats(a), timeout_s) for a in actors),
                                   return_exceptions=True)
    return [r for r in results if isinstance(r, dict)]  # a dead, restarting or loading actor is skipped


async def engine_actors(lane: str, app: str) -> list:
    """Handles of ``app``'s live engine actors of ``lane`` (the GCS look-up runs in a worker thread)."""
    return await asyncio.to_thread(_live_engine_actors, lane, app)


async def _ask_stats(actor) -> dict:
    return await actor.stats.remote()


class _EngineReplica:
    lane: str = "standard"

    def __init__(self, config, engine_num_cpus: float, engine_num_gpus: float):
        setup_tracing(config.tracing)
        pg = get_current_placement_group()
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=1) if pg else None
        actor_cls = ray.remote(EngineActor)
        self.app_name = serve.get_replica_context().app_name
        self.actor = actor_cls.options(
            num_cpus=engine_num_cpus, num_gpus=engine_num_gpus, scheduling_strategy=strategy,
            max_concurrency=1000, name=engine_actor_name(self.lane, self.app_name),
            max_restarts=ENGINE_MAX_RESTARTS, max_task_retries=0,  # in-flight requests fail; new ones wait
        ).remote(
            config.engine, self.lane, config.persistent_decoder.value, config.persistent_backend,
            config.persistent_decoder_checkpoint, config.persistent_fault_injection, tracing=config.tracing,
            load_board=board_name(self.app_name),
        )
        # Block construction until the engine is loaded: a failed load fails the replica (and,
        # with --persistent-decoder required, the app) with the engine's own message.
        self.info = ray.get(self.actor.ready.remote())
        self._engine_down = False  # the engine died and is not back yet
        self._engine_watch: asyncio.Task | None = None
        self._callers: dict[str, dict] = {}  # caller actor id -> {"streams": {request id: stream}, "task"}
        self._orphaned: set[str] = set()  # request ids cancelled because their caller died

    def _engine_died(self) -> None:
        """The engine process died: wait in the background until Ray has restarted it."""
        if not self._engine_down:
            self._engine_down = True
            self._engine_watch = asyncio.ensure_future(self._await_engine())

    async def _await_engine(self) -> None:
        try:
            self.info = await self.actor.ready.remote()
            self._engine_down = False
        except ray.exceptions.RayActorError:
            pass  # restarts used up: stays down; check_health fails and Serve replaces the replica

    def _watch_caller(self, caller, request_id: str, stream) -> None:
        """Register ``stream`` under its caller; one watcher per caller polls that the caller is alive."""
        actor_id, handle = caller
        entry = self._callers.get(actor_id)
        if entry is None:
            entry = self._callers[actor_id] = {"streams": {}}
            entry["task"] = asyncio.ensure_future(self._caller_watch(actor_id, handle))
        entry["streams"][request_id] = stream

    async def _caller_watch(self, actor_id: str, handle) -> None:
        entry = self._callers[actor_id]
        while entry["streams"]:
            await asyncio.sleep(CALLER_CHECK_S)
            try:
                await asyncio.wait_for(handle.__ray_ready__.remote(), CALLER_CHECK_S)
            except asyncio.TimeoutError:
                continue  # busy, not dead
            except ray.exceptions.RayActorError:  # the ingress died: nobody reads these streams any more
                for request_id, stream in list(entry["streams"].items()):
                    self._orphaned.add(request_id)
                    ray.cancel(stream)
                break
        self._callers.pop(actor_id, None)

    async def generate(self, request: GenerateRequest):
        """Stream the engine actor's events for ``request`` (see ``replicas.messages``); the persistent
        pool first yields :class:`Started` so the router knows a replica took the request.

        Opens span ``replica.generate`` (child of the caller's span named by ``request.trace_context``)
        and hands the actor ``request`` with this span's trace context. If the engine process dies, the
        request ends with a :class:`GenerationError` (reason ``engine_died``); while the engine
        restarts, a persistent replica answers :class:`Rejection` (``decoder_unhealthy``).
        """
        async for item in self._stream(request, self.lane if self.lane != "colocated" else "standard"):
            yield item

    async def _stream(self, request: GenerateRequest, lane: str):
        if lane == "persistent":
            yield Started(request.request_id)
            if self._engine_down:
                yield Rejection(request.request_id, "decoder_unhealthy", detail="the engine is restarting")
                return
        span = get_tracer().start_span(SPAN_REPLICA, context=extract_context(request.trace_context),
                                       attributes={ATTR_LANE: lane, ATTR_REQUEST_ID: request.request_id})
        caller, request = request.caller, dataclasses.replace(request, trace_context=inject_context(span), caller=None)
        args = (request, lane) if self.lane == "colocated" else (request,)
        stream = self.actor.generate.options(num_returns="streaming").remote(*args)
        if caller is not None:
            self._watch_caller(caller, request.request_id, stream)
        finished = False
        try:
            async for ref in stream:
                yield await ref
            finished = True
        except ray.exceptions.TaskCancelledError:
            if request.request_id not in self._orphaned:
                raise
            finished = True  # its ingress died: the engine stopped it and freed its pages
            span.set_attribute("error.type", "caller_died")
        except ray.exceptions.RayActorError as exc:  # the engine process died under this request
            finished = True
            self._engine_died()
            span.set_attribute("error.type", ENGINE_DIED)
            yield GenerationError(request.request_id, f"the {lane} engine serving this request died ({type(exc).__name__}); "
                                  "the request was lost, retry it", lane, "postlaunch", ENGINE_DIED)
        finally:
            span.end()
            self._orphaned.discard(request.request_id)
            if caller is not None and caller[0] in self._callers:
                self._callers[caller[0]]["streams"].pop(request.request_id, None)
            if not finished:  # the caller went away (client disconnect): stop the actor's work too
                ray.cancel(stream)

    async def ping(self) -> dict:
        """A cheap round trip (the router's readiness probe): the lane this replica serves."""
        return {"lane": self.lane}

    async def stats(self) -> dict:
        """The engine's stats plus where it runs: the replica's and the actor's placement groups."""
        pg = get_current_placement_group()
        return {
            **(await self.actor.stats.remote()),
            "replica_placement_group_id": pg.id.hex() if pg else None,
            "engine_placement_group_id": self.info.get("placement_group_id"),
        }

    async def check_health(self) -> None:
        """Serve's health check: fails once this replica's persistent decoder was marked unhealthy (its engine's
        :class:`~policy.pool.LoadRecord`)."""
        record = await self.actor.load.remote()
        if record.decoder_failed:
            raise RuntimeError(f"persistent decoder unhealthy: {record.unhealthy_reason}")


async def eligible_demand(board) -> float:
    """Eligible requests of the application whose pool board is ``board`` (a :func:`board_actor` handle):
    persistent requests running plus requests spilled to the standard lane for capacity
    (:meth:`policy.pool.PoolModel.eligible_demand` over the engines' pushed records)."""
    _, records = await asyncio.wait_for(board.snapshot.remote(), STATS_TIMEOUT_S)
    return PoolModel(records).eligible_demand()


@serve.deployment(name="PersistentReplica", max_ongoing_requests=1, health_check_period_s=5)
class PersistentReplica(_EngineReplica):
    """Batch-one greedy decoding in quanta (the persistent lane)."""

    lane = "persistent"

    def __init__(self, config, engine_num_cpus: float, engine_num_gpus: float):
        super().__init__(config, engine_num_cpus, engine_num_gpus)
        self._board = board_actor(board_name(self.app_name))

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Custom autoscaling metric ``eligible_demand`` (read by ``deployments.autoscaling``)."""
        from deployments.autoscaling import ELIGIBLE_DEMAND

        try:
            return {ELIGIBLE_DEMAND: await eligible_demand(self._board)}
        except Exception:  # noqa: BLE001 - board gone or slow: this round scales on Serve's own count
            self._board = await asyncio.to_thread(board_actor, board_name(self.app_name))
            return {}


@serve.deployment(name="StandardReplica", max_ongoing_requests=64, health_check_period_s=10)
class StandardReplica(_EngineReplica):
    """Continuous batching for everything else (the standard lane)."""

    lane = "standard"


class ColocatedEngineReplica(_EngineReplica):
    """Both lanes over one engine (one copy of the weights, one KV page pool): the body of
    :class:`ColocatedReplica` and of :class:`~deployments.direct.DirectReplica` (not a deployment itself)."""

    lane = "colocated"

    def __init__(self, config, engine_num_cpus: float, engine_num_gpus: float):
        super().__init__(config, engine_num_cpus, engine_num_gpus)
        self._unhealthy_since: float | None = None

    async def generate_persistent(self, request: GenerateRequest):
        """The persistent entry: :class:`Started`, then the persistent lane's events for ``request`` (a busy lane
        answers at once with a ``queued_work`` rejection: the router spills it)."""
        async for item in self._stream(request, "persistent"):
            yield item

    async def check_health(self) -> None:
        """Fails once the persistent decoder was marked unhealthy and the standard lane is idle, or
        ``COLOCATED_DRAIN_S`` after it was marked (the engine's :class:`~policy.pool.LoadRecord`)."""
        record = await self.actor.load.remote()
        if not record.decoder_failed:
            self._unhealthy_since = None
            return
        now = time.monotonic()
        self._unhealthy_since = self._unhealthy_since or now
        if record.standard_idle or now - self._unhealthy_since >= COLOCATED_DRAIN_S:
            raise RuntimeError(f"persistent decoder unhealthy: {record.unhealthy_reason}")


@serve.deployment(name="ColocatedReplica", max_ongoing_requests=65, health_check_period_s=5)
class ColocatedReplica(ColocatedEngineReplica):
    """Both lanes over one engine (one copy of the weights, one KV page pool): one replica per GPU, called by the
    ingress's router through its Serve handle."""

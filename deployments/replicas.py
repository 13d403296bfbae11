"""``PersistentReplica`` and ``StandardReplica``: Serve deployments wrapping an engine actor.

Each replica is a thin async shell. Its engine (model, KV cache, lane) lives in
a Ray actor created in bundle 1 of the replica's own placement group, so one
replica = one bundle = one GPU on GPU machines, and the actor fate-shares with
its replica. The replica's health check fails when its persistent decoder was
marked unhealthy after a launch failure, so Serve replaces it.
"""

from __future__ import annotations

import dataclasses
import uuid

import ray
from ray import serve
from ray.util import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ops.tracing import (
    ATTR_LANE,
    ATTR_REQUEST_ID,
    SPAN_REPLICA,
    extract_context,
    get_tracer,
    inject_context,
    setup_tracing,
)
from replicas.engine_actor import EngineActor
from replicas.messages import GenerateRequest

ENGINE_ACTOR_PREFIX = "persistent-serve-engine-"
"""Engine actors are named ``<prefix><lane>-<id>`` so operators and benchmarks can find them."""


class _EngineReplica:
    lane: str = "standard"

    def __init__(self, config, engine_num_cpus: float, engine_num_gpus: float):
        setup_tracing(config.tracing)
        pg = get_current_placement_group()
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=1) if pg else None
        actor_cls = ray.remote(EngineActor)
        self.actor = actor_cls.options(
            num_cpus=engine_num_cpus, num_gpus=engine_num_gpus, scheduling_strategy=strategy,
            max_concurrency=1000, name=f"{ENGINE_ACTOR_PREFIX}{self.lane}-{uuid.uuid4().hex[:8]}",
        ).remote(
            config.engine, self.lane, config.persistent_decoder.value, config.persistent_backend,
            config.persistent_decoder_checkpoint, tracing=config.tracing,
        )
        # Block construction until the engine is loaded: a failed load fails the replica (and,
        # with --persistent-decoder required, the app) with the engine's own message.
        self.info = ray.get(self.actor.ready.remote())

    async def generate(self, g: GenerateRequest):
        """Stream the engine actor's events for ``g`` (see ``replicas.messages``).

        Opens span ``replica.generate`` (child of the caller's span named by ``g.trace_context``)
        and hands the actor ``g`` with this span's trace context.
        """
        span = get_tracer().start_span(SPAN_REPLICA, context=extract_context(g.trace_context),
                                       attributes={ATTR_LANE: self.lane, ATTR_REQUEST_ID: g.request_id})
        g = dataclasses.replace(g, trace_context=inject_context(span))
        stream = self.actor.generate.options(num_returns="streaming").remote(g)
        finished = False
        try:
            async for ref in stream:
                yield await ref
            finished = True
        finally:
            span.end()
            if not finished:  # the caller went away (client disconnect): stop the actor's work too
                ray.cancel(stream)

    async def stats(self) -> dict:
        """The engine's stats plus where it runs: the replica's and the actor's placement groups."""
        pg = get_current_placement_group()
        return {
            **(await self.actor.stats.remote()),
            "replica_placement_group_id": pg.id.hex() if pg else None,
            "engine_placement_group_id": self.info.get("placement_group_id"),
        }

    async def check_health(self) -> None:
        stats = await self.actor.stats.remote()
        if stats.get("backend") and not stats.get("decoder_healthy", True):
            raise RuntimeError(f"persistent decoder unhealthy: {stats.get('unhealthy_reason')}")


@serve.deployment(name="PersistentReplica", max_ongoing_requests=4, health_check_period_s=5)
class PersistentReplica(_EngineReplica):
    """Batch-one greedy decoding in quanta (the persistent lane)."""

    lane = "persistent"


@serve.deployment(name="StandardReplica", max_ongoing_requests=64, health_check_period_s=10)
class StandardReplica(_EngineReplica):
    """Continuous batching for everything else (the standard lane)."""

    lane = "standard"

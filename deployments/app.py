"""Build the Serve application: ingress (with the router) + persistent and standard pools.

``serve run deployments.app:app`` serves the embedded default model with
``--persistent-decoder auto``; ``serve run deployments.app:build_app
persistent-decoder=off model=/path/to/hf-dir`` passes arguments; ``colocated=true`` deploys one
co-located pool (both lanes per replica) instead of the two pools; ``topology=direct`` deploys only co-located
replicas that are also the HTTP ingress (:mod:`deployments.direct`).
"""

from __future__ import annotations

from ray.serve import Application

from deployments.config import AppConfig
from deployments.driver import prepare_serve_run_driver
from deployments.ingress import OpenAIIngress
from deployments.pools import PoolConfig
from deployments.replicas import ColocatedReplica, PersistentReplica, StandardReplica

REPLICA_CPUS = 0.05
"""CPUs of a replica's own bundle (the thin async shell; the engine actor has bundle 1)."""

INGRESS_HEALTH_CHECK_S = 2.0
"""Health-check period of the ingress (Serve's default is 10 s): a dead ingress process is noticed, and
replaced, this much sooner (docs/reliability.md). Its check is Serve's no-op, so it costs nothing."""


def _pool(deployment, config: AppConfig, pool: PoolConfig, extra_ongoing: int = 0):
    """One lane's deployment: the pool's Serve/autoscaling options, one placement group per replica
    (bundle 0: the replica shell; bundle 1: its engine actor with the pool's GPUs). ``extra_ongoing``
    requests are added to the pool's ``max_ongoing_requests`` (the co-located persistent lane's one)."""
    gpus = config.gpus_per_engine(pool)
    engine_bundle = pool.engine_bundle(config.engine_num_cpus, gpus)
    options = pool.serve_options()
    options["max_ongoing_requests"] += extra_ongoing
    return deployment.options(
        **options,
        ray_actor_options={"num_cpus": REPLICA_CPUS},
        placement_group_bundles=[{"CPU": REPLICA_CPUS}, engine_bundle],
        placement_group_strategy="STRICT_PACK",
    ).bind(config, config.engine_num_cpus, gpus)


def console_tracing(config: AppConfig) -> bool:
    """Whether the app's spans go to the console exporter (``OTEL_TRACES_EXPORTER`` counted)."""
    try:
        return config.tracing.resolved().exporter == "console"
    except ValueError:  # an unsupported OTEL_* value: the replicas' setup_tracing reports it
        return False


def build_app(args: dict | AppConfig | None = None) -> Application:
    """The Serve application for ``args`` (a dict of CLI-style keys, or an :class:`AppConfig`).

    In ``serve run``'s own process (before it starts Ray) it first checks that Serve's HTTP port is free and
    exits with one line saying how to change it if not, and with the ``console`` trace exporter turns off
    Ray's log deduplication there so spans print whole (:mod:`deployments.driver`).

    Raises:
        pydantic.ValidationError: bad arguments (e.g. ``required`` with a missing checkpoint).
        SystemExit: in ``serve run``'s process, the model is not on this machine or the HTTP port is taken.
    """
    config = args if isinstance(args, AppConfig) else AppConfig.from_args(args)
    prepare_serve_run_driver(console_tracing(config), config.engine.model)  # serve run's own process: model and
    # port checks, whole spans
    if config.direct:  # one deployment: co-located replicas that are the ingress too, each routing to its own engine
        from deployments.direct import DirectReplica

        return _pool(DirectReplica, config, config.standard_pool, extra_ongoing=1)
    if config.colocated_enabled:  # one deployment, both lanes: the router calls its two entries
        both = _pool(ColocatedReplica, config, config.standard_pool, extra_ongoing=1)
        return OpenAIIngress.options(ray_actor_options={"num_cpus": REPLICA_CPUS}, num_replicas=config.ingress_replicas,
                                     health_check_period_s=INGRESS_HEALTH_CHECK_S).bind(config, both, both)
    standard = _pool(StandardReplica, config, config.standard_pool)
    persistent = _pool(PersistentReplica, config, config.persistent_pool) if config.persistent_enabled else None
    return OpenAIIngress.options(ray_actor_options={"num_cpus": REPLICA_CPUS}, num_replicas=config.ingress_replicas,
                                 health_check_period_s=INGRESS_HEALTH_CHECK_S).bind(config, persistent, standard)


app = build_app({})

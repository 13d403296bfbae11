"""Application configuration: one pydantic model for the whole Serve app.

Accepts the CLI's and ``serve run ... key=value`` spellings
(``persistent-decoder`` or ``persistent_decoder``).
"""

from __future__ import annotations

import json
import types
import typing
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deployments.pools import PoolConfig, persistent_pool_defaults, standard_pool_defaults
from deployments.security import RequestLimits, SecurityConfig
from ops.telemetry.tracing import TracingConfig
from policy import Mode
from replicas.config import EngineConfig
from replicas.persistent.checkpoint import CheckpointError, check_checkpoint_dir
from replicas.persistent.contract import PERSISTENT_BACKENDS
from replicas.persistent.faults import FaultInjection
from replicas.registry import OneOf


class AppConfig(BaseModel):
    """Everything ``build_app`` needs. Every field can come from ``serve run`` args or the CLI."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: EngineConfig = Field(default_factory=EngineConfig, description="Engine settings shared by both lanes.")
    persistent_decoder: Mode = Field(
        Mode.AUTO,
        description="off: everything on the standard lane; auto: batch-one greedy requests on the persistent "
        "lane, fall back when it cannot serve; required: like auto, but refuse to start without a decoder.",
    )
    persistent_decoder_checkpoint: str | None = Field(
        None, description="Directory of the persistent-decoder checkpoint (manifest + safetensors)."
    )
    persistent_backend: Annotated[str, OneOf(PERSISTENT_BACKENDS, fixed=("auto",))] = Field(
        "auto",
        description="Persistent backend: eager (reference, any device); cuda_graph (NVIDIA: quanta as CUDA "
        "graphs); mk1 (AMD aiter MK1 on MI355X, "
        "needs AMD's aiter built from source); auto picks the best available.",
    )
    num_persistent_replicas: int | None = Field(
        None, ge=0, description="Shorthand for a fixed-size persistent pool (min = max = this many replicas)."
    )
    num_standard_replicas: int | None = Field(
        None, ge=1, description="Shorthand for a fixed-size standard pool (min = max = this many replicas)."
    )
    persistent_pool: PoolConfig = Field(
        default_factory=persistent_pool_defaults,
        description="Serve/autoscaling options of the persistent pool (batch one: max_ongoing_requests=1).",
    )
    standard_pool: PoolConfig = Field(
        default_factory=standard_pool_defaults, description="Serve/autoscaling options of the standard pool."
    )
    spillover_wait_s: float = Field(
        0.5, ge=0, description="auto/required: the longest an eligible request waits for a persistent replica "
        "(a dispatch to a replica believed free, or a wait the router's estimates justify: docs/architecture.md, "
        "Spillover) before it goes to the standard lane (reason persistent_capacity). With every persistent "
        "replica busy and none about to free up, it goes standard at once.",
    )
    colocated: bool = Field(
        False, description="One replica per GPU hosting both lanes over one copy of the weights and one KV page "
        "pool (for a single GPU, or a model too large for two copies): the router still picks the lane per "
        "request and the engine runs standard steps and persistent quanta in turn. The co-located pool takes "
        "the standard_pool options (one more ongoing request, for the persistent lane); persistent_pool is "
        "unused. Needs persistent-decoder auto or required (off deploys the standard pool alone).",
    )
    topology: Literal["pools", "direct"] = Field(
        "pools", description="pools: an ingress deployment (HTTP, templates, the router) in front of the replica "
        "deployments, each request one Serve handle call from the ingress to a replica (colocated picks which "
        "replicas). direct: the app is one deployment of co-located replicas that are also the HTTP ingress; each "
        "replica routes its requests to its own engine's lanes, in process (docs/architecture.md, Topologies). "
        "Its replicas take the standard_pool options (one more ongoing request, for the persistent lane); "
        "Serve's proxy (or HAProxy) spreads requests over them; ingress_replicas and persistent_pool are unused. "
        "Needs persistent-decoder auto or required.",
    )
    ingress_replicas: int = Field(
        1, ge=1, description="Ingress replicas (HTTP, templates, the router; like vLLM's --api-server-count): "
        "each one spends CPU on every streamed token (docs/decisions/0004-ingress-replicas.md has the H200 figure), "
        "so many concurrent streams need several. Serve's proxy spreads requests over "
        "them; each has its own router, which reaches the pools before its first request is routed.",
    )
    direct_stream: bool = Field(
        True, description="Engines send each request's output straight to the ingress process that reads it, "
        "over one TCP connection per engine and ingress (docs/architecture.md, Direct output streams), instead "
        "of back through the replica (two Ray hops per chunk). The request itself still goes through Serve. "
        "The ingress listens on its node's address at a free port; false: every chunk comes back through Ray.",
    )
    persistent_fault_injection: FaultInjection | None = Field(
        None, description="Tests only: make the persistent backend fail on purpose. Off by default.",
    )
    engine_num_cpus: float = Field(0.5, gt=0, description="CPUs reserved for each engine actor's bundle.")
    engine_num_gpus: float | None = Field(
        None, ge=0, description="GPUs per engine actor; default 1 when the engine device is CUDA, else 0."
    )
    tracing: TracingConfig = Field(default_factory=TracingConfig, description="OpenTelemetry exporter settings.")
    security: SecurityConfig = Field(
        default_factory=SecurityConfig, description="API keys and special tokens in client text (keys flat: api_key)."
    )
    limits: RequestLimits = Field(
        default_factory=RequestLimits, description="Bounds on one request: body bytes and timeouts, prompt characters, "
        "messages, stop strings, n, max_tokens (keys flat: max_request_body_bytes ...).",
    )
    harmony_start_date: str = Field(
        "today", pattern=r"^(today|none|\d{4}-\d{2}-\d{2})$",
        description="Harmony (GPT-OSS) prompts: the system message's `Current date:` line: today (the "
        "ingress's local date, as vLLM), none (no line), or a fixed YYYY-MM-DD date.",
    )

    @model_validator(mode="before")
    @classmethod
    def _replica_shorthands(cls, data):
        """Pool dicts are merged onto their lane's defaults; ``num_*_replicas=N`` pins that pool to N."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for lane, defaults in (("persistent", persistent_pool_defaults), ("standard", standard_pool_defaults)):
            pool = data.get(f"{lane}_pool")
            if isinstance(pool, PoolConfig):
                pool = pool.model_dump(exclude_unset=True)
            pool = {**defaults().model_dump(), **(pool or {})}
            n = data.get(f"num_{lane}_replicas")
            if n is not None:
                pool.update(min_replicas=n, max_replicas=n, initial_replicas=None)
            data[f"{lane}_pool"] = pool
        return data

    @model_validator(mode="after")
    def _check(self) -> AppConfig:
        if self.standard_pool.max_replicas < 1:
            raise ValueError("the standard pool needs at least one replica (max_replicas >= 1)")
        if self.direct and self.persistent_decoder is Mode.OFF:
            raise ValueError("topology=direct needs persistent-decoder auto or required (with off, use the default "
                             "topology=pools)")
        if (self.persistent_decoder is Mode.REQUIRED and self.persistent_pool.max_replicas < 1 and not self.colocated
                and not self.direct):
            raise ValueError("persistent-decoder=required needs at least one persistent replica")
        ckpt = self.persistent_decoder_checkpoint
        if self.persistent_decoder is Mode.REQUIRED and ckpt is not None:
            try:
                check_checkpoint_dir(ckpt)
            except CheckpointError as exc:
                raise ValueError(
                    f"persistent-decoder=required, but the persistent decoder cannot be loaded: {exc}. "
                    "Fix the checkpoint or use persistent-decoder=auto."
                ) from exc
        return self

    @property
    def direct(self) -> bool:
        """The app is one deployment of co-located replicas that are also the ingress (``topology=direct``)."""
        return self.topology == "direct"

    @property
    def persistent_enabled(self) -> bool:
        if self.colocated or self.direct:
            return self.persistent_decoder is not Mode.OFF
        return self.persistent_decoder is not Mode.OFF and self.persistent_pool.max_replicas > 0

    @property
    def colocated_enabled(self) -> bool:
        """Both lanes in one co-located deployment (``colocated`` with the persistent decoder on)."""
        return self.colocated and self.persistent_decoder is not Mode.OFF

    def gpus_per_engine(self, pool: PoolConfig | None = None) -> float:
        """GPUs for one engine actor of ``pool``: the pool's ``num_gpus``, else ``engine_num_gpus``,
        else 1 on a CUDA device and 0 on CPU."""
        if pool is not None and pool.num_gpus is not None:
            return pool.num_gpus
        if self.engine_num_gpus is not None:
            return self.engine_num_gpus
        return 1.0 if self.engine.resolved_device().type == "cuda" else 0.0

    @classmethod
    def from_args(cls, args: dict | None) -> AppConfig:
        """Build from a flat dict (``serve run`` args / CLI); engine, tracing, security and limits keys may be
        flat. A string given for a dict, list or nested-model field (``serve run ... moe_tiles='{"down_pairs": 1}'``)
        is parsed as JSON.

        Raises:
            pydantic.ValidationError: unknown keys or bad values.
            ValueError: a string for such a field that is not JSON.
        """
        args = {str(k).replace("-", "_"): v for k, v in (args or {}).items()}
        engine = dict(args.pop("engine", {}) or {})
        tracing = dict(args.pop("tracing", {}) or {})
        nested = {name: dict(args.pop(name, {}) or {}) for name in ("security", "limits")}
        for key in list(args):
            if key in EngineConfig.model_fields:
                engine[key] = _json_if_structured(EngineConfig, key, args.pop(key))
            elif key.startswith("tracing_") and key[8:] in TracingConfig.model_fields:
                tracing[key[8:]] = args.pop(key)
            elif key in SecurityConfig.model_fields:
                nested["security"][key] = args.pop(key)
            elif key in RequestLimits.model_fields:
                nested["limits"][key] = args.pop(key)
            elif key in cls.model_fields:
                args[key] = _json_if_structured(cls, key, args[key])
        return cls(engine=EngineConfig(**engine), tracing=TracingConfig(**tracing),
                   security=SecurityConfig(**nested["security"]), limits=RequestLimits(**nested["limits"]), **args)


def _json_if_structured(model: type[BaseModel], key: str, value):
    """``value`` parsed as JSON when it is a string and ``model.key`` holds a dict, list, tuple or model."""
    if not isinstance(value, str):
        return value
    annotation = model.model_fields[key].annotation
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    args = [a for a in typing.get_args(annotation) if a is not type(None)] if union else [annotation]
    structured = any(typing.get_origin(a) in (dict, list, tuple) or a in (dict, list, tuple)
                     or (isinstance(a, type) and issubclass(a, BaseModel)) for a in args)
    if not structured:
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{key}: expected JSON, got {value!r} ({exc})") from None

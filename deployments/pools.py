"""Per-pool Serve settings: replica bounds, autoscaling targets and queue limits.

Each lane is its own Serve deployment with its own autoscaling policy. The
persistent pool decodes one request at a time per replica, so its defaults are
``max_ongoing_requests=1`` and ``target_ongoing_requests=1``; the standard pool
batches, so its target is the engine's batch size. The field names and their
meaning are Ray Serve's (``ray.serve.config.AutoscalingConfig`` and
``@serve.deployment`` options), so the YAML reads like any Serve config.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deployments.autoscaling import POLICY_PATH


class PoolConfig(BaseModel):
    """Serve options of one lane's pool (one replica = one engine = one GPU on GPU machines).

    ``min_replicas == max_replicas`` gives a fixed-size pool (no autoscaling
    config is passed to Serve); otherwise the pool's ``autoscaling_metric`` per replica
    is kept near ``target_ongoing_requests``: Serve's ongoing requests (its default
    policy), or the eligible demand (``deployments.autoscaling``, the persistent pool's default).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(1, ge=0, description="Fewest replicas (autoscaling lower bound).")
    max_replicas: int = Field(1, ge=0, description="Most replicas (autoscaling upper bound; on GPU at most one per GPU).")
    initial_replicas: int | None = Field(None, ge=0, description="Replicas at deploy time (default: min_replicas).")
    target_ongoing_requests: float = Field(
        1.0, gt=0, description="Autoscaling target: ongoing requests per replica (Serve's target_ongoing_requests)."
    )
    max_ongoing_requests: int = Field(
        1, ge=1, description="Requests a replica holds at once; more wait in the caller's queue (Serve's option)."
    )
    max_queued_requests: int = Field(
        -1, ge=-1, description="Requests that may wait for a replica before Serve rejects new ones with "
        "back-pressure (-1: unbounded). The ingress turns that into 503 + Retry-After.",
    )
    upscale_delay_s: float = Field(30.0, ge=0, description="Sustained demand needed before adding replicas.")
    downscale_delay_s: float = Field(600.0, ge=0, description="Sustained idleness needed before removing replicas.")
    look_back_period_s: float = Field(30.0, gt=0, description="Window averaged for the autoscaling decision.")
    metrics_interval_s: float = Field(10.0, gt=0, description="How often replicas/handles report load.")
    health_check_period_s: float = Field(10.0, gt=0, description="Seconds between replica health checks.")
    autoscaling_metric: Literal["ongoing_requests", "eligible_demand"] = Field(
        "ongoing_requests", description="What the pool scales on: ongoing_requests (Serve's default policy: "
        "requests running and queued at its replicas) or eligible_demand (persistent requests running plus "
        "eligible requests spilled to the standard lane for capacity: the persistent pool's default, since "
        "the router does not queue eligible requests behind busy replicas).",
    )
    num_gpus: float | None = Field(
        None, ge=0, description="GPUs per engine of this pool (default: the app's engine_num_gpus rule)."
    )

    accelerator_type: str | None = Field(
        None, description="Only place engines on nodes advertising resource `accelerator_type:<this>` "
        "(Ray's convention, e.g. AMD-Instinct-MI355X-OAM); None: any node with the GPUs.",
    )

    @model_validator(mode="after")
    def _check(self) -> PoolConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas={self.min_replicas} > max_replicas={self.max_replicas}")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError("initial_replicas must lie within [min_replicas, max_replicas]")
        return self

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas != self.max_replicas

    def serve_options(self) -> dict:
        """Keyword arguments for ``Deployment.options``: fixed ``num_replicas`` or an ``autoscaling_config``."""
        opts: dict = {
            "max_ongoing_requests": self.max_ongoing_requests,
            "max_queued_requests": self.max_queued_requests,
            "health_check_period_s": self.health_check_period_s,
        }
        if not self.autoscaling:
            opts["num_replicas"] = self.max_replicas
            return opts
        opts["autoscaling_config"] = {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "initial_replicas": self.initial_replicas,
            "target_ongoing_requests": self.target_ongoing_requests,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
            "look_back_period_s": self.look_back_period_s,
            "metrics_interval_s": self.metrics_interval_s,
        }
        if self.autoscaling_metric == "eligible_demand":
            opts["autoscaling_config"]["policy"] = {"policy_function": POLICY_PATH}
        return opts

    def engine_bundle(self, num_cpus: float, num_gpus: float) -> dict:
        """The engine actor's placement-group bundle: its CPUs, GPUs and accelerator type."""
        bundle: dict = {"CPU": num_cpus}
        if num_gpus:
            bundle["GPU"] = num_gpus
        if self.accelerator_type:
            bundle[f"accelerator_type:{self.accelerator_type}"] = ACCELERATOR_SHARE
        return bundle


ACCELERATOR_SHARE = 0.001
"""Amount of the ``accelerator_type:<type>`` resource a bundle asks for (Ray's own convention)."""


def persistent_pool_defaults() -> PoolConfig:
    """Batch one: one request per replica, autoscaling target 1 on the eligible demand."""
    return PoolConfig(max_ongoing_requests=1, target_ongoing_requests=1.0, health_check_period_s=5.0,
                      autoscaling_metric="eligible_demand")


def standard_pool_defaults() -> PoolConfig:
    """Continuous batching: target the engine's default batch (max_num_seqs=32), hold up to 64."""
    return PoolConfig(max_ongoing_requests=64, target_ongoing_requests=32.0)

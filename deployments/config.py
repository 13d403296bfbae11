"""Application configuration: one pydantic model for the whole Serve app.

Accepts the CLI's and ``serve run ... key=value`` spellings
(``persistent-decoder`` or ``persistent_decoder``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ops.tracing import TracingConfig
from policy import Mode
from replicas.config import EngineConfig
from replicas.persistent.checkpoint import CheckpointError, check_checkpoint_dir


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
    persistent_backend: Literal["auto", "eager", "cuda_graph", "mk1"] = Field(
        "auto",
        description="Persistent backend: eager (reference, any device); cuda_graph (NVIDIA: quanta as CUDA "
        "graphs); mk1 (AMD aiter MK1 on MI355X, "
        "needs AMD's aiter built from source); auto picks the best available.",
    )
    num_persistent_replicas: int = Field(1, ge=0, description="Persistent-lane replicas (one GPU each on GPU).")
    num_standard_replicas: int = Field(1, ge=1, description="Standard-lane replicas (one GPU each on GPU).")
    engine_num_cpus: float = Field(0.5, gt=0, description="CPUs reserved for each engine actor's bundle.")
    engine_num_gpus: float | None = Field(
        None, ge=0, description="GPUs per engine actor; default 1 when the engine device is CUDA, else 0."
    )
    tracing: TracingConfig = Field(default_factory=TracingConfig, description="OpenTelemetry exporter settings.")

    @model_validator(mode="after")
    def _check(self) -> AppConfig:
        if self.persistent_decoder is Mode.REQUIRED and self.num_persistent_replicas < 1:
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
    def persistent_enabled(self) -> bool:
        return self.persistent_decoder is not Mode.OFF and self.num_persistent_replicas > 0

    def gpus_per_engine(self) -> float:
        if self.engine_num_gpus is not None:
            return self.engine_num_gpus
        return 1.0 if self.engine.resolved_device().type == "cuda" else 0.0

    @classmethod
    def from_args(cls, args: dict | None) -> AppConfig:
        """Build from a flat dict (``serve run`` args / CLI); engine and tracing keys may be flat.

        Raises:
            pydantic.ValidationError: unknown keys or bad values.
        """
        args = {str(k).replace("-", "_"): v for k, v in (args or {}).items()}
        engine = dict(args.pop("engine", {}) or {})
        tracing = dict(args.pop("tracing", {}) or {})
        for key in list(args):
            if key in EngineConfig.model_fields:
                engine[key] = args.pop(key)
            elif key.startswith("tracing_") and key[8:] in TracingConfig.model_fields:
                tracing[key[8:]] = args.pop(key)
        return cls(engine=EngineConfig(**engine), tracing=TracingConfig(**tracing), **args)

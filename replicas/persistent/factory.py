"""Create the persistent backend a replica asked for."""

from __future__ import annotations

import torch

from replicas.engine import EngineCore
from replicas.persistent import BACKENDS
from replicas.persistent.checkpoint import check_checkpoint_dir
from replicas.persistent.contract import PersistentBackend, UnsupportedConfigurationError
from replicas.persistent.eager import EagerBackend


def create_backend(kind: str, core: EngineCore, checkpoint: str | None = None) -> PersistentBackend:
    """Build (not yet bound) the backend ``kind`` for ``core``.

    ``kind`` is one of :data:`replicas.persistent.BACKENDS`. ``auto`` picks ``cuda_graph`` on a CUDA
    device when the model has a static decode step, else ``eager``; ``mk1`` (AMD gfx950 only) must be asked for by
    name: :meth:`~replicas.persistent.mk1.MK1Backend.for_core` checks its
    envelope, imports ``aiter.MK1`` and loads ``checkpoint``. The eager
    backend decodes with the engine's own weights; a checkpoint, when given,
    must pass :func:`~replicas.persistent.checkpoint.check_checkpoint_dir`
    (loading persistent weights from it comes with the GPT-OSS checkpoint work).

    Raises:
        UnsupportedConfigurationError: unknown backend.
        CheckpointError: bad checkpoint directory.
        NativeBinaryError: ``mk1`` and ``aiter.MK1`` cannot be imported.
    """
    if kind not in BACKENDS:
        raise UnsupportedConfigurationError(f"unknown persistent backend {kind!r}; choose from {', '.join(BACKENDS)}")
    if kind == "mk1":
        from replicas.persistent.mk1 import MK1Backend  # lazy: only the mk1 lane needs it

        return MK1Backend.for_core(core, checkpoint)
    if checkpoint:
        check_checkpoint_dir(checkpoint)
    device = core.runner.device
    graphs_fit = torch.device(device).type == "cuda" and hasattr(core.model, "decode_static")
    if kind == "cuda_graph" or (kind == "auto" and graphs_fit):
        from replicas.persistent.cuda_graph import CudaGraphBackend

        return CudaGraphBackend(core.model, device, core.config.max_model_len,
                                fused_epilogue=core.config.fused_greedy_epilogue)
    return EagerBackend(core.model, device)


def backend_takes_cached_pages(kind: str) -> bool:
    """Whether the backend ``kind`` resolves to can start requests from prefix-cached pages
    (:attr:`~replicas.persistent.contract.PersistentBackend.takes_cached_pages`), known before it is built so
    that the replica's page allocator is made with or without its prefix cache: every backend but ``mk1``
    (``auto`` never picks ``mk1``)."""
    return kind != "mk1"

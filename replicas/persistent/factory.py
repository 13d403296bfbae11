"""Create the persistent backend a replica asked for."""

from __future__ import annotations

import torch

from replicas.engine import EngineCore
from replicas.persistent import BACKENDS  # noqa: F401 - the names, ``auto`` first (re-exported)
from replicas.persistent.contract import (
    PERSISTENT_BACKENDS,
    PersistentBackend,
    UnsupportedConfigurationError,
)


def _auto(device, model) -> type[PersistentBackend]:
    """The backend ``auto`` picks: the registered backend of lowest ``auto_rank`` whose ``why_not`` is None."""
    ranked = sorted((cls for _, cls in PERSISTENT_BACKENDS.items() if cls.auto_rank is not None),
                    key=lambda cls: cls.auto_rank)
    return next(cls for cls in ranked if cls.why_not(device, model) is None)


def create_backend(kind: str, core: EngineCore, checkpoint: str | None = None) -> PersistentBackend:
    """Build (not yet bound) the backend ``kind`` for ``core``.

    ``kind`` is ``auto`` or a name in :data:`~replicas.persistent.contract.PERSISTENT_BACKENDS`. ``auto``
    picks ``cuda_graph`` on a CUDA device when the model has a static decode step, else ``eager`` (the
    backends' ``auto_rank`` and ``why_not``); ``mk1`` (AMD gfx950 only) must be asked for by name:
    :meth:`~replicas.persistent.mk1.MK1Backend.for_core` checks its envelope, imports ``aiter.MK1`` and
    loads ``checkpoint``. The eager and cuda_graph backends decode with the engine's own weights; a
    checkpoint, when given, must pass :func:`~replicas.persistent.checkpoint.check_checkpoint_dir`
    (loading persistent weights from it comes with the GPT-OSS checkpoint work).

    Raises:
        UnsupportedConfigurationError: unknown backend.
        CheckpointError: bad checkpoint directory.
        NativeBinaryError: ``mk1`` and ``aiter.MK1`` cannot be imported.
    """
    if kind == "auto":
        cls = _auto(torch.device(core.runner.device), core.model)
    elif kind in PERSISTENT_BACKENDS:
        cls = PERSISTENT_BACKENDS.get(kind)
    else:
        choices = ", ".join(("auto", *PERSISTENT_BACKENDS.names()))
        raise UnsupportedConfigurationError(f"unknown persistent backend {kind!r}; choose from {choices}")
    return cls.for_core(core, checkpoint)


def backend_takes_cached_pages(kind: str) -> bool:
    """Whether the backend ``kind`` resolves to can start requests from prefix-cached pages
    (:attr:`~replicas.persistent.contract.PersistentBackend.takes_cached_pages`, a class attribute), known
    before it is built so that the replica's page allocator is made with or without its prefix cache. For
    ``auto``: whether every backend ``auto`` may pick does (``auto`` never picks ``mk1``). An unknown name
    answers True (:func:`create_backend` refuses it)."""
    if kind == "auto":
        return all(cls.takes_cached_pages for _, cls in PERSISTENT_BACKENDS.items() if cls.auto_rank is not None)
    return PERSISTENT_BACKENDS.get(kind).takes_cached_pages if kind in PERSISTENT_BACKENDS else True

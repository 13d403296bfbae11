"""Create the persistent backend a replica asked for."""

from __future__ import annotations

import json
from pathlib import Path

from replicas.engine import EngineCore
from replicas.persistent.contract import (
    CheckpointError,
    PersistentBackend,
    UnsupportedConfigurationError,
)
from replicas.persistent.eager import EagerBackend

BACKENDS = ("auto", "eager")
MANIFEST_NAME = "persistent_decoder_manifest.json"


def check_checkpoint_dir(path: str | Path) -> dict:
    """Minimal checkpoint check: the directory exists and holds a parseable manifest.

    Returns:
        The parsed manifest.

    Raises:
        CheckpointError: the directory or manifest is missing or unreadable.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"persistent-decoder checkpoint {path} does not exist or is not a directory")
    manifest = path / MANIFEST_NAME
    if not manifest.is_file():
        raise CheckpointError(f"persistent-decoder checkpoint {path} has no {MANIFEST_NAME}")
    try:
        return json.loads(manifest.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{manifest} is not valid JSON: {exc}") from exc


def create_backend(kind: str, core: EngineCore, checkpoint: str | None = None) -> PersistentBackend:
    """Build (not yet bound) the backend ``kind`` for ``core``.

    ``auto`` picks ``eager`` (the only backend in this build). The eager
    backend decodes with the engine's own weights; a checkpoint, when given,
    must exist and hold a manifest.

    Raises:
        UnsupportedConfigurationError: unknown backend.
        CheckpointError: bad checkpoint directory.
    """
    if kind not in BACKENDS:
        raise UnsupportedConfigurationError(f"unknown persistent backend {kind!r}; choose from {', '.join(BACKENDS)}")
    if checkpoint:
        check_checkpoint_dir(checkpoint)
    return EagerBackend(core.model, core.runner.device)

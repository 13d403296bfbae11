"""Persistent-decoder checkpoint directory checks (no torch: the app config uses it at build time).

The full format (DESIGN.md "Persistent checkpoint": safetensors shards plus
``persistent_decoder_manifest.json``, ``format_version`` 2 or 3, one record
per tensor) is validated by the checkpoint tool; here we check what a replica
needs before it starts.
"""

from __future__ import annotations

import json
from pathlib import Path

MANIFEST_NAME = "persistent_decoder_manifest.json"
FORMAT_VERSIONS = (2, 3)


class CheckpointError(RuntimeError):
    """The persistent checkpoint is missing or invalid.

    ``replicas.persistent.contract.CheckpointError`` is this class, re-exported
    there as part of the decoder's error family.
    """

    reason = "checkpoint_invalid"


def check_checkpoint_dir(path: str | Path) -> dict:
    """Check that ``path`` is a directory with a readable manifest of a known format version.

    Returns:
        The parsed manifest.

    Raises:
        CheckpointError: with a message naming the path and what is wrong.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"persistent-decoder checkpoint {path} does not exist or is not a directory")
    manifest = path / MANIFEST_NAME
    if not manifest.is_file():
        raise CheckpointError(f"persistent-decoder checkpoint {path} has no {MANIFEST_NAME}")
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{manifest} is not valid JSON: {exc}") from exc
    version = data.get("format_version") if isinstance(data, dict) else None
    if version not in FORMAT_VERSIONS:
        raise CheckpointError(f"{manifest}: format_version {version!r} is not one of {FORMAT_VERSIONS}")
    return data

"""Every environment variable persistent-serve reads, in one place, typed and documented.

Settings that change serving behaviour are config fields (:class:`replicas.config.EngineConfig`,
``deployments.config.AppConfig``), resolved once at load and shown in ``/debug/stats``: on a
multi-node cluster they then come from the deployed config, not from each worker's environment.
What stays an environment variable is what is per machine or must not sit in a config file
(secrets). ``docs/operations.md`` lists the same variables; ``tests/test_envs.py`` checks that
nothing else in ``replicas/`` or ``deployments/`` reads a ``PERSISTENT_SERVE_*`` variable.

Third-party variables keep their own owners: ``OTEL_*`` (OpenTelemetry, read by
``ops.telemetry.tracing``), ``RAY_*`` (Ray), ``HF_*`` (Hugging Face), ``TIKTOKEN_ENCODINGS_BASE``
(openai-harmony's vocabulary folder: ``deployments.harmony.vocab`` sets it in the ingress to
``<cache>/tiktoken``, where it writes the o200k file, unless it already names a folder holding
that file; docs/harmony.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvVar:
    """One variable: its name, the value used when it is unset (``None``: no default) and what it does."""

    name: str
    default: str | None
    doc: str

    def raw(self) -> str | None:
        """The variable's text, or its default when unset or empty."""
        value = os.environ.get(self.name)
        return value if value else self.default


CACHE = EnvVar(
    "PERSISTENT_SERVE_CACHE",
    None,
    "Directory for converted checkpoints (the embedded GGUF model converted once to an HF directory); "
    "default ~/.cache/persistent-serve.",
)

VARIABLES: tuple[EnvVar, ...] = (CACHE,)
"""All of them, in the order ``docs/operations.md`` lists them."""


def cache_dir() -> Path:
    """Where converted checkpoints are cached: ``$PERSISTENT_SERVE_CACHE`` or ``~/.cache/persistent-serve``."""
    root = CACHE.raw()
    return Path(root) if root else Path.home() / ".cache" / "persistent-serve"

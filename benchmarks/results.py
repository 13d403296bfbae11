"""Benchmark results as data: one JSON file per study and run.

Every benchmark writes ``{"study", "command", "machine", "git_commit", "date", "rows": [...]}`` (plus optional
``notes``) with :func:`write_result`; the files the docs show live in ``benchmarks/results/``, named
``<date>_<study>[_<tag>].json``, and ``docs/benchmarks.md`` is generated from the newest of each study
(:mod:`benchmarks.docs`). The row fields of each study are listed in :mod:`benchmarks.studies`.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
"""The folder of kept results (``benchmarks/results/``)."""

KEYS = ("study", "command", "machine", "git_commit", "date", "rows")
"""The fields every result file has."""


def machine() -> str:
    """The GPU (or CPU) and software versions, one line: ``NAME; torch X; triton Y; Python Z``."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else (platform.processor() or "CPU")
    return f"{gpu}; torch {torch.__version__}; triton {triton_version}; Python {platform.python_version()}"


def git_commit() -> str:
    """``$GIT_COMMIT`` (a GPU machine gets the tree without ``.git``), else ``git rev-parse --short HEAD`` of this
    checkout, else ``unknown`` (also when the nearest git repository is another one above the tree: a copied
    tree inside some other checkout must not take that checkout's commit)."""
    commit = os.environ.get("GIT_COMMIT")
    if commit:
        return commit
    root = Path(__file__).resolve().parents[1]
    try:
        top, head = subprocess.run(["git", "rev-parse", "--show-toplevel", "--short", "HEAD"], capture_output=True,
                                   text=True, check=True, cwd=root).stdout.split()
    except (OSError, subprocess.CalledProcessError, ValueError):
        return "unknown"
    return head if Path(top).resolve() == root else "unknown"


def command_line(argv: list[str] | None = None) -> str:
    """This process's command as a user would type it (``python -m MODULE ARGS``)."""
    argv = sys.argv if argv is None else argv
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    head = f"python -m {spec.name}" if spec is not None and spec.name else f"python {argv[0]}"
    return " ".join([head, *map(shlex.quote, argv[1:])])


def write_result(study: str, rows: list[dict], out: str | Path, *, command: str | None = None,
                 notes: str = "", tag: str = "") -> Path:
    """Write one result file into ``out`` and return its path.

    Args:
        study: a name of :data:`benchmarks.studies.STUDIES`.
        rows: the measurements, one dict per row (JSON-able values; NaN is written as null).
        out: a folder (created); ``benchmarks/results`` keeps what the docs show.
        command: the command that measured them (default: this process's).
        notes: conditions a reader needs (random weights, lengths, ...).
        tag: a suffix for the file name when one run writes several files of a study.

    Raises:
        ValueError: an unknown study name.
    """
    from benchmarks.studies import STUDIES

    if study not in STUDIES:
        raise ValueError(f"unknown study {study!r}; add it to benchmarks/studies.py ({', '.join(STUDIES)})")
    date = time.strftime("%Y-%m-%d")
    doc = {"study": study, "command": command or command_line(), "machine": machine(), "git_commit": git_commit(),
           "date": date, "rows": [_clean(r) for r in rows]}
    if notes:
        doc["notes"] = notes
    name = f"{date}_{study}{'_' + re.sub(r'[^A-Za-z0-9.-]+', '-', tag) if tag else ''}.json"
    path = Path(out) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def _clean(row: dict) -> dict:
    out = {}
    for k, v in row.items():
        if isinstance(v, float) and v != v:  # NaN: not measured
            v = None
        out[str(k)] = v
    return out


def load(folder: str | Path = RESULTS) -> list[dict]:
    """Every result file in ``folder``, each with its ``path`` added, oldest date first.

    Raises:
        ValueError: a file that is not a result (a missing field, or rows that are not a list of objects)."""
    docs = []
    for path in sorted(Path(folder).glob("*.json")):
        doc = json.loads(path.read_text())
        missing = [k for k in KEYS if k not in doc]
        if missing or not isinstance(doc["rows"], list) or not all(isinstance(r, dict) for r in doc["rows"]):
            raise ValueError(f"{path}: not a benchmark result (missing {missing} or rows not a list of objects)")
        doc["path"] = path
        docs.append(doc)
    return sorted(docs, key=lambda d: (d["date"], d["path"].name))

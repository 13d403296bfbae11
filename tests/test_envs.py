"""Environment variables: only ``replicas/envs.py`` reads ``PERSISTENT_SERVE_*`` in the serving code, and
``docs/operations.md`` lists every variable it defines."""

from __future__ import annotations

import re
from pathlib import Path

from replicas import envs

ROOT = Path(__file__).resolve().parents[1]


def test_only_the_envs_module_names_persistent_serve_variables():
    offenders = []
    for folder in ("replicas", "deployments", "policy"):
        for path in (ROOT / folder).rglob("*.py"):
            if path == ROOT / "replicas" / "envs.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"PERSISTENT_SERVE_[A-Z_]+", line):
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_every_variable_is_documented_and_read_through_its_entry(monkeypatch, tmp_path):
    ops_doc = (ROOT / "docs" / "operations.md").read_text()
    assert envs.VARIABLES, "no variables defined"
    for var in envs.VARIABLES:
        assert var.name.startswith("PERSISTENT_SERVE_") and var.doc
        assert var.name in ops_doc, f"{var.name} is not in docs/operations.md"
    monkeypatch.setenv(envs.CACHE.name, str(tmp_path))
    assert envs.cache_dir() == tmp_path
    monkeypatch.setenv(envs.CACHE.name, "")
    assert envs.cache_dir() == Path.home() / ".cache" / "persistent-serve"

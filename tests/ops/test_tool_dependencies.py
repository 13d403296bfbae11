"""The tools the README tells a user to run after ``make serve`` (``pip install -e .``, no extras) import
only what the package's own dependencies install."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
README_TOOLS = ("ops/tools/make_tiny_harmony_model.py", "deployments/harmony/vocab.py")
"""``python -m ops.tools.make_tiny_harmony_model`` (README, GPT-OSS section) and the vocabulary it builds from."""


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")


def _closure(names: set[str]) -> set[str]:
    """``names`` and every distribution they require, as installed here (extras and markers left out)."""
    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        todo += [_name(r) for r in requires if "extra ==" not in r]
    return seen


def _third_party_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    mods = set()
    for node in ast.walk(tree):  # lazy imports inside functions count too
        if isinstance(node, ast.Import):
            mods |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods.add(node.module.split(".")[0])
    ours = {"deployments", "replicas", "policy", "ops", "tests"}
    return {m for m in mods if m not in ours and m not in sys.stdlib_module_names and m != "__future__"}


@pytest.mark.parametrize("tool", README_TOOLS)
def test_readme_tools_need_no_extra(tool):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    installed = _closure({_name(d) for d in project["dependencies"]})
    dists = md.packages_distributions()
    missing = {}
    for module in _third_party_imports(ROOT / tool):
        names = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
        if not names & installed:
            missing[module] = sorted(names)
    assert not missing, f"{tool} imports modules only an extra installs: {missing}"

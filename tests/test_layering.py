"""The layers point one way, and no first-party import cycle exists (imports inside functions included).

Walks every module of ``policy/``, ``replicas/``, ``deployments/``, ``ops/`` and ``benchmarks/`` with :mod:`ast` (nothing is
imported), resolves each import to a first-party module, and checks:

- a module imports only modules of its own layer or of layers below (:data:`LAYERS`, bottom first):
  ``policy``, ``replicas.envs`` and ``replicas.registry``; ``replicas.kernels``; ``replicas.models``; the replica core
  (config, KV cache, scheduler, engine, ...); ``ops.telemetry``; ``replicas.persistent``;
  ``replicas.engine_actor``; ``deployments``; ``ops.tools`` (offline tools); ``benchmarks`` (on top: nothing
  in the serving path or ``ops`` imports benchmark code);
- ``replicas`` never imports ``ray.serve``; ``policy`` neither torch nor ray (``tests/policy`` also checks
  that at run time);
- the import graph between first-party modules has no cycle.

``docs/architecture.md`` shows the same layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("policy", "replicas", "deployments", "ops", "benchmarks")

LAYERS = (
    ("policy", "replicas.envs", "replicas.registry"),
    ("replicas.kernels",),
    ("replicas.models",),
    ("replicas",),  # the replica core: every replicas module not named in another layer
    ("ops.telemetry",),
    ("replicas.persistent",),
    ("replicas.engine_actor",),
    ("deployments",),
    ("ops.tools", "ops"),
    ("benchmarks",),
)
"""Layers bottom first, by module-name prefix; a module belongs to the layer of its longest matching prefix."""


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The first-party module ``name`` refers to (the longest existing prefix), or None (third party)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in MODULES:
            return candidate
        parts.pop()
    return None


def _imports(module: str, path: Path) -> list[tuple[str, int, str]]:
    """``(target, line, raw name)`` for every import in ``module``, first-party targets resolved, third-party
    kept as their raw dotted name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from X import Y``: the submodule X.Y where one exists, else X (Y is an attribute of X)
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for raw in names:
            target = _resolve(raw)
            found.append((target or raw, node.lineno, raw))
    return found


def _layer(module: str) -> int:
    best, rank = -1, None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    assert rank is not None, module
    return rank


GRAPH = {m: sorted({t for t, _, _ in _imports(m, p) if t in MODULES and t != m}) for m, p in MODULES.items()}


def test_every_module_has_a_layer():
    for module in MODULES:
        _layer(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    wrong = []
    for target, line, raw in _imports(module, MODULES[module]):
        if target in MODULES and target != module and _layer(target) > _layer(module):
            wrong.append(f"{MODULES[module].relative_to(ROOT)}:{line} imports {target} (layer {_layer(target)} "
                         f"above {_layer(module)})")
        if module.startswith("replicas") and (raw == "ray.serve" or raw.startswith("ray.serve.")):
            wrong.append(f"{MODULES[module].relative_to(ROOT)}:{line} imports ray.serve")
        if module.startswith("policy") and raw.split(".")[0] in ("torch", "ray"):
            wrong.append(f"{MODULES[module].relative_to(ROOT)}:{line} imports {raw}")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle():
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in GRAPH[m]:
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state:
                cycle = visit(t)
                if cycle:
                    return cycle
        stack.pop()
        state[m] = 2
        return None

    for module in sorted(MODULES):
        if module not in state:
            cycle = visit(module)
            assert cycle is None, " -> ".join(cycle)


def test_the_walk_sees_lazy_imports():
    """Imports inside functions count (the MoE backends load their kernels lazily)."""
    assert "replicas.kernels.moe.hopper_bulk" in GRAPH["replicas.kernels.moe.backends"]
    assert "replicas.kernels.decode_ops" in GRAPH["replicas.models.gpt_oss"]


def test_the_lane_wrappers_and_the_app_config_load_without_torch():
    """Serve's lane wrapper processes (``deployments.replicas``) only create engine actors and read the app
    config: importing them, and validating a config, must not load torch (a fresh interpreter checks it; the
    engine actor imports the engine in its constructor)."""
    import subprocess
    import sys

    code = (
        "import sys, deployments.replicas, deployments.config\n"
        "deployments.config.AppConfig.model_validate({'engine': {'moe_backend': 'auto'}})\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'torch')\n"
        "assert not bad, bad[:5]\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]

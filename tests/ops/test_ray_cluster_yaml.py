"""ray_cluster.yaml is a valid Ray cluster-launcher config with the node types we rely on.

Validated against the JSON schema that ships inside the installed Ray
(``ray/autoscaler/ray-schema.json``) and through Ray's own ``prepare_config`` /
``validate_config``, i.e. what ``ray up`` does before it contacts the cloud.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CLUSTER_YAML = REPO_ROOT / "ray_cluster.yaml"

jsonschema = pytest.importorskip("jsonschema")  # a dependency of ray itself


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    with CLUSTER_YAML.open() as f:
        loaded = yaml.safe_load(f)
    assert isinstance(loaded, dict)
    return loaded


@pytest.fixture(scope="module")
def ray_schema() -> dict[str, Any]:
    autoscaler = pytest.importorskip("ray.autoscaler")
    schema_path = Path(os.path.dirname(autoscaler.__file__)) / "ray-schema.json"
    return json.loads(schema_path.read_text())


def test_matches_rays_json_schema(config: dict[str, Any], ray_schema: dict[str, Any]) -> None:
    jsonschema.validate(config, ray_schema)


def test_passes_rays_own_config_validation(config: dict[str, Any]) -> None:
    util = pytest.importorskip("ray.autoscaler._private.util")
    prepared = util.prepare_config(config)  # merges the provider's defaults, as `ray up` does
    util.validate_config(prepared)
    assert prepared["available_node_types"]["mi355x_worker"]["max_workers"] == 4


def test_node_types(config: dict[str, Any]) -> None:
    assert config["cluster_name"] == "persistent-serve"
    node_types = config["available_node_types"]
    assert config["head_node_type"] == "head"
    head = node_types["head"]
    assert head["resources"].get("GPU", 0) == 0 and head["resources"]["CPU"] > 0
    worker = node_types["mi355x_worker"]
    assert worker["resources"]["GPU"] == 8
    assert worker["resources"]["accelerator_type:AMD-Instinct-MI355X-OAM"] == 8
    assert 0 <= worker["min_workers"] <= worker["max_workers"] <= config["max_workers"]
    assert sum(t.get("min_workers", 0) for t in node_types.values()) <= config["max_workers"]
    # the worker's `ray start` advertises the same accelerator resource the node type declares
    assert any("accelerator_type:AMD-Instinct-MI355X-OAM" in c for c in config["worker_start_ray_commands"])


def test_installs_the_project_and_aiter_from_source_and_starts_serve(config: dict[str, Any]) -> None:
    assert config["file_mounts"]["~/persistent-serve"] == "."
    assert (REPO_ROOT / "pyproject.toml").is_file()  # `ray up` runs from the repo root
    assert "pip install -e ~/persistent-serve" in config["setup_commands"]
    worker = " ".join(config["worker_setup_commands"])
    assert "git clone" in worker and "ROCm/aiter" in worker and "pip install aiter" not in worker
    assert any("serve deploy serve_config.yaml" in c for c in config["head_start_ray_commands"])
    assert (REPO_ROOT / "serve_config.yaml").is_file()


def test_locked_down_token_auth_loopback_dashboard_and_keys_from_a_secret(config: dict[str, Any]) -> None:
    """Ray token authentication on every node, the dashboard on loopback, API keys from a file outside
    the repository exported before `ray start` (docs/operations.md, "Security")."""
    starts = [*config["head_start_ray_commands"], *config["worker_start_ray_commands"]]
    ray_starts = [c for c in starts if "ray start" in c or "serve deploy" in c]
    assert len(ray_starts) == 3
    for command in ray_starts:
        assert "RAY_AUTH_MODE=token" in command, command
    for command in (c for c in ray_starts if "ray start" in c):
        assert 'PERSISTENT_SERVE_API_KEY="$(cat ~/.persistent-serve/api_key)"' in command
    head = next(c for c in config["head_start_ray_commands"] if "ray start --head" in c)
    assert "--dashboard-host=127.0.0.1" in head and "0.0.0.0" not in head
    mounts = config["file_mounts"]
    assert mounts["~/.ray/auth_token"] == "~/.ray/auth_token"  # Ray's default token path, from the operator
    secret = mounts["~/.persistent-serve/api_key"]
    assert secret.startswith("~/") and not (REPO_ROOT / secret).exists()  # outside the repository
    assert "0.0.0.0" not in CLUSTER_YAML.read_text().split("head_start_ray_commands")[1]

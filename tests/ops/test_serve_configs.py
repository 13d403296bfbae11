"""serve_config.yaml parses with Ray Serve's own schema models and builds our app; the KubeRay
RayService carries the same Serve config."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def serve_config() -> dict:
    return yaml.safe_load((REPO_ROOT / "serve_config.yaml").read_text())


def test_parses_with_serves_deploy_schema(serve_config: dict) -> None:
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(serve_config)
    (app,) = schema.applications
    assert app.import_path == "deployments.app:build_app" and app.route_prefix == "/"


def test_args_build_the_app_with_per_pool_autoscaling(serve_config: dict) -> None:
    from deployments.app import build_app
    from deployments.config import AppConfig

    args = serve_config["applications"][0]["args"]
    config = AppConfig.from_args(args)  # the same validation `serve deploy` runs in build_app
    persistent, standard = config.persistent_pool, config.standard_pool
    assert persistent.max_ongoing_requests == 1 and persistent.target_ongoing_requests == 1
    assert persistent.autoscaling and standard.autoscaling
    assert persistent.serve_options()["autoscaling_config"]["max_replicas"] == 16
    assert standard.serve_options()["max_queued_requests"] == 256
    assert persistent.engine_bundle(0.5, config.gpus_per_engine(persistent)) == {
        "CPU": 0.5, "GPU": 1, "accelerator_type:AMD-Instinct-MI355X-OAM": 0.001}
    app = build_app(config)  # builds the deployment graph (nothing starts)
    assert app is not None


def test_rayservice_carries_the_same_serve_config(serve_config: dict) -> None:
    manifest = yaml.safe_load((REPO_ROOT / "deploy" / "rayservice.yaml").read_text())
    assert manifest["kind"] == "RayService" and manifest["apiVersion"] == "ray.io/v1"
    carried = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    # the same config but for the bind address: the pod network there, loopback in serve_config.yaml
    assert carried["http_options"].pop("host") == "0.0.0.0"
    assert {**serve_config, "http_options": {k: v for k, v in serve_config["http_options"].items()
                                             if k != "host"}} == carried
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    (group,) = cluster["workerGroupSpecs"]
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    assert group["rayStartParams"]["num-gpus"] == "8"
    assert "accelerator_type:AMD-Instinct-MI355X-OAM" in group["rayStartParams"]["resources"]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["amd.com/gpu"] == 8


def test_laptop_override_of_the_serve_config_validates(serve_config: dict) -> None:
    """README step 3: the same file with the embedded model on CPU."""
    from deployments.config import AppConfig

    args = dict(serve_config["applications"][0]["args"])
    args.update(model="smollm2-135m-instruct", device="cpu", persistent_backend="auto",
                persistent_decoder_checkpoint=None, dtype="auto", max_model_len=2048)
    for pool in ("persistent_pool", "standard_pool"):
        args[pool] = {k: v for k, v in args[pool].items() if k not in ("num_gpus", "accelerator_type")}
    config = AppConfig.from_args(args)
    assert config.gpus_per_engine(config.persistent_pool) == 0
    assert config.persistent_pool.engine_bundle(0.5, 0) == {"CPU": 0.5}


def test_laptop_config_is_the_production_config_minus_the_hardware(serve_config: dict) -> None:
    """deploy/serve_config.laptop.yaml (README step 3) validates and keeps the production keys."""
    from ray.serve.schema import ServeDeploySchema

    from deployments.config import AppConfig

    laptop = yaml.safe_load((REPO_ROOT / "deploy" / "serve_config.laptop.yaml").read_text())
    ServeDeploySchema.model_validate(laptop)
    args = laptop["applications"][0]["args"]
    assert set(args) <= set(serve_config["applications"][0]["args"])  # nothing laptop-only
    config = AppConfig.from_args(args)
    assert config.gpus_per_engine(config.persistent_pool) == 0
    assert config.persistent_decoder_checkpoint is None and config.persistent_pool.max_ongoing_requests == 1


SECRET_NAMES = {"api_key", "admin_api_key", "RAY_AUTH_TOKEN", "PERSISTENT_SERVE_API_KEY",
                "PERSISTENT_SERVE_ADMIN_API_KEY"}


def _secret_literals(node, path=""):
    """Paths where a YAML document spells out a secret: a key option, or an env entry with a `value`."""
    if isinstance(node, dict):
        if node.get("name") in SECRET_NAMES and "value" in node:
            yield f"{path}.{node['name']}"
        for k, v in node.items():
            if str(k).replace("-", "_") in SECRET_NAMES:
                yield f"{path}.{k}"
            yield from _secret_literals(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _secret_literals(v, f"{path}[{i}]")


CONFIG_FILES = ("serve_config.yaml", "deploy/serve_config.laptop.yaml", "deploy/rayservice.yaml", "ray_cluster.yaml")


def test_serve_binds_loopback_and_no_config_holds_a_key(serve_config: dict) -> None:
    """Serve on 127.0.0.1 by default; no API key option in any shipped config (keys come from secrets)."""
    from ray.serve.schema import ServeDeploySchema

    assert serve_config["http_options"]["host"] == "127.0.0.1"
    assert ServeDeploySchema.model_validate(serve_config).http_options.keep_alive_timeout_s == 90
    laptop = yaml.safe_load((REPO_ROOT / "deploy" / "serve_config.laptop.yaml").read_text())
    assert laptop["http_options"]["host"] == "127.0.0.1"
    planted = {"args": {"api-key": "k"}, "env": [{"name": "RAY_AUTH_TOKEN", "value": "t"}]}
    assert len(list(_secret_literals(planted))) == 2  # the walker finds what it looks for
    for name in CONFIG_FILES:
        text = (REPO_ROOT / name).read_text()
        docs = [yaml.safe_load(text)]
        if name == "deploy/rayservice.yaml":
            docs.append(yaml.safe_load(docs[0]["spec"]["serveConfigV2"]))
        for doc in docs:
            assert not list(_secret_literals(doc)), (name, list(_secret_literals(doc)))
        # shell exports in the cluster launcher read the key from a file, never spell it out
        for line in text.splitlines():
            if "PERSISTENT_SERVE_API_KEY=" in line:
                assert 'PERSISTENT_SERVE_API_KEY="$(cat ' in line, (name, line)
    for app in (serve_config, laptop):
        args = app["applications"][0]["args"]
        assert not {"api_key", "admin_api_key"} & set(args)


def test_rayservice_is_locked_down() -> None:
    """Ray token auth via KubeRay's authOptions, ClusterIP services, API keys from a Kubernetes secret on
    every Ray container (the ingress may be scheduled on any node)."""
    manifest = yaml.safe_load((REPO_ROOT / "deploy" / "rayservice.yaml").read_text())
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token"}
    assert cluster["headGroupSpec"]["serviceType"] == "ClusterIP"
    containers = [cluster["headGroupSpec"]["template"]["spec"]["containers"][0],
                  *(g["template"]["spec"]["containers"][0] for g in cluster["workerGroupSpecs"])]
    for container in containers:
        env = {e["name"]: e for e in container["env"]}
        ref = env["PERSISTENT_SERVE_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "persistent-serve-api-keys", "key": "api-key"}
        assert "value" not in env["PERSISTENT_SERVE_API_KEY"]
        assert env["PERSISTENT_SERVE_ADMIN_API_KEY"]["valueFrom"]["secretKeyRef"]["optional"] is True
        assert all("value" not in e for e in container["env"])  # no literal anywhere

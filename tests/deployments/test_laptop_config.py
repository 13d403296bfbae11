"""deploy/serve_config.laptop.yaml really serves: its app deployed on the session's Serve instance."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml

from tests.deployments.conftest import MODEL, serve_status_wait, wait_healthy

pytestmark = pytest.mark.ray

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_laptop_serve_config_serves_greedy_requests_on_the_persistent_lane(server):
    from ray import serve

    from deployments.app import build_app

    laptop = yaml.safe_load((REPO_ROOT / "deploy" / "serve_config.laptop.yaml").read_text())
    (app,) = laptop["applications"]
    args = {**app["args"], "progress": False, "engine_num_cpus": 0.1}  # share the test machine's CPUs
    serve.run(build_app(args), name="laptop", route_prefix="/laptop", blocking=False)
    base = f"{server}/laptop"
    try:
        serve_status_wait("laptop")
        wait_healthy(base)
        r = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
            "model": MODEL, "temperature": 0, "max_tokens": 12,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert r.status_code == 200, r.text
        assert r.headers["x-lane"] == "persistent"
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
    finally:
        serve.delete("laptop")

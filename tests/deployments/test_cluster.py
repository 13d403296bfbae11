"""One TP1 persistent replica per GPU, and the pool autoscaling, on a real multi-node Ray cluster.

``ray.cluster_utils.Cluster`` starts a head (no GPU) and two worker nodes that
each advertise one simulated GPU. Engines are pinned to ``device=cpu``, so the
model runs on CPU while Ray's scheduler accounts GPUs exactly as on a GPU
cluster. The persistent pool may grow to 3 replicas; only 2 GPUs exist, so at
most 2 run, each engine in its own placement-group bundle holding one GPU on
its own node. Under bounded load the pool scales up; after it, back down.
Eligible requests that find every persistent replica busy go standard at once
(nothing waits in Serve's queue), so the pool scales on the eligible demand the
replicas report (``deployments.autoscaling``), not on a queue.
(CI stage ``make test-cluster``: it needs its own cluster.)
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.cluster]

APP = "scaling"
GPUS = 2
ASK = [{"role": "user", "content": "Count from one to fifty in words."}]


@pytest.fixture(scope="module")
def cluster_app():
    ray = pytest.importorskip("ray")
    from ray import serve
    from ray.cluster_utils import Cluster

    from deployments.app import build_app
    from tests.deployments.conftest import _free_port, serve_status_wait, wait_healthy

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "num_gpus": 0})
    for _ in range(GPUS):
        cluster.add_node(num_cpus=2, num_gpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({
        "device": "cpu", "max_model_len": 384, "num_kv_blocks": 48, "progress": False, "engine_num_cpus": 0.5,
        "persistent_pool": {"min_replicas": 1, "max_replicas": GPUS + 1, "num_gpus": 1, "target_ongoing_requests": 1,
                            "upscale_delay_s": 0.5, "downscale_delay_s": 3.0, "look_back_period_s": 1.0,
                            "metrics_interval_s": 0.5},
        "standard_pool": {"num_gpus": 0},
    }), name=APP, route_prefix="/", blocking=False)
    serve_status_wait(APP)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base)
    yield base
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


def _replica_states() -> dict:
    from ray import serve

    return dict(serve.status().applications[APP].deployments["PersistentReplica"].replica_states)


def _gpu_groups() -> list[dict]:
    """Created placement groups whose engine bundle (index 1) holds a GPU."""
    from ray.util import placement_group_table

    return [pg for pg in placement_group_table().values()
            if pg["state"] == "CREATED" and len(pg["bundles"]) == 2 and pg["bundles"][1].get("GPU") == 1]


def test_at_most_one_persistent_replica_per_gpu_and_the_pool_scales_up_and_down(cluster_app):
    assert _replica_states().get("RUNNING") == 1
    seen: list[dict] = []
    lanes: list[str] = []
    peak: dict = {"groups": [], "engines": []}
    stop = asyncio.Event()

    async def user(c: httpx.AsyncClient):
        while not stop.is_set():
            r = await c.post(f"{cluster_app}/v1/chat/completions", timeout=300, json={
                "model": "smollm2-135m-instruct", "messages": ASK, "temperature": 0,
                "max_tokens": 160, "ignore_eos": True})
            assert r.status_code == 200, r.text
            lanes.append(r.headers["x-lane"])  # spilled requests go standard (and count as demand)

    async def watch():
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            states = await asyncio.to_thread(_replica_states)
            seen.append(states)
            if states.get("RUNNING", 0) >= GPUS and sum(states.values()) > GPUS and len(seen) > 3:
                # scaled to every GPU and asked for one more that cannot be placed: hold a little longer
                await asyncio.sleep(3)
                seen.append(await asyncio.to_thread(_replica_states))
                # where the engines sit, read while the load still holds the pool at its peak (once the
                # load stops, downscale_delay_s=3 may already remove a replica)
                peak["groups"] = await asyncio.to_thread(_gpu_groups)
                async with httpx.AsyncClient() as c:
                    stats = await c.get(f"{cluster_app}/debug/stats", timeout=30)
                peak["engines"] = stats.json()["persistent"]["engines"]
                break
            await asyncio.sleep(0.5)
        stop.set()

    async def main():
        async with httpx.AsyncClient() as c:
            await asyncio.gather(watch(), *(user(c) for _ in range(GPUS + 1)))

    start = time.monotonic()
    asyncio.run(main())
    print(f"\nscale-up: {time.monotonic() - start:.1f} s, replica states seen:",
          [s for i, s in enumerate(seen) if i == 0 or s != seen[i - 1]],
          f"lanes: {lanes.count('persistent')} persistent, {lanes.count('standard')} standard")
    assert "persistent" in lanes
    assert max(s.get("RUNNING", 0) for s in seen) == GPUS, seen  # scaled up to every GPU, never beyond
    assert any(sum(s.values()) > GPUS for s in seen), seen  # the autoscaler wanted more than the GPUs allow

    groups, engines = peak["groups"], peak["engines"]
    assert len(groups) == GPUS, groups
    nodes = {pg["bundles_to_node_id"][1] for pg in groups}
    assert len(nodes) == GPUS  # each engine on its own GPU bundle, one per (single-GPU) node
    assert {e["placement_group_id"] for e in engines} == {pg["placement_group_id"] for pg in groups}

    start = time.monotonic()
    deadline = start + 120  # load stopped: back down to min_replicas
    while _replica_states() != {"RUNNING": 1}:
        assert time.monotonic() < deadline, _replica_states()
        time.sleep(1)
    print(f"scale-down to 1 replica: {time.monotonic() - start:.1f} s after the load stopped")
    assert len(_gpu_groups()) == 1

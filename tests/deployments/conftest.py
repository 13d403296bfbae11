"""A real local Ray cluster running the real Serve app over real HTTP, shared by this folder's tests.

The ``server`` fixture deploys ``/`` (``--persistent-decoder auto``) once per session on one Serve instance.
Three more session apps are deployed on the same instance the first time a test asks for them, and then
kept: ``off_app`` at ``/off`` (``--persistent-decoder off`` and ``direct_stream`` off, so its chunks come
back through Ray), ``gptoss_app`` at ``/gptoss`` (a tiny random GPT-OSS) and ``harmony_app`` at
``/harmony`` (the tiny GPT-OSS trained to answer in harmony form,
:mod:`ops.tools.make_tiny_harmony_model`; built once and cached). A stage that needs only ``/`` (the soak)
deploys only it.
Tracing goes over OTLP/HTTP to a real receiver started here. Ray's metrics
export endpoint (Prometheus text) is at :func:`metrics_url`, reporting every second.
"""

from __future__ import annotations

import contextlib
import socket
import time

import httpx
import pytest

from ops.telemetry.otlp_receiver import OTLPReceiver

MODEL = "smollm2-135m-instruct"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def otlp():
    with OTLPReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="session")
def tiny_gpt_oss(tmp_path_factory):
    """A tiny random GPT-OSS checkpoint (HF format, MXFP4 experts) written by our maker."""
    from ops.tools.make_tiny_gpt_oss import make_tiny_gpt_oss

    return make_tiny_gpt_oss(tmp_path_factory.mktemp("tiny-gpt-oss") / "model")


@pytest.fixture(scope="session")
def tiny_harmony_model():
    """The tiny GPT-OSS that speaks harmony (trained on CPU once, then cached)."""
    from ops.tools.make_tiny_harmony_model import tiny_harmony_model

    return tiny_harmony_model()


HARMONY_MODEL = "tiny-harmony"


_SESSION: dict = {}
"""The session Serve instance: ``base`` URL, the apps' ``common`` config and ``apps`` deployed so far (name ->
base URL)."""


@pytest.fixture(scope="session")
def server(otlp):
    """Base URL of the running app (auto mode) on the session's Ray cluster and Serve instance."""
    ray = pytest.importorskip("ray")
    from ray import serve

    from deployments.app import build_app

    global _metrics_port
    _metrics_port = _free_port()
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             _metrics_export_port=_metrics_port, _system_config={"metrics_report_interval_ms": 1000})
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    common = {"max_model_len": 1024, "num_kv_blocks": 256, "tracing_exporter": "otlp",
              "tracing_endpoint": otlp.endpoint, "progress": False}
    serve.run(build_app({**common, "persistent_decoder": "auto"}), name="auto", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base)
    _SESSION.update(base=base, common=common, apps={"auto": base})
    yield base
    _SESSION.clear()
    serve.shutdown()
    ray.shutdown()


def _session_app(name: str, **config) -> str:
    """Base URL of the session app ``/<name>``, deployed with ``config`` over the session's common config the
    first time it is asked for and kept for the rest of the session."""
    if name not in _SESSION["apps"]:
        from ray import serve

        from deployments.app import build_app

        serve.run(build_app({**_SESSION["common"], **config}), name=name, route_prefix=f"/{name}")
        wait_healthy(f"{_SESSION['base']}/{name}")
        _SESSION["apps"][name] = f"{_SESSION['base']}/{name}"
    return _SESSION["apps"][name]


@pytest.fixture(scope="session")
def off_app(server):
    """``/off``: ``--persistent-decoder off``, and every chunk back through Ray (``direct_stream`` off), so that
    path stays tested."""
    return _session_app("off", persistent_decoder="off", direct_stream=False)


@pytest.fixture(scope="session")
def gptoss_app(server, tiny_gpt_oss):
    """``/gptoss``: a tiny random GPT-OSS checkpoint (auto mode)."""
    return _session_app("gptoss", model=str(tiny_gpt_oss), served_model_name="tiny-gpt-oss", max_model_len=512,
                        num_kv_blocks=64)


@pytest.fixture(scope="session")
def harmony_app(server, tiny_harmony_model):
    """``/harmony``: the tiny GPT-OSS that answers in harmony form (auto mode)."""
    from ops.tools.make_tiny_harmony_model import TRAIN_DATE

    return _session_app("harmony", model=str(tiny_harmony_model), served_model_name=HARMONY_MODEL,
                        max_model_len=512, num_kv_blocks=64, harmony_start_date=TRAIN_DATE, engine_num_cpus=0.1)


_metrics_port: int | None = None


def metrics_url() -> str:
    """Ray's Prometheus endpoint of the session cluster (the ``server`` fixture must be running)."""
    assert _metrics_port is not None, "the server fixture is not running"
    return f"http://127.0.0.1:{_metrics_port}/metrics"


def pool_stats(base: str) -> dict:
    return httpx.get(f"{base}/debug/stats", timeout=30).json()


ASK = [{"role": "user", "content": "Count from one to fifty in words."}]
"""A chat that runs to ``max_tokens`` on the embedded model (the one-engine apps' tests)."""


async def chat(client: httpx.AsyncClient, base: str, lane: str | None = None, **body) -> httpx.Response:
    """POST :data:`ASK` to ``base``'s chat completions with ``body``'s fields, the lane forced by ``x-lane`` if
    given."""
    return await client.post(f"{base}/v1/chat/completions", timeout=300, headers={"x-lane": lane} if lane else {},
                             json={"model": MODEL, "messages": ASK, **body})


def assert_busy_persistent_lane_spills_at_once(base: str, messages: list[dict]) -> None:
    """Three greedy chats at once to a one-engine app (co-located or ``topology=direct``): its persistent lane
    serves one, the other two spill to its standard lane at once (two spillovers counted), every page back."""
    import asyncio

    before = pool_stats(base)["router"]["spillovers"]

    async def main():
        async with httpx.AsyncClient() as c:
            return await asyncio.gather(*(c.post(f"{base}/v1/chat/completions", timeout=300, json={
                "model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 24, "ignore_eos": True})
                for _ in range(3)))

    responses = asyncio.run(main())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    assert sorted(r.headers["x-lane"] for r in responses) == ["persistent", "standard", "standard"]
    assert pool_stats(base)["router"]["spillovers"] - before == 2
    assert_pages_returned(base)


def assert_pages_returned(base: str, timeout: float = 10.0) -> dict:
    """Poll ``/debug/stats`` until every lane's KV pool is full again; fail if it never is."""
    deadline = time.monotonic() + timeout
    while True:
        stats = pool_stats(base)
        lanes = [v for k, v in stats.items() if k in ("standard", "persistent", "colocated")]
        in_use = [lane["kv_pages_in_use"] for pool in lanes for lane in pool.get("lanes", {}).values()]
        if all(s["kv_pages_free"] == s["kv_pages_total"] for s in lanes) and not any(in_use):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"KV pages not returned: {stats}")
        time.sleep(0.2)


@pytest.fixture
def client(server):
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    for base in list(_SESSION.get("apps", {}).values()):  # every session app deployed so far
        assert_pages_returned(base)


def wait_healthy(base: str, timeout: float = 120.0) -> None:
    """Poll ``GET {base}/health`` until it answers 200."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{base} never became healthy")


@contextlib.contextmanager
def extra_app(server: str, otlp, name: str, **args):
    """Deploy one more small app (SmolLM2, short context) on the session's Serve instance at
    ``/<name>``; delete it afterwards so later tests get its CPUs and memory back."""
    from ray import serve

    from deployments.app import build_app

    common = {"max_model_len": 256, "num_kv_blocks": 64, "tracing_exporter": "otlp",
              "tracing_endpoint": otlp.endpoint, "progress": False, "engine_num_cpus": 0.1}
    serve.run(build_app({**common, **args}), name=name, route_prefix=f"/{name}", blocking=False)
    base = f"{server}/{name}"
    try:
        serve_status_wait(name)
        wait_healthy(base)
        yield base
    finally:
        serve.delete(name)


def serve_status_wait(name: str, timeout: float = 180.0) -> None:
    """Wait until the Serve application ``name`` is RUNNING; raise with its status if it fails."""
    from ray import serve

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        app = serve.status().applications.get(name)
        if app is not None and app.status == "RUNNING":
            return
        if app is not None and app.status == "DEPLOY_FAILED":
            raise AssertionError(f"app {name} failed to deploy: {app.message}")
        time.sleep(0.5)
    raise AssertionError(f"app {name} not running after {timeout} s: {serve.status().applications.get(name)}")

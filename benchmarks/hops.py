"""Measure what the Ray hops cost on the serving path, hop by hop.

Starts a local Ray cluster, deploys the app (the embedded model unless ``--model``), then:

* **hops** (``--iters`` calls each; median and p90, milliseconds):
  ``actor``: driver → engine actor ``stats()`` (one actor hop);
  ``replica``: driver → PersistentReplica ``stats()`` via a Serve handle, which forwards to its actor
  (one Serve hop + one actor hop); ``http_health``: HTTP ``GET /health`` (proxy → ingress);
  ``http_1_token``: HTTP greedy chat with ``max_tokens=1`` (proxy → ingress → replica → actor → prefill).
* **breakdown** (``--breakdown N`` streamed requests per lane, one at a time): where a request's time to
  first token goes, read from its own trace. The client sends a W3C ``traceparent`` with a trace id of its
  own, the app exports every span to an OTLP receiver in this process
  (:class:`ops.telemetry.otlp_receiver.OTLPReceiver`), and the request's spans give the segments
  (``time.time_ns()`` clocks of one machine):

  ==================  =====================================================================
  ``to_ingress``      client sends → the ingress's HTTP span (``POST /v1/chat/completions``, opened
                      by FastAPI as the request enters the app) starts: client, proxy, Serve's
                      ASGI hand-over
  ``ingress``         the HTTP span starts → ``route`` starts (validation, chat template,
                      tokenization, the request guard); split by the handler's marks into
                      ``ingress_body`` (the body received and validated, the handler entered),
                      ``ingress_plan`` (template, tokens) and ``ingress_route`` (the rest)
  ``to_replica``      ``route`` starts → ``replica.generate`` starts (Serve handle: replica choice,
                      the hop; on the persistent lane also the ``Started`` handshake's wait)
  ``to_engine``       ``replica.generate`` starts → ``generation`` starts (actor hop)
  ``engine``          ``generation`` starts → its first token leaves the actor
                      (``gen_ai.latency.time_to_first_token``: queue, prefill, first quantum)
  ``back``            the first token leaves the actor → the client reads it (actor → replica →
                      ingress → proxy → client)
  ==================  =====================================================================

  On the persistent lane, ``per_chunk_back`` is the median over quanta of (client reads the quantum's
  chunk − that ``quantum`` span ends): what each later chunk pays on the way back.
* **CPU per token** (``--cpu-per-token C``): each serving process's CPU time per output token while
  streams run at concurrency ``C`` on the standard lane (:func:`cpu_per_token`).

Usage: ``python -m benchmarks.hops --iters 200 --breakdown 20 --cpu-per-token 8``; the first bursts after
start (``first_burst`` result with ``--out``): ``python -m benchmarks.hops --iters 0 --burst 8
--burst-lanes persistent,standard,persistent,standard --out benchmarks/results --label auto-first``; one topology's
breakdown as a ``serve_hops`` result: ``python -m benchmarks.hops --iters 0 --breakdown 20 --max-tokens 16
--topology direct --out benchmarks/results --label direct``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

from ops.telemetry.tracing import ATTR_INGRESS_HANDLER_NS, ATTR_INGRESS_PLANNED_NS

LANES = ("persistent", "standard")
SEGMENTS = ("to_ingress", "ingress", "to_replica", "to_engine", "engine", "back")
INGRESS_PARTS = ("ingress_body", "ingress_plan", "ingress_route")
"""``ingress`` split at the handler's marks on the HTTP span: receiving and validating the body, planning
(template, tokens), the handler's own work up to ``route``."""


def _summary(samples: list[float]) -> str:
    s = sorted(samples)
    return f"median {statistics.median(s) * 1e3:7.2f} ms   p90 {s[int(0.9 * (len(s) - 1))] * 1e3:7.2f} ms"


def _traceparent() -> tuple[str, str]:
    """A fresh sampled W3C ``traceparent`` and its trace id (32 hex digits)."""
    trace_id, span_id = os.urandom(16).hex(), os.urandom(8).hex()
    return f"00-{trace_id}-{span_id}-01", trace_id


async def _one_request(client, path: str, body: dict, lane: str) -> dict:
    """One streamed request with a trace of its own: send time, output chunks' arrival times (ns)."""
    header, trace_id = _traceparent()
    sent = time.time_ns()
    chunks: list[int] = []
    async with client.stream("POST", path, json={**body, "stream": True},
                             headers={"traceparent": header, "x-lane": lane}) as r:
        r.raise_for_status()
        served = r.headers.get("x-lane")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if any(c.get("text") or (c.get("delta") or {}).get("content") for c in event.get("choices", [])):
                chunks.append(time.time_ns())
    return {"trace_id": trace_id, "sent": sent, "chunks": chunks, "lane": served}


def segments(record: dict, spans: list) -> dict[str, float] | None:
    """The request's TTFT segments (seconds) from its spans (``ReceivedSpan``s of its trace), or None when
    a span is missing (not exported yet) or nothing was streamed."""
    by_name: dict[str, list] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    http = [s for s in spans if s.name.startswith("POST ") and s.name.endswith("/completions")]
    need = ("route", "replica.generate", "generation")
    if not record["chunks"] or not http or any(name not in by_name for name in need):
        return None
    http, route = http[0], by_name["route"][0]
    replica = min(by_name["replica.generate"], key=lambda s: s.start_ns)
    generation = min(by_name["generation"], key=lambda s: s.start_ns)
    ttft = generation.attributes.get("gen_ai.latency.time_to_first_token")
    if ttft is None:
        return None
    first_out = generation.start_ns + ttft * 1e9
    out = {"to_ingress": (http.start_ns - record["sent"]) / 1e9,
           "ingress": (route.start_ns - http.start_ns) / 1e9,
           "to_replica": (replica.start_ns - route.start_ns) / 1e9,
           "to_engine": (generation.start_ns - replica.start_ns) / 1e9,
           "engine": float(ttft),
           "back": (record["chunks"][0] - first_out) / 1e9,
           "ttft": (record["chunks"][0] - record["sent"]) / 1e9}
    out["added"] = out["ttft"] - out["engine"]  # what the way there and back adds to the engine's own TTFT
    entered = http.attributes.get(ATTR_INGRESS_HANDLER_NS)
    planned = http.attributes.get(ATTR_INGRESS_PLANNED_NS)
    if entered is not None and planned is not None:  # the ingress segment, split at the handler's marks
        out["ingress_body"] = (int(entered) - http.start_ns) / 1e9
        out["ingress_plan"] = (int(planned) - int(entered)) / 1e9
        out["ingress_route"] = (route.start_ns - int(planned)) / 1e9
    quanta = sorted((s for s in by_name.get("quantum", []) if s.attributes.get("quantum.tokens_emitted")),
                    key=lambda s: s.end_ns)
    later = record["chunks"][len(record["chunks"]) - len(quanta):]  # the prefill's token comes first, alone
    if quanta and len(record["chunks"]) - len(quanta) in (0, 1):
        out["per_chunk_back"] = statistics.median(
            (arrived - q.end_ns) / 1e9 for arrived, q in zip(later, quanta, strict=True))
    return out


def _traced_segments(receiver, record: dict, deadline: float) -> dict[str, float] | None:
    """:func:`segments` of ``record`` once its spans have reached ``receiver`` (the generation span ends
    last, after the stream), polled until ``deadline`` (``time.monotonic()``); None if they did not."""
    while True:
        row = segments(record, [s for s in receiver.spans() if s.trace_id == record["trace_id"]])
        if row is not None or time.monotonic() > deadline:
            return row
        time.sleep(0.05)


def breakdown(base: str, receiver, model: str, n: int, max_tokens: int, lanes=LANES,
              prompt_token_ids: list[int] | None = None) -> dict[str, dict]:
    """``n`` streamed greedy requests per lane, one at a time (after 2 warm-ups); the median of each
    segment (ms) per lane, of ``ttft`` and of ``added`` (TTFT − the engine segment: what Serve's path adds), and
    the lane that served.

    Chat requests (one short user message), or completions of ``prompt_token_ids`` when given (models
    without a chat template). The app must export its spans to ``receiver`` (an
    :class:`~ops.telemetry.otlp_receiver.OTLPReceiver`); a sample ratio of 0 is enough, since these
    requests' ``traceparent`` says sampled.
    """
    import httpx

    body = {"model": model, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}
    if prompt_token_ids is None:
        path, body["messages"] = "v1/chat/completions", [{"role": "user", "content": "Tell me about the sea."}]
    else:
        path, body["prompt"] = "v1/completions", list(prompt_token_ids)

    async def run(lane: str, count: int) -> list[dict]:
        async with httpx.AsyncClient(base_url=base.rstrip("/") + "/", timeout=120) as client:
            return [await _one_request(client, path, body, lane) for _ in range(count)]

    out = {}
    for lane in lanes:
        asyncio.run(run(lane, 2))
        records = asyncio.run(run(lane, n))
        rows = []
        for record in records:
            row = _traced_segments(receiver, record, time.monotonic() + 20)
            if row is not None:
                rows.append(row)
        optional = [k for k in INGRESS_PARTS + ("per_chunk_back",) if any(k in r for r in rows)]
        keys = [*SEGMENTS, "ttft", "added", *optional]
        out[lane] = {"requests": len(rows), "served": sorted({r["lane"] or "?" for r in records}),
                     **{k: round(statistics.median(r[k] for r in rows if k in r) * 1e3, 3) for k in keys if rows}}
    return out


def burst(base: str, receiver, model: str, concurrency: int, max_tokens: int, lane: str = "standard",
          prompts: list[list[int]] | None = None, wait_s: float = 30.0) -> list[dict]:
    """``concurrency`` streamed greedy requests sent at once (no warm-up: meant as the first burst an app
    sees), each with its own trace; per request, in send order, its segments (ms, as :func:`segments`) plus
    ``e2el`` (client: sent → last chunk). ``prompts``: token ids per request (completions), else a short chat.
    A request whose spans do not arrive within ``wait_s`` gets only ``ttft`` and ``e2el``."""
    import httpx

    body = {"model": model, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}

    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=base.rstrip("/") + "/", timeout=300) as client:
            calls = []
            for i in range(concurrency):
                if prompts is None:
                    path, b = "v1/chat/completions", {**body, "messages": [{"role": "user", "content": "Hi"}]}
                else:
                    path, b = "v1/completions", {**body, "prompt": list(prompts[i % len(prompts)])}
                calls.append(_one_request(client, path, b, lane))
            return list(await asyncio.gather(*calls))

    records = sorted(asyncio.run(run()), key=lambda r: r["sent"])
    deadline = time.monotonic() + wait_s
    rows = []
    for record in records:
        row = {k: round(v * 1e3, 3) for k, v in (_traced_segments(receiver, record, deadline) or {}).items()}
        if record["chunks"]:
            row.setdefault("ttft", round((record["chunks"][0] - record["sent"]) / 1e6, 3))
            row["e2el"] = round((record["chunks"][-1] - record["sent"]) / 1e6, 3)
        row["sent_after_first"] = round((record["sent"] - records[0]["sent"]) / 1e6, 3)
        row["lane"] = record["lane"]
        rows.append(row)
    return rows


def burst_summary(rows: list[dict], index: int, header: str, concurrency: int, max_tokens: int,
                  label: str = "") -> dict:
    """One ``first_burst`` result row from :func:`burst`'s rows: the burst's place (1 = the app's first
    requests), its ``x-lane`` header (``persistent``: the router's own choice; ``standard``: forced), the
    lanes that served it, and the medians (ms) of TTFT, end-to-end latency and the engine's own TTFT
    (``engine`` segment; None when no trace arrived)."""
    def median(key: str):
        values = [r[key] for r in rows if r.get(key) is not None]
        return round(statistics.median(values), 1) if values else None

    served = sorted({r["lane"] or "?" for r in rows})
    return {"label": label, "burst": index, "x_lane": header, "served": "+".join(served),
            "concurrency": concurrency, "max_tokens": max_tokens, "ttft_ms_median": median("ttft"),
            "e2el_ms_median": median("e2el"), "engine_ms_median": median("engine")}


def _ray_processes() -> dict[int, str]:
    """``pid -> role`` of this machine's Ray worker processes that serve requests (their process title,
    ``ray::ServeReplica:<app>:<deployment>``, ``ray::ProxyActor``, ``ray::EngineActor``, shortened)."""
    import psutil

    out = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        title = " ".join(proc.info.get("cmdline") or [])
        if not title.startswith("ray::"):
            continue
        if "ServeReplica" in title:
            out[proc.info["pid"]] = title.split()[0].split(":")[-1]  # the deployment name
        elif "ProxyActor" in title:
            out[proc.info["pid"]] = "ProxyActor"
        elif "EngineActor" in title:
            out[proc.info["pid"]] = "EngineActor"
    return out


def profile_engine(seconds: float, out_path, delay_s: float = 0.0, rate: int = 200, top: int = 40) -> dict:
    """Sample the busiest engine actor's Python stacks with ``py-spy`` for ``seconds`` (after ``delay_s``), every
    thread, idle frames included (a thread spinning in a CUDA sync shows as the call that waits).

    Writes py-spy's raw stacks (every thread) to ``out_path`` and returns ``{"pid", "samples", "top": [(share,
    frame), ...]}`` for the engine thread (stacks through ``_engine_loop``): each frame's share of that thread's
    samples whose stack holds it (inclusive), most first; or ``{"error": ...}`` when py-spy is missing or cannot
    attach (it needs ptrace rights on the process)."""
    import collections
    import shutil
    import subprocess

    import psutil

    exe = shutil.which("py-spy")
    if exe is None:
        return {"error": "py-spy not installed"}
    time.sleep(delay_s)
    engines = [psutil.Process(pid) for pid, role in _ray_processes().items() if role == "EngineActor"]
    if not engines:
        return {"error": "no engine actor"}
    for proc in engines:
        proc.cpu_percent()
    time.sleep(1.0)
    busiest = max(engines, key=lambda proc: proc.cpu_percent())
    cmd = [exe, "record", "--pid", str(busiest.pid), "--duration", str(int(seconds)), "--rate", str(rate),
           "--format", "raw", "--idle", "--nonblocking", "--output", str(out_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
    if done.returncode != 0:
        return {"error": f"py-spy rc {done.returncode}: {done.stderr[-300:]}"}
    inclusive: collections.Counter = collections.Counter()
    total = 0
    with open(out_path) as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            frames = stack.split(";")
            if not any("_engine_loop" in frame for frame in frames):
                continue  # other threads (gauges, heartbeat, Ray's) mostly sleep
            total += int(n)
            for frame in set(frames):
                inclusive[frame] += int(n)
    return {"pid": busiest.pid, "samples": total,
            "top": [(round(n / max(total, 1), 3), frame) for frame, n in inclusive.most_common(top)]}


def cpu_per_token(base: str, model: str, concurrency: int, requests: int, max_tokens: int,
                  lane: str = "standard", prompt_token_ids: list[int] | None = None) -> dict:
    """CPU time each serving process spends per output token while ``requests`` streamed requests run at
    ``concurrency`` on ``lane`` (``ignore_eos``; a completion of ``prompt_token_ids``, else a short chat):
    ``{role: ms of CPU per output token}`` (roles summed over their processes, as
    :func:`_ray_processes` names them), plus ``output_tok_s``. Where the streams' tokens pass through
    several processes, the busiest one bounds the tokens per second the app can stream."""
    import httpx
    import psutil

    body = {"model": model, "temperature": 0.7, "seed": 1, "max_tokens": max_tokens, "ignore_eos": True}
    if prompt_token_ids is None:
        path, body["messages"] = "v1/chat/completions", [{"role": "user", "content": "Tell me about the sea."}]
    else:
        path, body["prompt"] = "v1/completions", list(prompt_token_ids)
    roles = _ray_processes()
    procs = {pid: psutil.Process(pid) for pid in roles}

    def cpu() -> dict[int, float]:
        out = {}
        for pid, proc in procs.items():
            try:
                t = proc.cpu_times()
                out[pid] = t.user + t.system
            except psutil.Error:
                pass
        return out

    async def run() -> int:
        sem = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(base_url=base.rstrip("/") + "/", timeout=300,
                                     limits=httpx.Limits(max_connections=concurrency + 4)) as client:
            async def one() -> int:
                async with sem:
                    record = await _one_request(client, path, body, lane)
                    return len(record["chunks"])
            return sum(await asyncio.gather(*(one() for _ in range(requests))))

    asyncio.run(run())  # warm-up (graphs, caches) outside the measurement
    before, t0 = cpu(), time.perf_counter()
    chunks = asyncio.run(run())
    elapsed, after = time.perf_counter() - t0, cpu()
    tokens = requests * max_tokens
    out: dict = {"concurrency": concurrency, "output_tok_s": round(tokens / elapsed, 1),
                 "chunks_per_token": round(chunks / tokens, 3)}
    for pid, role in roles.items():
        if pid in before and pid in after:
            out[role] = out.get(role, 0.0) + (after[pid] - before[pid]) * 1e3 / tokens
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=200, help="calls per hop measurement (0: skip them)")
    p.add_argument("--breakdown", type=int, default=0, help="streamed requests per lane for the TTFT breakdown")
    p.add_argument("--burst", type=int, default=0, metavar="C",
                   help="first, C concurrent streamed requests (standard lane) and each one's segments")
    p.add_argument("--burst-lanes", default="standard",
                   help="with --burst, the x-lane header of each burst in turn, e.g. persistent,standard,persistent,"
                        "standard (persistent: the router's normal choice; standard: forced)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per breakdown request")
    p.add_argument("--out", default=None,
                   help="with --burst, write the bursts' medians as a first_burst result into this folder; with "
                        "--breakdown or --cpu-per-token, their rows as a serve_hops result")
    p.add_argument("--label", default="", help="with --out, the result rows' label or variant (and the file's tag)")
    p.add_argument("--topology", choices=("pools", "direct"), default=None,
                   help="the app's topology (default: the app's, pools); direct: co-located replicas that are "
                        "the ingress too")
    p.add_argument("--cpu-per-token", type=int, default=0, metavar="C",
                   help="also measure each process's CPU time per output token at concurrency C (standard lane)")
    p.add_argument("--model", default=None, help="the app's model (default: the embedded one)")
    p.add_argument("--app-args", default="{}", help="more app arguments, JSON (e.g. '{\"device\": \"cuda\"}')")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--client-port", type=int, default=None,
                   help="send the benchmark's HTTP requests to this port instead of --port (e.g. the ingress "
                        "replica's own port under Ray's RAY_SERVE_ENABLE_DIRECT_INGRESS=1, 30000 and up)")
    args = p.parse_args(argv)

    import httpx
    import ray
    from ray import serve

    from deployments.app import build_app
    from ops.telemetry.otlp_receiver import OTLPReceiver

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    receiver = OTLPReceiver().start()
    app_args = {"progress": False, **({"model": args.model} if args.model else {}), **json.loads(args.app_args)}
    if args.topology:
        app_args["topology"] = args.topology
    if args.breakdown or args.burst:
        app_args.update(tracing_exporter="otlp", tracing_endpoint=receiver.endpoint, tracing_protocol="http/protobuf",
                        tracing_schedule_delay_ms=50)
    serve.run(build_app(app_args), name="bench", route_prefix="/")
    base = f"http://127.0.0.1:{args.client_port or args.port}"
    deadline = time.monotonic() + 300  # as a load balancer would: no traffic before /health says ready
    while httpx.get(f"{base}/health", timeout=30).status_code != 200:
        if time.monotonic() > deadline:
            raise SystemExit("the app's /health did not answer 200 within 300 s")
        time.sleep(0.5)
    model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
    chat = {"model": model, "temperature": 0, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}

    async def run() -> dict[str, list[float]]:
        named = ray.util.list_named_actors(all_namespaces=True)
        entry = next(a for a in named if a["name"].startswith("persistent-serve-engine-persistent"))
        actor = ray.get_actor(entry["name"], namespace=entry["namespace"])
        replica = serve.get_deployment_handle("PersistentReplica", app_name="bench")
        out: dict[str, list[float]] = {"actor": [], "replica": [], "http_health": [], "http_1_token": []}
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            for _ in range(args.iters):
                t = time.perf_counter()
                await actor.stats.remote()
                out["actor"].append(time.perf_counter() - t)
                t = time.perf_counter()
                await replica.stats.remote()
                out["replica"].append(time.perf_counter() - t)
                t = time.perf_counter()
                await client.get("/health")
                out["http_health"].append(time.perf_counter() - t)
            for _ in range(max(10, args.iters // 10) if args.iters else 0):
                t = time.perf_counter()
                r = await client.post("/v1/chat/completions", json=chat)
                r.raise_for_status()
                out["http_1_token"].append(time.perf_counter() - t)
        return out

    burst_rows, hop_rows = [], []
    for i, lane in enumerate(args.burst_lanes.split(",") if args.burst else ()):
        # x-lane persistent is the router's normal choice (auto); standard forces the standard lane
        print(f"\nBurst {i + 1} ({'first' if i == 0 else 'later'}; x-lane {lane}): {args.burst} concurrent "
              f"streamed greedy requests, {args.max_tokens} tokens (ms)")
        rows = burst(base, receiver, model, args.burst, args.max_tokens, lane=lane)
        for row in rows:
            print("  " + json.dumps(row))
        print(f"  median TTFT {statistics.median(r['ttft'] for r in rows):.1f} ms; lanes "
              f"{sorted(r['lane'] for r in rows)}")
        burst_rows.append(burst_summary(rows, i + 1, lane, args.burst, args.max_tokens, args.label))
    if args.out and burst_rows:
        from benchmarks.results import write_result

        path = write_result("first_burst", burst_rows, args.out, tag=args.label,
                            notes=f"{model}, app arguments {args.app_args}; each burst: {args.burst} "
                                  f"streamed greedy requests sent at once, {args.max_tokens} tokens each "
                                  "(ignore_eos); medians over the burst's requests, ms.")
        print(f"wrote {path}")
    if args.iters:
        results = asyncio.run(run())
        print(f"\nRay hop latency ({args.iters} iterations, local cluster)")
        for name, samples in results.items():
            if samples:
                print(f"  {name:14s} {_summary(samples)}")
    if args.breakdown:
        print(f"\nTTFT breakdown ({args.breakdown} streamed greedy requests per lane, {args.max_tokens} tokens; "
              "medians, ms)")
        got = breakdown(base, receiver, model, args.breakdown, args.max_tokens)
        for lane, row in got.items():
            print(f"  {lane:10s} " + json.dumps(row))
            hop_rows += [{"shape": model, "lane": lane, "variant": args.label or None, "concurrency": 1, "segment": seg,
                          "ms": row[seg], "served": "+".join(row["served"]), "requests": row["requests"]}
                         for seg in (*SEGMENTS, "ttft", "added", *INGRESS_PARTS) if seg in row]
    if args.cpu_per_token:
        c = args.cpu_per_token
        print(f"\nCPU per output token at concurrency {c} (standard lane, {4 * c} requests x 64 tokens; ms)")
        cpu = cpu_per_token(base, model, c, 4 * c, 64)
        print("  " + json.dumps(cpu))
        hop_rows += [{"shape": model, "lane": "standard", "variant": args.label or None, "concurrency": c,
                      "process": role, "cpu_ms_per_token": ms, "output_tok_s": cpu["output_tok_s"]}
                     for role, ms in cpu.items() if role not in ("concurrency", "output_tok_s", "chunks_per_token")]
    if args.out and hop_rows:
        from benchmarks.results import write_result

        env = {k: v for k, v in os.environ.items() if k.startswith("RAY_SERVE_")}
        path = write_result("serve_hops", hop_rows, args.out, tag=args.label, notes=(
            f"{model}, app arguments {json.dumps({k: v for k, v in app_args.items() if 'tracing' not in k})}, "
            f"Ray Serve environment {json.dumps(env)}. Segment rows: medians of {args.breakdown} streamed greedy "
            f"requests one at a time per lane (x-lane header forcing it), {args.max_tokens} tokens each "
            "(ignore_eos), each request's spans on one clock, ms (to_ingress: client to the HTTP span; ingress: to "
            "the router's route span; to_replica: to replica.generate; to_engine: to the engine's generation span; "
            "engine: its own time to first token; back: first token to the client; ttft: client; added: ttft - "
            "engine, per request). CPU rows: each serving process's CPU time per output token of the standard "
            f"lane, {4 * args.cpu_per_token} requests x 64 tokens at that concurrency."))
        print(f"wrote {path}")
    serve.shutdown()
    ray.shutdown()
    receiver.stop()


if __name__ == "__main__":
    main()

"""Serving benchmark against a running server, in the manner of ``vllm bench serve``.

A streaming client (``httpx``, SSE) sends ``--num-prompts`` requests to
``/v1/completions`` either at ``--request-rate`` requests/s (Poisson arrivals,
exponential gaps seeded by ``--seed``; ``inf`` sends all at once) and/or capped
at ``--max-concurrency`` in flight, and measures per request:

* **TTFT**: send → first streamed chunk with text;
* **ITL**: gaps between consecutive streamed chunks (a persistent-lane quantum
  arrives as one chunk, so its tokens share one gap, as in vLLM's client);
* **TPOT**: ``(E2EL − TTFT) / (output tokens − 1)`` (requests with > 1 token);
* **E2EL**: send → last byte.

Output tokens come from the stream's final usage chunk. The summary has mean,
median and p99 of each (ms), request and token throughput, and the same per
lane (from the ``x-lane`` response header). ``--json`` writes it with the
per-request records; ``--plot`` draws a PNG (TTFT and E2EL per lane);
``--results DIR --label LABEL`` writes the ``serving`` study's result file there
(:mod:`benchmarks.results`; ``--from-json FILE`` writes it from a saved run instead of running one).

Prompts: ``--dataset random`` (token-id prompts of exactly ``--random-input-len``
tokens, ids drawn uniformly from ``[--random-id-low, --random-id-high)``, with
``ignore_eos`` so every request makes ``--random-output-len`` tokens), or
``--dataset gsm8k`` (GSM8K test questions as ``Question: ...\\nAnswer:`` text).
``--num-warmups`` requests (default 1) run first and are not counted.

Usage::

    python -m benchmarks.serve --base-url http://127.0.0.1:8000 --num-prompts 50 \\
        --max-concurrency 1 --dataset random --random-input-len 128 --random-output-len 64 \\
        --json bench.json --plot bench.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from tqdm.auto import tqdm

from ops.tools import gsm8k


@dataclass
class RequestRecord:
    """What the client measured for one request (seconds; ``ok`` False with ``error`` on failure)."""

    ok: bool = False
    lane: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def random_prompts(n: int, input_len: int, low: int, high: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``input_len`` token ids drawn uniformly from ``[low, high)``."""
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(input_len)] for _ in range(n)]


def gsm8k_prompts(n: int, path: Path, seed: int | None) -> list[str]:
    """``n`` GSM8K questions (cycled if the file has fewer) as zero-shot ``Question/Answer`` prompts."""
    problems = gsm8k.select(gsm8k.load(path), None, seed)
    return [gsm8k.fewshot_prompt([], problems[i % len(problems)].question) for i in range(n)]


async def _one(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> RequestRecord:
    rec = RequestRecord()
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            rec.lane = r.headers.get("x-lane")
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    rec.error = str(event["error"])
                    return rec
                if event.get("usage"):
                    rec.prompt_tokens = event["usage"]["prompt_tokens"]
                    rec.output_tokens = event["usage"]["completion_tokens"]
                if any(c.get("text") for c in event.get("choices", [])):
                    now = time.perf_counter()
                    if rec.ttft is None:
                        rec.ttft = now - start
                    else:
                        rec.itl.append(now - last)
                    last = now
        rec.e2el = time.perf_counter() - start
        rec.ok = True
    except httpx.HTTPError as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    return rec


async def run(base_url: str, model: str, prompts: list, output_len: int, request_rate: float,
              max_concurrency: int | None, temperature: float, ignore_eos: bool, lane: str | None,
              seed: int, progress: bool = True, timeout: float = 600.0) -> tuple[list[RequestRecord], float]:
    """Send every prompt; return the records (in prompt order) and the wall time (s)."""
    rng = random.Random(seed)
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"x-lane": lane} if lane else {}
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(prompts), desc="requests", disable=not progress)

    async def send(client, prompt) -> RequestRecord:
        body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": temperature,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
        if limit is None:
            rec = await _one(client, url, body, headers)
        else:
            async with limit:
                rec = await _one(client, url, body, headers)
        bar.update(1)
        return rec

    limits = httpx.Limits(max_connections=max_concurrency or len(prompts) or 1)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(send(client, prompt)))
            if math.isfinite(request_rate) and request_rate > 0:
                await asyncio.sleep(rng.expovariate(request_rate))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(records), duration


def _stats_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]  # nearest rank
    return {"mean": 1000 * statistics.fmean(values), "median": 1000 * statistics.median(values),
            "p99": 1000 * p99}


def summarize(records: list[RequestRecord], duration: float) -> dict:
    """Throughput and TTFT/TPOT/ITL/E2EL (mean, median, p99 in ms), overall and per lane."""
    ok = [r for r in records if r.ok]

    def block(rs: list[RequestRecord]) -> dict:
        out_tokens = sum(r.output_tokens for r in rs)
        return {
            "completed": len(rs),
            "output_tokens": out_tokens,
            "request_throughput": len(rs) / duration if duration else 0.0,
            "output_throughput": out_tokens / duration if duration else 0.0,
            "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in rs)) / duration if duration else 0.0,
            "ttft_ms": _stats_ms([r.ttft for r in rs if r.ttft is not None]),
            "tpot_ms": _stats_ms([r.tpot for r in rs if r.tpot is not None]),
            "itl_ms": _stats_ms([g for r in rs for g in r.itl]),
            "e2el_ms": _stats_ms([r.e2el for r in rs]),
        }

    lanes = sorted({r.lane or "unknown" for r in ok})
    return {
        "duration_s": duration, "num_prompts": len(records), "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        **block(ok),
        "per_lane": {lane: block([r for r in ok if (r.lane or "unknown") == lane]) for lane in lanes},
    }


def format_summary(s: dict) -> str:
    """The summary as the text table printed at the end of a run."""
    lines = ["============ Serving Benchmark Result ============",
             f"Successful requests: {s['completed']:>10}", f"Failed requests: {s['failed']:>14}",
             f"Benchmark duration (s): {s['duration_s']:>10.2f}",
             f"Request throughput (req/s): {s['request_throughput']:>8.2f}",
             f"Output token throughput (tok/s): {s['output_throughput']:>6.2f}",
             f"Total token throughput (tok/s): {s['total_token_throughput']:>7.2f}"]
    scopes = [("all", s)] + [(f"lane={k}", v) for k, v in s["per_lane"].items()]
    lines.append(f"{'scope':<18}{'n':>4}  {'metric':<6}{'mean':>10}{'median':>10}{'p99':>10}  (ms)")
    for name, b in scopes:
        for metric in ("ttft", "tpot", "itl", "e2el"):
            st = b[f"{metric}_ms"]
            cells = "".join(f"{v:>10.2f}" if v is not None else f"{'-':>10}" for v in st.values())
            lines.append(f"{name:<18}{b['completed']:>4}  {metric.upper():<6}{cells}")
    lines.append("=" * 50)
    return "\n".join(lines)


def plot(records: list[RequestRecord], path: Path) -> None:
    """PNG: TTFT and E2EL per request, one colour per lane."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    lanes = sorted({r.lane or "unknown" for r in records if r.ok})
    for lane in lanes:
        rs = [r for r in records if r.ok and (r.lane or "unknown") == lane]
        axes[0].hist([1000 * r.ttft for r in rs if r.ttft is not None], bins=20, alpha=0.6, label=lane)
        axes[1].hist([1000 * r.e2el for r in rs], bins=20, alpha=0.6, label=lane)
    for ax, title in zip(axes, ("TTFT (ms)", "E2E latency (ms)"), strict=True):
        ax.set_title(title)
        ax.set_ylabel("requests")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summary_rows(label: str, summary: dict) -> list[dict]:
    """The ``serving`` study's rows (:mod:`benchmarks.studies`): one per scope (all requests, then each lane),
    medians and p99s in ms."""
    rows = []
    for scope, b in [("all", summary)] + sorted(summary["per_lane"].items()):
        rows.append({"label": label, "scope": scope, "completed": b["completed"],
                     "output_tok_s": b["output_throughput"], "ttft_ms_median": b["ttft_ms"]["median"],
                     "ttft_ms_p99": b["ttft_ms"]["p99"], "tpot_ms_median": b["tpot_ms"]["median"],
                     "e2el_ms_median": b["e2el_ms"]["median"]})
    return rows


def save_result(label: str, summary: dict, out: Path) -> Path:
    """Write the ``serving`` result of ``summary`` into ``out`` (:func:`benchmarks.results.write_result`)."""
    from benchmarks.results import write_result

    meta = summary.get("meta", {})
    notes = (f"Server: {meta.get('server', 'persistent-serve')}; {meta.get('cpus', '?')} CPUs, 1-minute load "
             f"average {meta.get('load_before', '?')} before the run.")
    return write_result("serving", summary_rows(label, summary), out, command=meta.get("command"), notes=notes,
                        tag=label)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s with Poisson arrivals; inf sends all at t=0")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--dataset", choices=("random", "gsm8k"), default="random")
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=64,
                   help="max_tokens of every request (random: exactly this many, ignore_eos)")
    p.add_argument("--random-id-low", type=int, default=100)
    p.add_argument("--random-id-high", type=int, default=20000)
    p.add_argument("--gsm8k-file", type=Path, default=gsm8k.DEFAULT_DATA_DIR / gsm8k.TEST_FILE)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (greedy) makes requests persistent-eligible")
    p.add_argument("--lane", choices=("standard", "persistent"), default=None,
                   help="force a lane with the x-lane request header")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-warmups", type=int, default=1,
                   help="requests sent one at a time before measuring (not counted; as vLLM's test run)")
    p.add_argument("--json", type=Path, default=None, help="write the summary and per-request records here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG of TTFT and E2EL per lane here")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--results", type=Path, default=None,
                   help="write the `serving` study result here (benchmarks/results keeps what the docs show)")
    p.add_argument("--label", default="run", help="the scenario's label in the result (e.g. concurrency-4-auto)")
    p.add_argument("--from-json", type=Path, default=None,
                   help="with --results: write the result of a saved --json run instead of running")
    p.add_argument("--server", default="persistent-serve (embedded SmolLM2-135M, CPU)",
                   help="how the server was started (recorded in the result's notes)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print and return the summary (see :func:`summarize`)."""
    args = parse_args(argv)
    if args.from_json:
        summary = json.loads(args.from_json.read_text())
        print(format_summary(summary))
        if args.results:
            save_result(args.label, summary, args.results)
        return summary
    meta = {"command": "python -m benchmarks.serve " + shlex.join(sys.argv[1:] if argv is None else argv),
            "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "load_before": os.getloadavg()[0],
            "server": args.server}
    model = args.model or httpx.get(args.base_url.rstrip("/") + "/v1/models", timeout=30).json()["data"][0]["id"]
    if args.dataset == "random":
        prompts = random_prompts(args.num_prompts, args.random_input_len, args.random_id_low,
                                 args.random_id_high, args.seed)
        ignore_eos = True
    else:
        prompts = gsm8k_prompts(args.num_prompts, args.gsm8k_file, args.seed)
        ignore_eos = False
    if args.num_warmups:
        asyncio.run(run(args.base_url, model, prompts[:1] * args.num_warmups, args.random_output_len, float("inf"),
                        1, args.temperature, ignore_eos, args.lane, args.seed, progress=False))
    records, duration = asyncio.run(run(
        args.base_url, model, prompts, args.random_output_len, args.request_rate, args.max_concurrency,
        args.temperature, ignore_eos, args.lane, args.seed, progress=not args.no_progress))
    summary = summarize(records, duration)
    summary["config"] = {k: (str(v) if isinstance(v, Path) or v == float("inf") else v)
                         for k, v in vars(args).items()} | {"model": model}
    summary["meta"] = meta
    print(format_summary(summary))
    if args.json:
        args.json.write_text(json.dumps({**summary, "requests": [asdict(r) | {"tpot": r.tpot} for r in records]},
                                        indent=2))
    if args.plot:
        plot(records, args.plot)
    if args.results:
        save_result(args.label, summary, args.results)
    return summary


if __name__ == "__main__":
    main()

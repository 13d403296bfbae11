"""Standard-lane throughput and TTFT against transformers ``generate`` (CPU benchmark, not a test).

For each concurrency ``c`` (default 1, 8, 32) both sides run the same ``c``
chat-templated GSM8K prompts (the first ``c`` questions), greedy, with exactly
``--max-tokens`` output tokens per request (equal work on both sides):

* **ours**: one :class:`~replicas.engine.LLMEngine`; all ``c`` requests are
  added at ``t0`` (``ignore_eos=True``) and ``step()`` runs until done. TTFT of
  a request = time from ``t0`` to its first chunk; throughput = output tokens /
  wall time.
* **transformers**: ``AutoModelForCausalLM`` (fp32) ``generate`` over the ``c``
  prompts as one left-padded batch (``do_sample=False``,
  ``min_new_tokens = max_new_tokens = --max-tokens``). Without a streamer, its
  TTFT is the wall time of a separate ``generate(max_new_tokens=1)`` on the
  same batch (one number for the whole batch); throughput = ``c * max_tokens``
  / wall time of the full ``generate``.

It also reports how many requests produced the same greedy tokens on both
sides (left padding can shift numerics slightly; a mismatch is reported, not
an error). The table is printed last; ``--results DIR`` writes the
``cpu_standard_lane`` study's result file (:mod:`benchmarks.results`) and ``--plot FILE`` a PNG.

Usage: ``python -m benchmarks.standard [--concurrency 1 8 32] [--max-tokens 64]
[--num-prompts N] [--model smollm2-135m-instruct] [--threads T] [--results DIR]
[--json out.json]``
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

GSM8K_PATH = Path("/work/shared/data/gsm8k/test.jsonl")
HF_TTFT_NOTE = (
    "HF TTFT = wall time of a separate generate(max_new_tokens=1) on the same "
    "left-padded batch (no streamer; one number per batch; it includes generate()'s per-call setup)."
)


# --------------------------------------------------------------------------- prompts


def load_questions(path: Path, n: int) -> list[str]:
    """The first ``n`` ``"question"`` fields of a GSM8K JSONL file.

    Raises:
        ValueError: the file holds fewer than ``n`` questions.
    """
    questions: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if len(questions) >= n:
                break
            if line.strip():
                questions.append(json.loads(line)["question"])
    if len(questions) < n:
        raise ValueError(f"{path} has {len(questions)} questions, {n} requested")
    return questions


def chat_prompts(tokenizer, questions: list[str]) -> list[list[int]]:
    """Token ids of each question as one user turn, chat template + generation prompt applied."""
    prompts = []
    for q in questions:
        enc = tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        ids = enc["input_ids"] if hasattr(enc, "keys") else enc  # transformers 5 returns a BatchEncoding
        prompts.append([int(t) for t in ids])
    return prompts


# --------------------------------------------------------------------------- statistics


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank ``q``-quantile (``q`` in [0, 1]) of non-empty ``values``, same unit as them."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


# --------------------------------------------------------------------------- ours


def load_engine(model: str, threads: int | None):
    """Load :class:`EngineCore` for ``model`` and wrap it in one :class:`LLMEngine` (~3 s for SmolLM2)."""
    from replicas.config import EngineConfig
    from replicas.engine import EngineCore, LLMEngine

    core = EngineCore.load(EngineConfig(model=model, torch_threads=threads, progress=False))
    return LLMEngine(core)


def run_ours(engine, prompts: list[list[int]], max_tokens: int, tag: str, progress: bool = True) -> dict:
    """Add every prompt at ``t0`` and step the engine until all are done.

    Returns:
        ``wall_s`` (s), ``cpu_s`` (process CPU s, all threads), ``tok_s``
        (output tokens / s), ``output_tokens``,
        ``ttft_s`` (per request, s from ``t0`` to its first chunk),
        ``end_s`` (per request, s from ``t0`` to its last chunk),
        ``step_s`` (each ``step()``'s duration, s), ``tokens`` (per request ids).
    """
    from replicas.request import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    index = {rid: i for i, rid in enumerate(ids)}
    ttft: list[float | None] = [None] * len(prompts)
    end: list[float | None] = [None] * len(prompts)
    tokens: list[list[int]] = [[] for _ in prompts]
    steps: list[float] = []
    bar = tqdm(total=len(prompts) * max_tokens, desc=f"ours c={len(prompts)}", unit="tok",
               leave=False, disable=not progress)
    cpu0, t0 = time.process_time(), time.perf_counter()
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, params)
    while engine.has_unfinished():
        ts = time.perf_counter()
        chunks = engine.step()
        now = time.perf_counter()
        steps.append(now - ts)
        for ch in chunks:
            i = index[ch.request_id]
            if ttft[i] is None:
                ttft[i] = now - t0
            tokens[i].extend(ch.token_ids)
            if ch.finish_reason is not None:
                end[i] = now - t0
        bar.update(sum(len(ch.token_ids) for ch in chunks))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    bar.close()
    total = sum(len(t) for t in tokens)
    return {"wall_s": wall, "cpu_s": cpu, "tok_s": total / wall, "output_tokens": total, "ttft_s": ttft,
            "end_s": end, "step_s": steps, "tokens": tokens}


# --------------------------------------------------------------------------- transformers


def load_hf(model: str, threads: int | None):
    """Load the transformers reference: fp32 ``AutoModelForCausalLM`` + left-padding tokenizer.

    Returns:
        ``(model, tokenizer)``; ``tokenizer.pad_token`` falls back to EOS.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from replicas.models.loader import resolve_model

    if threads:
        torch.set_num_threads(threads)
    path = resolve_model(model, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf, tokenizer


def hf_batch(tokenizer, prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """One left-padded batch: ``input_ids`` and ``attention_mask``, both ``[c, max_prompt_len]``."""
    enc = tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def _hf_generate(model, tokenizer, batch: dict[str, torch.Tensor], new_tokens: int) -> torch.Tensor:
    """Greedy ``generate`` of exactly ``new_tokens`` tokens per row; returns ``[c, new_tokens]`` ids."""
    with torch.inference_mode():
        out = model.generate(
            **batch, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            pad_token_id=tokenizer.pad_token_id, temperature=None, top_p=None, top_k=None,
        )
    return out[:, batch["input_ids"].shape[1]:]


def run_hf(model, tokenizer, prompts: list[list[int]], max_tokens: int, progress: bool = True) -> dict:
    """Time the batch's TTFT (``generate(max_new_tokens=1)``) and the full ``generate``.

    Returns:
        ``ttft_s`` (s, whole batch), ``wall_s`` (s, full generate), ``cpu_s``
        (process CPU s of the full generate, all threads), ``tok_s``
        (``c * max_tokens / wall_s``), ``output_tokens``, ``tokens`` (per request ids).
    """
    batch = hf_batch(tokenizer, prompts)
    with tqdm(total=2, desc=f"HF c={len(prompts)}", unit="generate", leave=False,
              disable=not progress) as bar:
        t = time.perf_counter()
        _hf_generate(model, tokenizer, batch, 1)
        ttft = time.perf_counter() - t
        bar.update()
        cpu0, t = time.process_time(), time.perf_counter()
        out = _hf_generate(model, tokenizer, batch, max_tokens)
        wall, cpu = time.perf_counter() - t, time.process_time() - cpu0
        bar.update()
    tokens = out.tolist()
    total = sum(len(r) for r in tokens)
    return {"ttft_s": ttft, "wall_s": wall, "cpu_s": cpu, "tok_s": total / wall, "output_tokens": total,
            "tokens": tokens}


# --------------------------------------------------------------------------- comparison


def compare_tokens(ours: list[list[int]], hf: list[list[int]], eos_id: int | None) -> dict:
    """Count requests whose greedy tokens are identical on both sides.

    ``min_new_tokens`` masks EOS in transformers while ``ignore_eos`` does not
    in ours, so a divergence where ours picked EOS is counted separately.

    Returns:
        ``identical`` (count), ``total``, ``first_divergence`` (per request:
        index of the first differing token, or None), ``eos_divergences``.
    """
    firsts: list[int | None] = []
    eos_div = 0
    for a, b in zip(ours, hf, strict=True):
        first = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if first is None and len(a) != len(b):
            first = min(len(a), len(b))
        if first is not None and first < len(a) and a[first] == eos_id:
            eos_div += 1
        firsts.append(first)
    return {"identical": sum(f is None for f in firsts), "total": len(firsts),
            "first_divergence": firsts, "eos_divergences": eos_div}


def run_level(engine, hf_model, hf_tokenizer, prompts: list[list[int]], max_tokens: int,
              repeats: int = 1, progress: bool = True) -> dict:
    """Run both sides at concurrency ``len(prompts)`` (alternating, ``repeats`` times) and summarize one row.

    With ``repeats > 1`` each side keeps its fastest run (least wall time), which
    damps interference from other processes on a shared machine.

    Returns:
        ``concurrency``; ``ours`` and ``hf`` (from :func:`run_ours` / :func:`run_hf`,
        token lists dropped); ``speedup`` (ours tok/s ÷ HF tok/s);
        ``ours_ttft_median_ms`` / ``ours_ttft_p90_ms`` / ``hf_ttft_ms`` (ms);
        ``ours_prefill_step_ms`` (first step) and ``ours_decode_step_ms``
        (median of the others, ms); ``match`` (from :func:`compare_tokens`).
    """
    c = len(prompts)
    ours_runs, hf_runs = [], []
    for _ in range(repeats):
        tag = f"c{c}-{time.monotonic_ns()}"
        ours_runs.append(run_ours(engine, prompts, max_tokens, tag=tag, progress=progress))
        hf_runs.append(run_hf(hf_model, hf_tokenizer, prompts, max_tokens, progress=progress))
    match = compare_tokens(ours_runs[0]["tokens"], hf_runs[0]["tokens"], hf_tokenizer.eos_token_id)
    ours = dict(min(ours_runs, key=lambda r: r["wall_s"]))
    hf = dict(min(hf_runs, key=lambda r: r["wall_s"]))
    ours.pop("tokens")
    hf.pop("tokens")
    ttft = [t for t in ours["ttft_s"] if t is not None]
    steps = ours["step_s"]
    return {
        "concurrency": c, "max_tokens": max_tokens, "repeats": repeats, "ours": ours, "hf": hf,
        "speedup": ours["tok_s"] / hf["tok_s"],
        "ours_ttft_median_ms": statistics.median(ttft) * 1e3,
        "ours_ttft_p90_ms": percentile(ttft, 0.9) * 1e3,
        "hf_ttft_ms": hf["ttft_s"] * 1e3,
        "ours_prefill_step_ms": steps[0] * 1e3,
        "ours_decode_step_ms": statistics.median(steps[1:]) * 1e3 if len(steps) > 1 else None,
        "match": match,
    }


def warm_up(engine, hf_model, hf_tokenizer, prompt: list[int]) -> None:
    """One short untimed run on each side (first-call allocations, lazy init)."""
    run_ours(engine, [prompt], 4, tag=f"warmup-{time.monotonic_ns()}", progress=False)
    run_hf(hf_model, hf_tokenizer, [prompt], 4, progress=False)


# --------------------------------------------------------------------------- report


def format_table(rows: list[dict]) -> str:
    """Markdown table: concurrency | ours tok/s | HF tok/s | speedup | TTFTs (ms) | identical."""
    lines = [
        "| concurrency | ours tok/s | HF tok/s | speedup | ours TTFT median/p90 (ms) | HF TTFT (ms) | identical |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        m = r["match"]
        lines.append(
            f"| {r['concurrency']} | {r['ours']['tok_s']:.1f} | {r['hf']['tok_s']:.1f} | "
            f"{r['speedup']:.2f}x | {r['ours_ttft_median_ms']:.0f} / {r['ours_ttft_p90_ms']:.0f} | "
            f"{r['hf_ttft_ms']:.0f} | {m['identical']}/{m['total']} ({100 * m['identical'] / m['total']:.0f}%) |"
        )
    return "\n".join(lines)


def hf_decode_step_ms(row: dict) -> float | None:
    """transformers' mean decode step, ms, derived: (full generate - 1-token generate) / (max_tokens - 1)."""
    if row["max_tokens"] < 2:
        return None
    return (row["hf"]["wall_s"] - row["hf"]["ttft_s"]) / (row["max_tokens"] - 1) * 1e3


def format_steps(rows: list[dict], threads: int = 1) -> str:
    """Per level: prefill and decode step (ms) on both sides, CPU ms per output token, CPU use (:func:`cpu_use`)."""
    out = []
    for r in rows:
        o, h = r["ours"], r["hf"]
        dec, hf_dec = r["ours_decode_step_ms"], hf_decode_step_ms(r)
        dec_s = f"{dec:.1f} ms" if dec is not None else "n/a"
        hf_dec_s = f"{hf_dec:.1f} ms" if hf_dec is not None else "n/a"
        out.append(
            f"c={r['concurrency']}: prefill ours {r['ours_prefill_step_ms']:.0f} ms (first step), HF "
            f"{r['hf_ttft_ms']:.0f} ms (1-token generate); decode step ours {dec_s} (median of "
            f"{len(o['step_s']) - 1}), HF {hf_dec_s} (mean, derived); CPU per output token ours "
            f"{o['cpu_s'] / o['output_tokens'] * 1e3:.1f} ms, HF {h['cpu_s'] / h['output_tokens'] * 1e3:.1f} ms; "
            f"CPU use ours {100 * cpu_use(o, threads):.0f}%, HF {100 * cpu_use(h, threads):.0f}%"
        )
    return "\n".join(out)


def _cpu_model() -> str:
    """CPU model name from ``/proc/cpuinfo`` (or ``platform.processor()``)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        m = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
        if m:
            return m.group(1).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_gib() -> float | None:
    """Total RAM in GiB from ``/proc/meminfo``, or None."""
    try:
        m = re.search(r"^MemTotal:\s*(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
        return int(m.group(1)) / 2**20 if m else None
    except OSError:
        return None


def machine_info() -> dict:
    """CPU model, logical cores, RAM (GiB), torch threads, versions, date (UTC) and 1-min load average."""
    import transformers

    return {
        "cpu": _cpu_model(), "cores": os.cpu_count(), "ram_gib": _ram_gib(),
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "transformers": transformers.__version__, "python": platform.python_version(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def describe_machine(m: dict) -> str:
    """One line naming the machine, from :func:`machine_info`."""
    ram = f"{m['ram_gib']:.0f} GiB RAM" if m.get("ram_gib") else "RAM unknown"
    return (f"{m['cpu']}, {m['cores']} logical cores, {ram}, CPU only, torch {m['torch']} "
            f"({m['torch_threads']} thread{'' if m['torch_threads'] == 1 else 's'}), transformers {m['transformers']}, {m['date']}")


def cpu_use(side: dict, threads: int) -> float:
    """Fraction of the CPU a run could use that it got: ``cpu_s / (wall_s * threads)`` (1.0 = all threads busy)."""
    return side["cpu_s"] / (side["wall_s"] * max(1, threads))


def _throughput_text(rows: list[dict]) -> str:
    """Speedup per level and how each side scales from the first level to the last."""
    text = "Ours vs transformers throughput: " + ", ".join(
        f"{r['speedup']:.2f}x at c={r['concurrency']}" for r in rows) + "."
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        o = last["ours"]["tok_s"] / first["ours"]["tok_s"]
        h = last["hf"]["tok_s"] / first["hf"]["tok_s"]
        text += (f" From c={first['concurrency']} to c={last['concurrency']} our throughput changes "
                 f"{o:.1f}x and transformers' {h:.1f}x.")
    return text


def _cpu_text(rows: list[dict], threads: int) -> str:
    """CPU ms per output token on both sides, and a warning where a side got little of the CPU it asked for."""
    text = ("CPU time per output token (less sensitive than wall time to other processes): " + ", ".join(
        f"ours {1e3 * r['ours']['cpu_s'] / r['ours']['output_tokens']:.0f} ms vs HF "
        f"{1e3 * r['hf']['cpu_s'] / r['hf']['output_tokens']:.0f} ms at c={r['concurrency']}" for r in rows) + ".")
    uses = [cpu_use(r[side], threads) for r in rows for side in ("ours", "hf")]
    starved = sum(u < 0.6 for u in uses)
    if starved:
        text += (f" CPU use was {100 * min(uses):.0f}-{100 * max(uses):.0f}% (under 60% in {starved} of "
                 f"{len(uses)} runs): there, wall time mostly measures waiting for a core, not work.")
    return text


def _step_text(rows: list[dict]) -> str:
    """Time ratios ours / HF for prefill and for one decode step (above 1: ours slower)."""
    rows = [r for r in rows if r["ours_decode_step_ms"] is not None and hf_decode_step_ms(r)]
    if not rows:
        return ""
    return "Time ratio ours / HF (above 1: ours slower): " + ", ".join(
        f"prefill {r['ours_prefill_step_ms'] / r['hf_ttft_ms']:.2f}, decode step "
        f"{r['ours_decode_step_ms'] / hf_decode_step_ms(r):.2f} at c={r['concurrency']}" for r in rows) + "."


def _ttft_text(rows: list[dict]) -> str:
    """Our TTFT (one prefill step of the whole batch, packed) next to HF's (padded batch)."""
    return ("TTFT: all c requests are prefilled in our first step, prompts packed without padding "
            "(transformers pads to the longest), so every request of a level sees about the same TTFT: " + ", ".join(
                f"ours {r['ours_ttft_median_ms']:.0f} ms vs HF {r['hf_ttft_ms']:.0f} ms at c={r['concurrency']}"
                for r in rows) + ".")


def _match_text(rows: list[dict]) -> str:
    """How many requests produced the same greedy tokens, and why the others did not."""
    ident = sum(r["match"]["identical"] for r in rows)
    total = sum(r["match"]["total"] for r in rows)
    eos = sum(r["match"]["eos_divergences"] for r in rows)
    text = f"{ident}/{total} requests produced identical greedy tokens on both sides."
    if eos:
        text += (f" Requests that differ: {total - ident}; {eos} of them first differ at a token where ours "
                 "chose EOS, which transformers' min_new_tokens masks (ours only ignores it).")
    if total - ident > eos:
        text += " Other differences come from small numeric differences (padding, kernel order) flipping a near-tie."
    return text


def reading(rows: list[dict], load: tuple[float | None, float | None], threads: int = 1) -> str:
    """A short reading derived from the numbers: throughput, CPU per token, TTFT, token equality, load."""
    parts = [_throughput_text(rows), _step_text(rows), _cpu_text(rows, threads), _ttft_text(rows),
             _match_text(rows)]
    parts = [p for p in parts if p]
    if load[0] is not None:
        parts.append(
            f"The 1-minute load average was {load[0]:.1f} before and {load[1]:.1f} after the run on this "
            f"{os.cpu_count()}-core machine, which other processes shared: treat the numbers as rough.")
    return " ".join(parts)


def result_rows(model: str, rows: list[dict]) -> list[dict]:
    """The ``cpu_standard_lane`` study's rows (:mod:`benchmarks.studies`), one per concurrency level."""
    return [{"shape": model, "concurrency": r["concurrency"], "ours_tok_s": r["ours"]["tok_s"],
             "transformers_tok_s": r["hf"]["tok_s"], "ttft_ms": r["ours_ttft_median_ms"],
             "transformers_ttft_ms": r["hf_ttft_ms"], "decode_step_ms": r["ours_decode_step_ms"],
             "max_tokens": r["max_tokens"], "identical": r["match"]["identical"], "total": r["match"]["total"]}
            for r in rows]


def write_plot(rows: list[dict], path: Path) -> None:
    """Plot output tokens/s vs concurrency for both sides into a PNG (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = [r["concurrency"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(cs, [r["ours"]["tok_s"] for r in rows], "o-", label="ours (LLMEngine)")
    ax.plot(cs, [r["hf"]["tok_s"] for r in rows], "s--", label="transformers generate")
    ax.set_xscale("log", base=2)
    ax.set_xticks(cs, [str(c) for c in cs])
    ax.set_xlabel("concurrency (requests)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Standard lane vs transformers, CPU, {rows[0]['max_tokens']} tokens/request")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line; ``--num-prompts`` defaults to the largest concurrency."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.standard", description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=None, help="GSM8K questions to load (default: max concurrency)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's default)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per level and side, alternating; each side keeps its fastest (default 1)")
    p.add_argument("--data", type=Path, default=GSM8K_PATH)
    p.add_argument("--results", type=Path, default=None,
                   help="write the cpu_standard_lane study result here (benchmarks/results keeps what the docs show)")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG of output tokens/s vs concurrency here")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    args = p.parse_args(argv)
    if args.num_prompts is None:
        args.num_prompts = max(args.concurrency)
    if min(args.concurrency) < 1 or args.max_tokens < 1 or args.repeats < 1:
        p.error("--concurrency, --max-tokens and --repeats must be >= 1")
    if max(args.concurrency) > args.num_prompts:
        p.error(f"--num-prompts {args.num_prompts} < largest concurrency {max(args.concurrency)}")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print the table last and return the results dict.

    Returns:
        ``command``, ``machine`` (:func:`machine_info`), ``rows`` (one per
        concurrency, see :func:`run_level`), ``table`` (markdown), ``hf_ttft_note``,
        ``reading`` (a short reading of the numbers, also in the result's notes).
    """
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    command = " ".join(["python -m benchmarks.standard", *map(shlex.quote, raw)])
    progress = not args.no_progress
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None

    engine = load_engine(args.model, args.threads)
    hf_model, hf_tokenizer = load_hf(args.model, args.threads)
    prompts = chat_prompts(hf_tokenizer, load_questions(args.data, args.num_prompts))
    warm_up(engine, hf_model, hf_tokenizer, prompts[0])

    rows = []
    for c in tqdm(args.concurrency, desc="concurrency levels", disable=not progress):
        rows.append(run_level(engine, hf_model, hf_tokenizer, prompts[:c], args.max_tokens,
                              args.repeats, progress))

    machine = machine_info()
    load_after = machine["loadavg_1m"]
    machine["loadavg_1m_before"] = load_before
    table, steps = format_table(rows), format_steps(rows, machine["torch_threads"])
    text = reading(rows, (load_before, load_after), machine["torch_threads"])
    result = {"command": command, "machine": machine, "rows": rows, "table": table,
              "hf_ttft_note": HF_TTFT_NOTE, "reading": text}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if args.plot:
        write_plot(rows, args.plot)
    if args.results:
        from benchmarks.results import write_result

        notes = (f"{describe_machine(machine)}. Same chat-templated GSM8K prompts on both sides, greedy, "
                 f"{args.max_tokens} tokens per request. {HF_TTFT_NOTE} {text}")
        print(f"wrote {write_result('cpu_standard_lane', result_rows(args.model, rows), args.results, command=command, notes=notes)}")

    print(f"\nMachine: {describe_machine(machine)}")
    print(f"Prompts: first {max(args.concurrency)} of {args.num_prompts} GSM8K questions, chat-templated; "
          f"{args.max_tokens} greedy output tokens per request on both sides.")
    print(HF_TTFT_NOTE)
    print(steps)
    print()
    print(table)
    return result


if __name__ == "__main__":
    main()

"""What each lane costs the other when they share a GPU (or CPU): co-located or fractional replicas.

Against a running server, three runs of ``--rounds`` rounds each, every request greedy with
``--prompt-len`` random token ids and exactly ``--max-tokens`` output tokens (``ignore_eos``), lanes
forced with the ``x-lane`` header (``benchmarks.serve`` is the client):

* ``persistent alone``: one persistent stream;
* ``standard alone``: ``--standard-streams`` standard streams at once;
* ``together``: both at the same time.

Printed per lane: TTFT, TPOT and ITL medians alone and together, and the ratio together / alone
(what the other lane costs it). On a co-located replica the engine runs a standard step and a
persistent quantum in turn, so each lane's decode time grows by the other's step time.

Usage::

    python -m benchmarks.interference --base-url http://127.0.0.1:8000 --standard-streams 4 --json lanes.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path

import httpx

from benchmarks.serve import RequestRecord, random_prompts, run


def _medians(records: list[RequestRecord]) -> dict[str, float | None]:
    ok = [r for r in records if r.ok]

    def med(values):
        values = [v for v in values if v is not None]
        return 1000 * statistics.median(values) if values else None

    return {"ttft_ms": med(r.ttft for r in ok), "tpot_ms": med(r.tpot for r in ok),
            "itl_ms": med(g for r in ok for g in r.itl), "completed": len(ok), "failed": len(records) - len(ok),
            "lanes": sorted({r.lane or "?" for r in ok}), "errors": sorted({r.error for r in records if r.error})[:3]}


async def _lanes(base_url: str, model: str, persistent: list | None, standard: list | None, max_tokens: int,
                 timeout: float) -> tuple[list[RequestRecord], list[RequestRecord]]:
    jobs = []
    if persistent:
        jobs.append(run(base_url, model, persistent, max_tokens, float("inf"), 1, 0.0, True, "persistent", 0,
                        progress=False, timeout=timeout))
    if standard:
        jobs.append(run(base_url, model, standard, max_tokens, float("inf"), len(standard), 0.0, True, "standard",
                        0, progress=False, timeout=timeout))
    results = [records for records, _ in await asyncio.gather(*jobs)]
    p = results.pop(0) if persistent else []
    s = results.pop(0) if standard else []
    return p, s


def measure(base_url: str, model: str | None = None, standard_streams: int = 4, prompt_len: int = 128,
            max_tokens: int = 64, rounds: int = 2, vocab_high: int = 20000, timeout: float = 600.0) -> dict:
    """Run the three runs; return ``{"persistent": {"alone", "together", "cost"}, "standard": {...}}`` with
    medians in ms (:func:`_medians`) and ``cost`` = TPOT together / TPOT alone."""
    if model is None:
        model = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=30).json()["data"][0]["id"]
    prompts = random_prompts(1 + standard_streams, prompt_len, 100, vocab_high, seed=0)
    one, many = prompts[:1], prompts[1:]
    asyncio.run(_lanes(base_url, model, one, many[:1], 8, timeout))  # warm both lanes up
    runs: dict[str, list[list[RequestRecord]]] = {"p_alone": [], "s_alone": [], "p_with": [], "s_with": []}
    for _ in range(rounds):
        runs["p_alone"].append(asyncio.run(_lanes(base_url, model, one, None, max_tokens, timeout))[0])
        runs["s_alone"].append(asyncio.run(_lanes(base_url, model, None, many, max_tokens, timeout))[1])
        p, s = asyncio.run(_lanes(base_url, model, one, many, max_tokens, timeout))
        runs["p_with"].append(p)
        runs["s_with"].append(s)
    flat = {k: [r for rs in v for r in rs] for k, v in runs.items()}
    out = {}
    for lane, alone, together in (("persistent", "p_alone", "p_with"), ("standard", "s_alone", "s_with")):
        a, t = _medians(flat[alone]), _medians(flat[together])
        cost = t["tpot_ms"] / a["tpot_ms"] if a["tpot_ms"] and t["tpot_ms"] else None
        out[lane] = {"alone": a, "together": t, "tpot_cost": cost}
    out["config"] = {"standard_streams": standard_streams, "prompt_len": prompt_len, "max_tokens": max_tokens,
                     "rounds": rounds, "model": model}
    return out


def format_result(result: dict) -> str:
    """The result as the table the command prints."""
    cfg = result["config"]
    lines = [f"Lane interference: 1 persistent stream vs {cfg['standard_streams']} standard streams, prompt "
             f"{cfg['prompt_len']} tokens, {cfg['max_tokens']} output tokens, {cfg['rounds']} rounds (medians, ms)",
             f"{'lane':<11}{'run':<10}{'TTFT':>10}{'TPOT':>10}{'ITL':>10}   served by"]
    for lane in ("persistent", "standard"):
        for run_name in ("alone", "together"):
            m = result[lane][run_name]
            cells = "".join(f"{m[k]:>10.2f}" if m[k] is not None else f"{'-':>10}" for k in ("ttft_ms", "tpot_ms", "itl_ms"))
            lines.append(f"{lane:<11}{run_name:<10}{cells}   {','.join(m['lanes'])}")
        cost = result[lane]["tpot_cost"]
        other = "standard" if lane == "persistent" else "persistent"
        if cost:
            lines.append(f"{'':<11}the {other} lane costs it x{cost:.2f} in TPOT")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.interference", description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None)
    p.add_argument("--standard-streams", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--vocab-high", type=int, default=20000, help="prompt token ids are drawn below this")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    result = measure(args.base_url, args.model, args.standard_streams, args.prompt_len, args.max_tokens,
                     args.rounds, args.vocab_high)
    print(format_result(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()

"""GSM8K accuracy per lane, and whether the persistent lane changes answers (lane equivalence).

Against a running server, for each selected GSM8K test problem and each lane
in ``--lanes`` (forced with the ``x-lane`` request header), one greedy
``/v1/completions`` request with the ``--num-fewshot``-shot prompt
(``Question: ...\\nAnswer: ...`` blocks from the few-shot file, as
lm-evaluation-harness's ``gsm8k`` task). No stop strings are sent, so that
equivalence compares the raw completions over their whole length; each
completion is cut at the next ``Question:`` before scoring. (lm-eval itself
sends its stop strings; both lanes serve them: ``tests/lmeval``.)

Scores per lane: strict match (``#### N`` equals the reference number) and
flexible extraction (the last number in the completion equals it).

Lane equivalence (needs two lanes): the fraction of problems whose raw
completions are identical, and for each difference the first diverging
character position with the text around it. A response served by another lane
than the one forced is counted in ``lane_mismatches`` (e.g. a persistent
request that fell back), so a 100% agreement cannot come from one lane alone.

Data: ``--data-dir`` (default ``../shared/data/gsm8k`` next to the repository)
holding ``test.jsonl`` and ``train_head50.jsonl``; ``--test-file`` and
``--fewshot-file`` override either. ``tests/data/gsm8k`` holds a 4-problem
sample for CI.

Usage::

    python -m ops.tools.eval_gsm8k --base-url http://127.0.0.1:8000 --limit 50 --seed 0 --json gsm8k.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx
from tqdm.auto import tqdm

from ops.tools import gsm8k

LANES = ("persistent", "standard")


def complete(client: httpx.Client, base_url: str, model: str, prompt: str, max_tokens: int,
             lane: str) -> tuple[str, str | None, int]:
    """One greedy completion forced to ``lane``; returns (text, lane that served, output tokens).

    Raises:
        httpx.HTTPStatusError: the server answered with an error.
    """
    r = client.post(base_url.rstrip("/") + "/v1/completions", headers={"x-lane": lane}, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    if r.is_error:  # the server's OpenAI-style message says why (e.g. a prompt past max_model_len)
        raise httpx.HTTPStatusError(f"{r.status_code} from {r.url}: {r.text[:300]}", request=r.request, response=r)
    body = r.json()
    return body["choices"][0]["text"], r.headers.get("x-lane"), body["usage"]["completion_tokens"]


def first_divergence(a: str, b: str) -> int | None:
    """Index of the first differing character (the shorter length if one is a prefix), None if equal."""
    if a == b:
        return None
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def evaluate(base_url: str, problems: list[gsm8k.Problem], shots: list[gsm8k.Problem], lanes: list[str],
             max_tokens: int, model: str | None = None, progress: bool = True, timeout: float = 600.0,
             max_examples: int = 3) -> dict:
    """Run every problem on every lane; return the report (see the module docstring)."""
    with httpx.Client(timeout=timeout) as client:
        if model is None:
            model = client.get(base_url.rstrip("/") + "/v1/models").json()["data"][0]["id"]
        rows = []
        for p in tqdm(problems, desc="gsm8k", disable=not progress):
            prompt = gsm8k.fewshot_prompt(shots, p.question)
            row = {"index": p.index, "target": p.target, "lanes": {}}
            for lane in lanes:
                text, served, n = complete(client, base_url, model, prompt, max_tokens, lane)
                answer = gsm8k.cut(text)
                row["lanes"][lane] = {
                    "completion": text, "served_by": served, "output_tokens": n,
                    "strict": gsm8k.strict_answer(answer), "flexible": gsm8k.flexible_answer(answer),
                }
            rows.append(row)
    report = {"model": model, "num_problems": len(problems), "num_fewshot": len(shots),
              "max_tokens": max_tokens, "lanes": {}}
    for lane in lanes:
        results = [r["lanes"][lane] for r in rows]
        n = max(len(results), 1)
        report["lanes"][lane] = {
            "strict_match": sum(x["strict"] == r["target"] for x, r in zip(results, rows, strict=True)) / n,
            "flexible_extract": sum(x["flexible"] == r["target"] for x, r in zip(results, rows, strict=True)) / n,
            "lane_mismatches": sum(x["served_by"] != lane for x in results),
        }
    if len(lanes) >= 2:
        a, b = lanes[0], lanes[1]
        diffs = []
        for r in rows:
            ta, tb = r["lanes"][a]["completion"], r["lanes"][b]["completion"]
            pos = first_divergence(ta, tb)
            if pos is not None:
                diffs.append({"index": r["index"], "position": pos,
                              a: ta[max(0, pos - 40):pos + 40], b: tb[max(0, pos - 40):pos + 40]})
        report["equivalence"] = {
            "lanes": [a, b], "identical": len(rows) - len(diffs), "total": len(rows),
            "fraction_identical": (len(rows) - len(diffs)) / max(len(rows), 1),
            "first_divergence_positions": [d["position"] for d in diffs],
            "examples": diffs[:max_examples],
        }
    report["problems"] = rows
    return report


def format_report(report: dict) -> str:
    """The human-readable report printed at the end of a run."""
    lines = [f"GSM8K {report['num_fewshot']}-shot, {report['num_problems']} problems, model {report['model']}, "
             f"greedy, max_tokens {report['max_tokens']}"]
    for lane, s in report["lanes"].items():
        lines.append(f"  lane {lane:<10} strict-match {100 * s['strict_match']:6.2f}%   "
                     f"flexible-extract {100 * s['flexible_extract']:6.2f}%   served by another lane: "
                     f"{s['lane_mismatches']}")
    eq = report.get("equivalence")
    if eq:
        a, b = eq["lanes"]
        lines.append(f"  lane equivalence ({a} vs {b}): {eq['identical']}/{eq['total']} completions identical "
                     f"({100 * eq['fraction_identical']:.2f}%)")
        for d in eq["examples"]:
            lines.append(f"    problem {d['index']}: first divergence at character {d['position']}")
            lines.append(f"      {a}: {d[a]!r}")
            lines.append(f"      {b}: {d[b]!r}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ops.tools.eval_gsm8k", description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    p.add_argument("--data-dir", type=Path, default=gsm8k.DEFAULT_DATA_DIR)
    p.add_argument("--test-file", type=Path, default=None, help=f"default: DATA_DIR/{gsm8k.TEST_FILE}")
    p.add_argument("--fewshot-file", type=Path, default=None, help=f"default: DATA_DIR/{gsm8k.FEWSHOT_FILE}")
    p.add_argument("--num-fewshot", type=int, default=3)
    p.add_argument("--limit", type=int, default=None, help="evaluate this many problems")
    p.add_argument("--seed", type=int, default=None, help="sample the problems with this seed (default: the first)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--lanes", default=",".join(LANES), help="comma-separated lanes to force, in order")
    p.add_argument("--json", type=Path, default=None, help="write the full report (with completions) here")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Run the evaluation; print and return the report.

    Raises:
        FileNotFoundError: a data file is missing (the message names the option to set).
        ValueError: an unknown lane in ``--lanes``.
    """
    args = parse_args(argv)
    lanes = [x.strip() for x in args.lanes.split(",") if x.strip()]
    if not lanes or any(lane not in LANES for lane in lanes):
        raise ValueError(f"--lanes must name lanes among {LANES}, got {args.lanes!r}")
    test_file = args.test_file or args.data_dir / gsm8k.TEST_FILE
    fewshot_file = args.fewshot_file or args.data_dir / gsm8k.FEWSHOT_FILE
    for path, option in ((test_file, "--test-file"), (fewshot_file, "--fewshot-file")):
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: set --data-dir or {option}")
    problems = gsm8k.select(gsm8k.load(test_file), args.limit, args.seed)
    shots = gsm8k.load(fewshot_file)[:args.num_fewshot]
    report = evaluate(args.base_url, problems, shots, lanes, args.max_tokens, args.model,
                      progress=not args.no_progress)
    print(format_report(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()

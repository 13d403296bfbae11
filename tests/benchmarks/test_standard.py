"""benchmarks.standard in a tiny mode (c = 1 and 2, 4 tokens, 2 prompts, no docs): sane numbers, table printed."""

from __future__ import annotations

import contextlib
import io
import math

import pytest

from benchmarks import standard as bs

TINY = ["--concurrency", "1", "2", "--max-tokens", "4", "--num-prompts", "2", "--no-progress"]


@pytest.fixture(scope="module")
def tiny_run() -> tuple[dict, str]:
    """Run the benchmark once for the module (~8 s on an idle 2-core CPU); returns (result, stdout)."""
    if not bs.GSM8K_PATH.is_file():
        pytest.skip(f"{bs.GSM8K_PATH} is not available")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = bs.main(TINY)
    return result, out.getvalue()


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_tiny_run_has_sane_numbers(tiny_run):
    result, _ = tiny_run
    rows = result["rows"]
    assert [r["concurrency"] for r in rows] == [1, 2]
    for r in rows:
        c = r["concurrency"]
        for side in ("ours", "hf"):
            assert r[side]["output_tokens"] == c * 4  # exactly max_tokens per request on both sides
            assert _positive(r[side]["tok_s"]) and _positive(r[side]["wall_s"])
        assert len(r["ours"]["ttft_s"]) == c and all(_positive(t) for t in r["ours"]["ttft_s"])
        assert all(t <= e for t, e in zip(r["ours"]["ttft_s"], r["ours"]["end_s"], strict=True))
        assert _positive(r["speedup"]) and _positive(r["hf_ttft_ms"])
        assert _positive(r["ours_ttft_median_ms"]) and r["ours_ttft_p90_ms"] >= r["ours_ttft_median_ms"]
        assert 0 <= r["match"]["identical"] <= r["match"]["total"] == c
    assert result["machine"]["cores"] >= 1 and result["machine"]["torch"]


def test_tiny_run_prints_table_last(tiny_run):
    result, stdout = tiny_run
    table = result["table"].splitlines()
    assert table[0].startswith("| concurrency | ours tok/s | HF tok/s | speedup")
    assert len(table) == 2 + 2  # header, rule, one row per concurrency
    assert table[2].startswith("| 1 |") and table[3].startswith("| 2 |")
    assert stdout.rstrip().endswith(result["table"])  # printed, and printed last
    assert "generate(max_new_tokens=1)" in stdout  # how HF TTFT is measured is stated


def test_result_rows_carry_the_study_fields(tiny_run):
    from benchmarks.studies import STUDIES

    result, _ = tiny_run
    rows = bs.result_rows("smollm2-135m-instruct", result["rows"])
    assert [r["concurrency"] for r in rows] == [r["concurrency"] for r in result["rows"]]
    assert set(STUDIES["cpu_standard_lane"].fields) <= set(rows[0])
    assert rows[0]["ours_tok_s"] == result["rows"][0]["ours"]["tok_s"]

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


def test_write_docs_is_idempotent(tmp_path, tiny_run):
    result, _ = tiny_run
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Existing section\n\nkeep me\n")
    section = bs.docs_section(result["command"], result["machine"], result["table"],
                              bs.format_steps(result["rows"]), result["reading"], "bench_standard.png")
    bs.write_docs(doc, section)
    once = doc.read_text()
    bs.write_docs(doc, section)
    assert doc.read_text() == once
    assert once.count(bs.MARK_START) == 1 and once.count(bs.MARK_END) == 1
    assert "keep me" in once and result["table"] in once and "Command: `python -m benchmarks.standard" in once
    doc.write_text(once + "\nA note after the section.\n")
    bs.write_docs(doc, section.replace("Command:", "Command (rerun):"))
    again = doc.read_text()
    assert again.count(bs.MARK_START) == 1 and "Command (rerun):" in again and "Command: `" not in again
    assert again.endswith(bs.MARK_END + "\n\nA note after the section.\n") and "keep me" in again


def test_percentile_and_compare_tokens():
    assert bs.percentile([3.0], 0.9) == 3.0
    assert bs.percentile([float(i) for i in range(11)], 0.9) == 9.0
    m = bs.compare_tokens([[1, 2, 3], [1, 7, 3], [5, 2]], [[1, 2, 3], [1, 8, 3], [6, 2]], eos_id=7)
    assert m["identical"] == 1 and m["total"] == 3
    assert m["first_divergence"] == [None, 1, 0] and m["eos_divergences"] == 1


def test_rejects_concurrency_above_num_prompts():
    with pytest.raises(SystemExit):
        bs.parse_args(["--concurrency", "4", "--num-prompts", "2"])

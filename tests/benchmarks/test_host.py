"""``benchmarks.host`` on the embedded model (CPU): the three parts add up to each step and a result file is
written with the study's fields."""

from __future__ import annotations

import json


def test_host_benchmark_splits_each_token_and_writes_its_result(tmp_path):
    from benchmarks.host import main
    from benchmarks.studies import STUDIES

    rows = main(["--concurrency", "2", "--sampling", "greedy", "sampled", "--max-tokens", "4", "--repeats", "1",
                 "--label", "test", "--results", str(tmp_path)])
    assert [(r["concurrency"], r["sampling"]) for r in rows] == [(2, "greedy"), (2, "sampled")]
    for r in rows:
        assert r["tokens"] == 8 and r["steps"] == 4  # both requests prefill together, then 3 decode steps
        assert r["forward_ms_per_token"] > 0 and r["host_ms_per_token"] > 0 and r["sample_ms_per_token"] > 0
    (path,) = tmp_path.glob("*_engine_host_test.json")
    doc = json.loads(path.read_text())
    assert doc["study"] == "engine_host" and all(f in doc["rows"][0] for f in STUDIES["engine_host"].fields)

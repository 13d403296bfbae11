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
        assert r["cpu_ms_per_token"] > 0 and r["wall_ms_per_token"] >= r["forward_ms_per_token"]
    (path,) = tmp_path.glob("*_engine_host_test.json")
    doc = json.loads(path.read_text())
    assert doc["study"] == "engine_host" and all(f in doc["rows"][0] for f in STUDIES["engine_host"].fields)


def test_host_benchmark_runs_a_random_weight_shape_under_each_engine_config():
    from benchmarks.host import main

    rows = main(["--shape", "smollm2-135m", "--device", "cpu", "--dtype", "float32", "--prompt-len", "12",
                 "--max-tokens", "3", "--concurrency", "2", "--sampling", "greedy", "--repeats", "1",
                 "--engine", "", "enable_prefix_caching=true"])
    assert [(r["shape"], r["variant"], r["engine"], r["tokens"]) for r in rows] == [
        ("smollm2-135m", None, {}, 6), ("smollm2-135m", "enable_prefix_caching=true", {"enable_prefix_caching": True}, 6)]

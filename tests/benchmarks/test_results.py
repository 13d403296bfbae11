"""Benchmark results as data: the result files, the studies that name them, and ``docs/benchmarks.md`` generated
from them (it must be the generated page: ``python -m benchmarks docs`` after adding a result)."""

from __future__ import annotations

import json

import pytest

from benchmarks import docs as bench_docs
from benchmarks.__main__ import main as runner
from benchmarks.results import KEYS, RESULTS, load, write_result
from benchmarks.studies import STUDIES


def test_a_written_result_loads_back_with_every_field(tmp_path):
    path = write_result("lane_agreement", [{"check": "persistent == standard", "dtype": "bfloat16",
                                            "shape": "small", "identical": 20, "total": 20, "x": float("nan")}],
                        tmp_path, command="python -m benchmarks.prefill --parts lanes", notes="n", tag="bf16 bi")
    assert path.name.endswith("_lane_agreement_bf16-bi.json")
    (doc,) = load(tmp_path)
    assert set(KEYS) <= set(doc) and doc["notes"] == "n" and doc["rows"][0]["x"] is None
    assert doc["command"] == "python -m benchmarks.prefill --parts lanes" and doc["git_commit"]


def test_unknown_studies_and_malformed_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown study"):
        write_result("made_up", [], tmp_path)
    (tmp_path / "bad.json").write_text(json.dumps({"study": "batch_one", "rows": "no"}))
    with pytest.raises(ValueError, match="not a benchmark result"):
        load(tmp_path)


def test_the_page_has_a_section_per_study_and_a_table_per_result(tmp_path):
    write_result("standard_sweep", [{"shape": "s", "concurrency": c, "decode_step_ms": 2.0 * c,
                                     "step_floor_ms": 1.0, "output_tok_s": 100.0 * c} for c in (1, 8)],
                 tmp_path, command="cmd")
    text = bench_docs.render(tmp_path)
    for study in STUDIES.values():
        assert study.question in text
    assert "| shape | concurrency | decode step ms | step floor ms | output tok s |" in text
    assert "| s | 8 | 16 | 1 | 800 |" in text
    assert text.count("No result kept yet") == len(STUDIES) - 1


def test_kept_results_are_valid_and_docs_benchmarks_md_is_generated_from_them():
    docs = load(RESULTS)
    assert {d["study"] for d in docs} <= set(STUDIES)
    assert bench_docs.main(["--check"]) == 0, "docs/benchmarks.md is out of date: run python -m benchmarks docs"
    assert bench_docs.DOC.read_text().count("\n") < 400


def test_runner_lists_the_studies(capsys):
    assert runner(["list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in STUDIES)
    assert runner(["run", "made_up"]) == 2


def test_pivot_turns_segment_rows_into_columns_and_keeps_other_rows():
    from benchmarks.docs import pivot

    rows = [{"lane": "persistent", "segment": "ingress", "ms": 2.8},
            {"lane": "persistent", "segment": "engine", "ms": 22.6},
            {"lane": "standard", "segment": "engine", "ms": 30.6},
            {"lane": "standard", "concurrency": 8, "process": "ingress", "cpu_ms_per_token": 0.5},
            {"lane": "standard", "concurrency": 8, "process": "proxy", "cpu_ms_per_token": 0.6},
            {"lane": "standard", "note": "no pivot key"}]
    got = pivot(rows, (("segment", "ms", "{} ms"), ("process", "cpu_ms_per_token", "{} CPU")))
    assert got == [{"lane": "persistent", "ingress ms": 2.8, "engine ms": 22.6},
                   {"lane": "standard", "engine ms": 30.6},
                   {"lane": "standard", "concurrency": 8, "ingress CPU": 0.5, "proxy CPU": 0.6},
                   {"lane": "standard", "note": "no pivot key"}]


def test_a_tree_copied_into_another_checkout_does_not_take_its_commit(tmp_path):
    """On a GPU machine the tree comes without ``.git``; a repository above it is someone else's."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    outer = tmp_path / "outer"
    tree = outer / "tree"
    shutil.copytree(Path(__file__).resolve().parents[2] / "benchmarks", tree / "benchmarks",
                    ignore=shutil.ignore_patterns("results", "__pycache__"))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q", str(outer)], check=True)
    subprocess.run([*git, "-C", str(outer), "commit", "-q", "--allow-empty", "-m", "other"], check=True)
    env = {k: v for k, v in os.environ.items() if k != "GIT_COMMIT"}
    out = subprocess.run([sys.executable, "-c", "from benchmarks.results import git_commit; print(git_commit())"],
                         cwd=tree, env={**env, "PYTHONPATH": str(tree)}, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "unknown"
    from benchmarks.results import git_commit

    assert git_commit() not in ("", "unknown")  # this checkout's own commit

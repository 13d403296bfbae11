"""``benchmarks.prefill --smoke`` (CPU, Triton's interpreter, tiny shapes): the model part runs end to end, writes
its study files, and profiles the sweep's decode steps on a fresh engine whose prompts take several prefill
steps. In a subprocess: the smoke sets ``TRITON_INTERPRET`` and the module's settings for its whole process."""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks.studies import STUDIES


def test_prefill_smoke_writes_its_studies_and_profiles_a_full_decode_step(tmp_path):
    run = subprocess.run([sys.executable, "-m", "benchmarks.prefill", "--smoke", "--parts", "gpt-oss-120b",
                          "--reps", "1", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert (tmp_path / "errors.txt").read_text().strip() == "no errors"
    (sweep,) = tmp_path.glob("*_standard_sweep.json")
    rows = json.loads(sweep.read_text())["rows"]
    assert [r["concurrency"] for r in rows] == [1, 3]
    assert all(f in rows[0] for f in STUDIES["standard_sweep"].fields)
    report = (tmp_path / "report.md").read_text()
    assert "### Where a 3-row decode step's GPU time goes" in report  # the smoke's profiled concurrency
    assert "4 full decode steps profiled" in report
    assert "### Where a 1-row decode step" not in report

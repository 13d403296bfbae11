"""The engine benchmark's CPU mode on a tiny random Llama: it runs every lane and reports sane numbers."""

from __future__ import annotations

import torch

from ops.bench_engine import main


def test_cpu_mode_runs_all_lanes(capsys):
    torch.set_num_threads(1)
    rows = main(["--device", "cpu", "--tiny", "--dtype", "float32", "--prompt-len", "40", "--new-tokens", "10",
                 "--reps", "1"])
    lanes = [r.lane for r in rows]
    assert lanes == ["persistent/cuda_graph", "persistent/eager", "standard", "hf/eager"]
    for r in rows:
        assert r.ttft_ms > 0 and r.tpot_ms > 0 and r.bytes_per_token > 0 and 0 < r.floor_ms < r.tpot_ms
    out = capsys.readouterr().out
    assert "| tiny | persistent/cuda_graph |" in out

"""``ops.bench.ablation``: its ablations name only functions the decode step really calls, and it refuses
to run without a GPU with a clear message (its timings run on the H200 through ``device``)."""

from __future__ import annotations

import inspect

import pytest
import torch

from ops.bench import ablation as bench_ablation
from replicas.models import gpt_oss


def test_every_patched_name_is_called_by_the_decode_step():
    """A replacement of a name the step no longer calls would time the full step and report a cost of 0."""
    source = inspect.getsource(gpt_oss.GptOssForCausalLM.decode_static)
    for name in bench_ablation.PATCHED:
        assert hasattr(gpt_oss, name) and f"{name}(" in source, name
    table = bench_ablation.ablations(bench_ablation._Buffers(torch.device("cpu")))
    assert table["full step"] == {}
    assert all(set(patch) <= set(bench_ablation.PATCHED) for patch in table.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_refuses_to_run_without_a_gpu(capsys):
    assert bench_ablation.main(["--list"]) == []
    assert "no MoE (gate_up + down)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="needs an NVIDIA GPU"):
        bench_ablation.main(["full step"])
    with pytest.raises(SystemExit, match="unknown ablation"):
        bench_ablation.main(["no such kernel"])

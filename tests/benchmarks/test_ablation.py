"""``benchmarks.ablation``: its ablations replace only decode ops the step really calls, on a model of their
own (no runtime name patched), and it refuses to run without a GPU with a clear message (its timings run
on the H200 through ``device``)."""

from __future__ import annotations

import inspect

import pytest
import torch

from benchmarks import ablation as bench_ablation
from replicas.kernels.decode_ops import DecodeOps
from replicas.models import gpt_oss


def test_every_replaceable_op_is_called_by_the_decode_step():
    """A replacement of an op the step no longer calls would time the full step and report a cost of 0."""
    source = inspect.getsource(gpt_oss.GptOssForCausalLM.decode_static)
    for name in bench_ablation.REPLACEABLE:
        assert hasattr(DecodeOps, name) and f"ops.{name}(" in source, name
    table = bench_ablation.ablations(bench_ablation._Buffers(torch.device("cpu")))
    assert table["full step"] == {}
    assert all(set(patch) <= set(bench_ablation.REPLACEABLE) for patch in table.values())


def test_an_ablated_copy_replaces_one_op_and_leaves_the_original_alone():
    ops = DecodeOps.reference(moe=True)
    zeros = bench_ablation.ablated_ops(ops, {"linear": lambda o, x, w, b=None: torch.zeros(x.shape[0], w.shape[0])})
    x, w = torch.ones(2, 3), torch.ones(4, 3)
    assert torch.equal(zeros.linear(x, w), torch.zeros(2, 4))
    assert torch.equal(ops.linear(x, w), torch.full((2, 4), 3.0))
    assert zeros.moe is ops.moe and isinstance(zeros, DecodeOps)
    with pytest.raises(ValueError, match="not replaceable"):
        bench_ablation.ablated_ops(ops, {"forward": lambda o: None})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_refuses_to_run_without_a_gpu(capsys):
    assert bench_ablation.main(["--list"]) == []
    assert "no MoE (gate_up + down)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="needs an NVIDIA GPU"):
        bench_ablation.main(["full step"])
    with pytest.raises(SystemExit, match="unknown ablation"):
        bench_ablation.main(["no such kernel"])

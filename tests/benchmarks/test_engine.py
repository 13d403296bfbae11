"""The engine benchmark's CPU mode on tiny random Llama and GPT-OSS shapes, and its bytes-per-token model."""

from __future__ import annotations

import pytest
import torch

from benchmarks.engine import bytes_per_token, main
from ops.tools.model_shapes import shape_config


def test_cpu_mode_runs_all_lanes_on_both_model_families(capsys, tmp_path):
    torch.set_num_threads(1)
    rows = main(["--device", "cpu", "--tiny", "--dtype", "float32", "--prompt-len", "40", "--new-tokens", "10",
                 "--reps", "1", "--json", str(tmp_path / "rows.json"), "--plot", str(tmp_path / "tpot.png"),
                 "--results", str(tmp_path / "results")])
    lanes = ["persistent/eager", "standard", "hf/eager"]
    assert [(r.shape, r.lane) for r in rows] == [
        ("tiny", "persistent/cuda_graph"), *[("tiny", lane) for lane in lanes],
        ("tiny-gpt-oss", "persistent/cuda_graph"), *[("tiny-gpt-oss", lane) for lane in lanes]]
    for r in rows:
        assert r.ttft_ms > 0 and r.tpot_ms > 0 and r.bytes_per_token > 0 and 0 < r.floor_ms < r.tpot_ms
        assert r.tokens == 10
    out = capsys.readouterr().out
    assert "| tiny-gpt-oss | persistent/cuda_graph | 10 |" in out
    assert (tmp_path / "rows.json").stat().st_size > 0
    assert (tmp_path / "tpot.png").read_bytes()[:4] == b"\x89PNG"
    from benchmarks.results import load

    (result,) = load(tmp_path / "results")  # one file per run, rewritten after every shape
    assert result["study"] == "batch_one" and len(result["rows"]) == len(rows)
    assert {r["lane"] for r in result["rows"]} == {"persistent/cuda_graph", *lanes}
    assert all(r["tpot_ms"] > 0 and r["prompt_tokens"] == 40 for r in result["rows"])


@pytest.mark.parametrize("shape,gigabytes", [("gpt-oss-120b", 5.05), ("gpt-oss-20b", 3.74)])
def test_bytes_per_token_at_the_real_gpt_oss_shapes(shape, gigabytes):
    """~5.0 GB per token for 120b (docs/design.md "Performance floors and peers"): attention + LM head in bf16, 4 of 128 MXFP4 experts."""
    from replicas.models.gpt_oss import GptOssForCausalLM
    from replicas.models.gpt_oss_config import GptOssConfig

    with torch.device("meta"):  # shapes only, nothing allocated
        model = GptOssForCausalLM(GptOssConfig.from_dict(shape_config(shape))).to(torch.bfloat16)
    assert bytes_per_token(model, 1152, 2) / 1e9 == pytest.approx(gigabytes, abs=0.01)


def test_variants_are_engine_config_settings_checked_before_anything_runs():
    from benchmarks.engine import describe_variant, parse_variant

    assert parse_variant("pipeline_quanta=0 moe_backend=triton_tc moe_tiles=pairs:2+depth:2") == {
        "pipeline_quanta": "0", "moe_backend": "triton_tc", "moe_tiles": {"pairs": 2, "depth": 2}}
    assert describe_variant({"pdl": "0", "moe_tiles": {"pairs": 2}}) == "pdl=0 moe_tiles=pairs:2"
    with pytest.raises(ValueError, match="bad setting 'warp'"):
        parse_variant("warp")
    with pytest.raises(ValueError, match="moe_backend"):
        parse_variant("moe_backend=mma")
    with pytest.raises(ValueError, match="warps"):
        parse_variant("warps=9")
    with pytest.raises(ValueError, match="moe_backend"):
        main(["--device", "cpu", "--tiny", "--variants", "moe_backend=gemv"])

"""The tiny GPT-OSS maker writes a loadable HF directory; ``shapes()`` gives the real 20b/120b catalog."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from ops.tools.make_tiny_gpt_oss import (
    checkpoint_bytes,
    main,
    model_config,
    parameter_count,
    shapes,
    tensor_shapes,
    write_real_shape_config,
)
from replicas.models.gpt_oss import GptOssForCausalLM
from replicas.models.gpt_oss_config import GptOssConfig

GB = 1e9


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "gpt-oss"
    assert main([str(out), "--layers", "2", "--experts", "4", "--experts-per-token", "2", "--seed", "3"]) == out
    return out


def test_maker_writes_an_hf_directory(made):
    names = {p.name for p in made.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "chat_template.jinja"} <= names
    raw = json.loads((made / "config.json").read_text())
    assert raw["model_type"] == "gpt_oss" and raw["quantization_config"]["quant_method"] == "mxfp4"
    assert raw["layer_types"] == ["sliding_attention", "full_attention"]
    assert raw["rope_scaling"] == {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                   "truncate": False, "original_max_position_embeddings": 4096}
    assert (raw["sliding_window"], raw["max_position_embeddings"], raw["vocab_size"]) == (128, 4096, 49152)


def test_maker_config_reads_back(made):
    cfg = GptOssConfig.from_dir(made)
    assert (cfg.num_layers, cfg.num_experts, cfg.experts_per_token, cfg.hidden_size) == (2, 4, 2, 64)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (8, 2, 16, 64)
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1 and cfg.quant_method == "mxfp4"
    assert cfg.rope_scaling.original_max_position_embeddings == 4096 and cfg.rope_scaling.mscale > 1.3


def test_maker_tensors_are_the_catalog(made):
    expected = tensor_shapes(json.loads((made / "config.json").read_text()))
    with safe_open(made / "model.safetensors", framework="pt") as f:
        got = {k: (tuple(f.get_slice(k).get_shape()), f.get_tensor(k).dtype) for k in f.keys()}
    assert got == expected
    assert got["model.layers.1.mlp.experts.gate_up_proj_blocks"] == ((4, 128, 2, 16), torch.uint8)
    assert got["model.layers.1.mlp.experts.down_proj_scales"] == ((4, 64, 2), torch.uint8)
    assert got["model.layers.0.self_attn.sinks"] == ((8,), torch.bfloat16)


def test_maker_output_loads_and_tokenizes(made):
    from transformers import AutoTokenizer

    model = GptOssForCausalLM.from_pretrained(made, dtype=torch.float32, progress=False)
    assert model.config.vocab_size == 49152
    tok = AutoTokenizer.from_pretrained(made)
    assert len(tok) == 49152 and tok.eos_token_id == 2
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)
    assert len(ids["input_ids"]) > 3


def test_maker_is_seeded(made, tmp_path):
    main([str(tmp_path), "--layers", "2", "--experts", "4", "--experts-per-token", "2", "--seed", "3"])
    with safe_open(made / "model.safetensors", "pt") as a, safe_open(tmp_path / "model.safetensors", "pt") as b:
        for k in ("model.layers.1.mlp.experts.down_proj_blocks", "lm_head.weight"):
            assert torch.equal(a.get_tensor(k), b.get_tensor(k))


def test_maker_rejects_non_block_sizes():
    kw = dict(layers=1, experts=2, heads=2, kv_heads=1, head_dim=16, vocab_size=10)
    with pytest.raises(ValueError, match="hidden=48 must be a multiple of the MXFP4 block size 32"):
        model_config(hidden=48, intermediate=64, **kw)
    with pytest.raises(ValueError, match="intermediate=40"):
        model_config(hidden=64, intermediate=40, **kw)


# ----------------------------------------------------------------------------------- real shapes


def _formula_params(layers: int, experts: int) -> int:
    """GPT-OSS parameters from docs/design.md "Models" numbers, by hand."""
    h, i, q, kv, vocab = 2880, 2880, 64 * 64, 8 * 64, 201088
    attn = h * (q + 2 * kv) + (q + 2 * kv) + q * h + h + 64  # q/k/v/o weights and biases, sinks
    moe = experts * (h + 1) + experts * (h * 2 * i + 2 * i + i * h + h)  # router; experts with biases
    return layers * (attn + moe + 2 * h) + 2 * vocab * h + h


@pytest.mark.parametrize(("variant", "layers", "experts", "billions"), [("20b", 24, 32, 21), ("120b", 36, 128, 117)])
def test_real_shapes(variant, layers, experts, billions):
    cat = shapes(variant)
    assert len(cat) == 19 * layers + 3
    n = parameter_count(cat)
    assert n == _formula_params(layers, experts)
    assert abs(n / 1e9 - billions) < 0.5, n
    last = f"model.layers.{layers - 1}."
    assert cat[last + "mlp.experts.gate_up_proj_blocks"] == ((experts, 5760, 90, 16), torch.uint8)
    assert cat[last + "mlp.experts.gate_up_proj_scales"] == ((experts, 5760, 90), torch.uint8)
    assert cat[last + "mlp.experts.gate_up_proj_bias"] == ((experts, 5760), torch.bfloat16)
    assert cat[last + "mlp.experts.down_proj_blocks"] == ((experts, 2880, 90, 16), torch.uint8)
    assert cat[last + "mlp.experts.down_proj_bias"] == ((experts, 2880), torch.bfloat16)
    assert cat[last + "mlp.router.weight"] == ((experts, 2880), torch.bfloat16)
    assert cat[last + "self_attn.q_proj.weight"] == ((4096, 2880), torch.bfloat16)
    assert cat[last + "self_attn.k_proj.weight"] == ((512, 2880), torch.bfloat16)
    assert cat[last + "self_attn.o_proj.weight"] == ((2880, 4096), torch.bfloat16)
    assert cat[last + "self_attn.sinks"] == ((64,), torch.bfloat16)
    assert cat["lm_head.weight"] == cat["model.embed_tokens.weight"] == ((201088, 2880), torch.bfloat16)


def test_120b_bytes_match_design_performance_numbers():
    """docs/design.md "Performance floors and peers": ~5.0 GB read per token = experts 1.9 (4 of 128, MXFP4) + attention 1.9 + lm_head 1.16."""
    cat = shapes("120b")
    assert 60 * GB < checkpoint_bytes(cat) < 70 * GB
    layer_bytes = {
        kind: checkpoint_bytes({k: v for k, v in cat.items() if f".{kind}." in k}) for kind in ("self_attn", "experts")
    }
    experts_per_token = layer_bytes["experts"] * 4 / 128
    lm_head = checkpoint_bytes({"lm_head.weight": cat["lm_head.weight"]})
    assert experts_per_token / GB == pytest.approx(1.9, abs=0.05)
    assert layer_bytes["self_attn"] / GB == pytest.approx(1.9, abs=0.05)
    assert lm_head / GB == pytest.approx(1.16, abs=0.01)
    assert (experts_per_token + layer_bytes["self_attn"] + lm_head) / GB == pytest.approx(5.0, abs=0.1)


@pytest.mark.parametrize(("variant", "layers", "experts"), [("20b", 24, 32), ("120b", 36, 128)])
def test_write_real_shape_config(tmp_path, variant, layers, experts):
    path = write_real_shape_config(variant, tmp_path)
    assert path == tmp_path / "config.json" and [p.name for p in tmp_path.iterdir()] == ["config.json"]
    cfg = GptOssConfig.from_dir(tmp_path)
    assert (cfg.num_layers, cfg.num_experts, cfg.experts_per_token) == (layers, experts, 4)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2880, 64, 8, 64)
    assert (cfg.vocab_size, cfg.max_position_embeddings, cfg.sliding_window) == (201088, 131072, 128)
    assert cfg.layer_types[:2] == ("sliding_attention", "full_attention") and len(cfg.layer_types) == layers
    assert cfg.rope_theta == 150000.0 and cfg.rope_scaling.factor == 32.0
    assert cfg.eos_token_ids == (200002,)


def test_unknown_variant():
    with pytest.raises(ValueError, match="unknown GPT-OSS variant '7b'"):
        shapes("7b")

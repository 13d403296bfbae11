"""Tiny random-weight GPT-OSS checkpoints in HF format, and the real 20b/120b tensor shapes.

    python -m ops.tools.make_tiny_gpt_oss OUT_DIR [--layers 4 --experts 8 --hidden 64 ...] [--seed 0]

writes ``config.json`` (``model_type`` gpt_oss, ``layer_types``, YaRN
``rope_scaling``, ``quantization_config`` mxfp4), ``generation_config.json``,
``model.safetensors`` (experts MXFP4-packed as ``*_blocks``/``*_scales``,
everything else bf16 or fp32) and a tokenizer. Nothing can be downloaded, so
the tokenizer is SmolLM2's (the embedded default model's files, 49,152 tokens)
and ``vocab_size`` is its length; hidden stays tiny so the embedding is small.

The tensor names, shapes and dtypes written are :func:`tensor_shapes` of the
config, the same function that gives the real checkpoints' catalog
(:func:`shapes` ``("20b" | "120b")``) without materializing anything.
Source of the real numbers: transformers' ``GptOssConfig`` defaults (the
120b) and docs/design.md "Models" (24 layers / 32 experts for the 20b).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from replicas.kernels.moe.mxfp4 import BLOCK_SIZE, BYTES_PER_BLOCK, quantize_mxfp4

TOKENIZER_MODEL = "smollm2-135m-instruct"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
)
"""Copied from the SmolLM2 checkpoint when present (transformers 5 writes the chat template as a .jinja file)."""

REAL_VARIANTS = {"20b": {"layers": 24, "experts": 32}, "120b": {"layers": 36, "experts": 128}}
"""What differs between the released models; the rest is :data:`REAL_COMMON`."""

REAL_COMMON = {
    "hidden": 2880, "intermediate": 2880, "heads": 64, "kv_heads": 8, "head_dim": 64, "experts_per_token": 4,
    "vocab_size": 201088, "sliding_window": 128, "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096, "bos_token_id": 199998, "eos_token_id": 200002, "pad_token_id": 199999,
}

MODULES_NOT_QUANTIZED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
"""``quantization_config.modules_to_not_convert`` of the released checkpoints: only the experts are MXFP4."""

INIT_STD = {
    "embed": 1.0, "attn": 1.0, "attn_bias": 0.1, "sinks": 1.0, "router": 2.0, "router_bias": 0.1,
    "gate_up": 3.0, "down": 1.0, "expert_bias": 0.5, "norm": 0.1, "lm_head": 4.0,
}
"""Random-init scales, in units of ``1/sqrt(fan_in)`` for matrices (absolute for biases, sinks,
embeddings and the norm weights' noise around 1). Chosen so a tiny model exercises what matters:
attention logits of order 1 (sinks compete, the window changes results), distinct router logits,
gate/up pre-activations of std ~3 so the SwiGLU clamp at 7 is hit, and logits of std ~4."""


def model_config(
    *, layers: int, experts: int, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int,
    vocab_size: int, experts_per_token: int = 4, sliding_window: int = 128, max_position_embeddings: int = 4096,
    original_max_position_embeddings: int = 4096, rope_theta: float = 150000.0, bos_token_id: int | None = None,
    eos_token_id: int | None = None, pad_token_id: int | None = None,
) -> dict:
    """A GPT-OSS ``config.json`` dict, laid out like the released checkpoints'.

    Sliding attention on even layers, full on odd (transformers' default
    ``layer_types``); RoPE theta 150000 with YaRN factor 32, beta_fast 32,
    beta_slow 1, ``truncate`` False (as transformers' GptOssConfig default).
    """
    for dim, name in ((hidden, "hidden"), (intermediate, "intermediate")):
        if dim % BLOCK_SIZE:
            raise ValueError(f"{name}={dim} must be a multiple of the MXFP4 block size {BLOCK_SIZE}")
    if heads % kv_heads:
        raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads}")
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "attention_bias": True,
        "attention_dropout": 0.0,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "experts_per_token": experts_per_token,
        "num_experts_per_tok": experts_per_token,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initial_context_length": original_max_position_embeddings,
        "initializer_range": 0.02,
        "intermediate_size": intermediate,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "max_position_embeddings": max_position_embeddings,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "num_local_experts": experts,
        "output_router_logits": False,
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": MODULES_NOT_QUANTIZED},
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": original_max_position_embeddings,
        },
        "rope_theta": rope_theta,
        "router_aux_loss_coef": 0.9,
        "sliding_window": sliding_window,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": vocab_size,
    }


def real_config(variant: str) -> dict:
    """``config.json`` of gpt-oss-``variant`` (``"20b"`` or ``"120b"``)."""
    if variant not in REAL_VARIANTS:
        raise ValueError(f"unknown GPT-OSS variant {variant!r}; choose from {', '.join(REAL_VARIANTS)}")
    return model_config(**REAL_VARIANTS[variant], **REAL_COMMON)


def tensor_shapes(config: dict, dtype: torch.dtype = torch.bfloat16) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor of the HF checkpoint for ``config``: ``name -> (shape, dtype)``, in file order.

    Experts are MXFP4 (uint8 ``*_blocks [E, rows, cols/32, 16]`` and ``*_scales
    [E, rows, cols/32]``, rows = output features); everything else ``dtype``.
    """
    e, h = config["num_local_experts"], config["hidden_size"]
    i, d = config["intermediate_size"], config["head_dim"]
    nq, nkv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    u8 = torch.uint8
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
        "model.embed_tokens.weight": ((config["vocab_size"], h), dtype),
    }
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out.update({
            p + "input_layernorm.weight": ((h,), dtype),
            p + "self_attn.q_proj.weight": ((nq, h), dtype),
            p + "self_attn.q_proj.bias": ((nq,), dtype),
            p + "self_attn.k_proj.weight": ((nkv, h), dtype),
            p + "self_attn.k_proj.bias": ((nkv,), dtype),
            p + "self_attn.v_proj.weight": ((nkv, h), dtype),
            p + "self_attn.v_proj.bias": ((nkv,), dtype),
            p + "self_attn.o_proj.weight": ((h, nq), dtype),
            p + "self_attn.o_proj.bias": ((h,), dtype),
            p + "self_attn.sinks": ((config["num_attention_heads"],), dtype),
            p + "post_attention_layernorm.weight": ((h,), dtype),
            p + "mlp.router.weight": ((e, h), dtype),
            p + "mlp.router.bias": ((e,), dtype),
            p + "mlp.experts.gate_up_proj_blocks": ((e, 2 * i, h // BLOCK_SIZE, BYTES_PER_BLOCK), u8),
            p + "mlp.experts.gate_up_proj_scales": ((e, 2 * i, h // BLOCK_SIZE), u8),
            p + "mlp.experts.gate_up_proj_bias": ((e, 2 * i), dtype),
            p + "mlp.experts.down_proj_blocks": ((e, h, i // BLOCK_SIZE, BYTES_PER_BLOCK), u8),
            p + "mlp.experts.down_proj_scales": ((e, h, i // BLOCK_SIZE), u8),
            p + "mlp.experts.down_proj_bias": ((e, h), dtype),
        })
    out["model.norm.weight"] = ((h,), dtype)
    out["lm_head.weight"] = ((config["vocab_size"], h), dtype)
    return out


def shapes(variant: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The real gpt-oss-``variant`` checkpoint's tensors, ``name -> (shape, dtype)`` (nothing allocated)."""
    return tensor_shapes(real_config(variant))


def parameter_count(catalog: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    """Model parameters in a :func:`tensor_shapes` catalog: 2 per ``*_blocks`` byte, scales not counted."""
    total = 0
    for name, (shape, _) in catalog.items():
        if name.endswith("_scales"):
            continue
        total += math.prod(shape) * (2 if name.endswith("_blocks") else 1)
    return total


def checkpoint_bytes(catalog: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    """Bytes of all tensors in a catalog (what loading it costs in device memory)."""
    return sum(math.prod(shape) * torch.empty(0, dtype=dt).element_size() for shape, dt in catalog.values())


def write_real_shape_config(variant: str, out_dir: str | Path) -> Path:
    """Write only ``config.json`` of gpt-oss-``variant`` into ``out_dir``; returns its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.json"
    path.write_text(json.dumps(real_config(variant), indent=2) + "\n")
    return path


def _random_tensors(config: dict, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Random weights for every tensor of :func:`tensor_shapes`, experts quantized to MXFP4."""
    gen = torch.Generator().manual_seed(seed)

    def normal(shape, std):
        return torch.randn(shape, generator=gen) * std

    out: dict[str, torch.Tensor] = {}
    for name, (shape, _) in tensor_shapes(config, dtype).items():
        if name.endswith("_scales"):
            continue  # produced with its blocks
        kind = name.rsplit(".", 1)[-1]
        if name.endswith("_blocks"):
            base = name.removesuffix("_blocks")
            rows, cols = shape[1], shape[2] * BLOCK_SIZE
            std = INIT_STD["gate_up" if "gate_up" in base else "down"] / math.sqrt(cols)
            out[name], out[base + "_scales"] = quantize_mxfp4(normal((shape[0], rows, cols), std))
            continue
        if "layernorm" in name or name == "model.norm.weight":
            t = 1.0 + normal(shape, INIT_STD["norm"])
        elif name == "model.embed_tokens.weight":
            t = normal(shape, INIT_STD["embed"])
        elif name == "lm_head.weight":
            t = normal(shape, INIT_STD["lm_head"] / math.sqrt(shape[1]))
        elif kind == "sinks":
            t = normal(shape, INIT_STD["sinks"])
        elif "experts" in name:  # gate_up_proj_bias / down_proj_bias
            t = normal(shape, INIT_STD["expert_bias"])
        elif "router" in name:
            t = normal(shape, INIT_STD["router"] / math.sqrt(shape[1]) if kind == "weight" else INIT_STD["router_bias"])
        else:  # attention projections
            t = normal(shape, INIT_STD["attn"] / math.sqrt(shape[1]) if kind == "weight" else INIT_STD["attn_bias"])
        out[name] = t.to(dtype)
    return out


def copy_tokenizer(out_dir: Path, source: Path | None = None):
    """Copy SmolLM2's tokenizer files into ``out_dir``; returns the loaded tokenizer."""
    from transformers import AutoTokenizer

    if source is None:
        from replicas.models.loader import resolve_model

        source = resolve_model(TOKENIZER_MODEL, progress=False)
    for name in TOKENIZER_FILES:
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, out_dir / name)
    return AutoTokenizer.from_pretrained(out_dir)


def make_tiny_gpt_oss(
    out_dir: str | Path, *, layers: int = 4, experts: int = 8, experts_per_token: int = 4, hidden: int = 64,
    intermediate: int = 64, heads: int = 8, kv_heads: int = 2, head_dim: int = 16, sliding_window: int = 128,
    max_position_embeddings: int = 4096, original_max_position_embeddings: int = 4096,
    dtype: torch.dtype = torch.bfloat16, seed: int = 0, tokenizer_source: Path | None = None,
) -> Path:
    """Write a tiny random GPT-OSS HF directory into ``out_dir`` (created if needed) and return it.

    With head_dim 16 and the original 4096-token context, YaRN's ramp spans
    frequency dims ~2..4.4 of 8, so both its extrapolated and interpolated
    regimes (and the mscale 1.347) are exercised at any length.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = copy_tokenizer(out, tokenizer_source)
    config = model_config(
        layers=layers, experts=experts, experts_per_token=experts_per_token, hidden=hidden,
        intermediate=intermediate, heads=heads, kv_heads=kv_heads, head_dim=head_dim, vocab_size=len(tok),
        sliding_window=sliding_window, max_position_embeddings=max_position_embeddings,
        original_max_position_embeddings=original_max_position_embeddings, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": tok.bos_token_id, "eos_token_id": [tok.eos_token_id], "pad_token_id": tok.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tensors = _random_tensors(config, dtype, seed)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt", "source": "ops.tools.make_tiny_gpt_oss"})
    return out


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m ops.tools.make_tiny_gpt_oss", description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--experts-per-token", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64, help="multiple of 32 (MXFP4 block)")
    parser.add_argument("--intermediate", type=int, default=64, help="multiple of 32 (MXFP4 block)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--sliding-window", type=int, default=128)
    parser.add_argument("--max-position-embeddings", type=int, default=4096)
    parser.add_argument("--original-max-position-embeddings", type=int, default=4096)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="dtype of the non-expert tensors")
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    out = make_tiny_gpt_oss(
        a.out_dir, layers=a.layers, experts=a.experts, experts_per_token=a.experts_per_token, hidden=a.hidden,
        intermediate=a.intermediate, heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim,
        sliding_window=a.sliding_window, max_position_embeddings=a.max_position_embeddings,
        original_max_position_embeddings=a.original_max_position_embeddings, dtype=getattr(torch, a.dtype),
        seed=a.seed,
    )
    print(out)
    return out


if __name__ == "__main__":
    main()

"""Model architectures by name, as ``config.json`` dicts, for ``load_format=dummy`` engines.

Benchmarks (``benchmarks/``), GPU tests and the served GPT-OSS shapes build random-weight models from these
(:func:`write_config_dir` + ``EngineConfig(model=DIR, load_format="dummy")``), so that nothing needs a
checkpoint: the SmolLM2-135M shape, the real gpt-oss-20b and -120b shapes, and tiny CPU smoke shapes.
"""

from __future__ import annotations

import json
from pathlib import Path

from ops.tools.make_tiny_gpt_oss import real_config

SMOLLM2_135M = {
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
    "tie_word_embeddings": True, "eos_token_id": 2, "bos_token_id": 1,
}
"""SmolLM2-135M-Instruct's architecture (its config.json, HF model card)."""

TINY_LLAMA = {**SMOLLM2_135M, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}
"""A two-layer Llama for CPU smoke runs."""

SHAPES = ("smollm2-135m", "gpt-oss-20b", "gpt-oss-120b")
"""The shapes benchmarks run on a GPU; ``tiny`` and ``tiny-gpt-oss`` are CPU smoke shapes."""


def shape_config(shape: str) -> dict:
    """The ``config.json`` dict of ``shape``: a name of :data:`SHAPES`, the CPU smoke shapes ``tiny`` and
    ``tiny-gpt-oss``, or the GPU test shapes ``small-gpt-oss`` (:data:`ops.tools.fixtures.SMALL_GPT_OSS`) and
    ``gpt-oss-20b-4-layers``.

    Raises:
        ValueError: an unknown shape name.
    """
    if shape == "smollm2-135m":
        return dict(SMOLLM2_135M)
    if shape == "tiny":
        return dict(TINY_LLAMA)
    if shape in ("gpt-oss-20b", "gpt-oss-120b"):
        return real_config(shape.removeprefix("gpt-oss-"))
    if shape == "tiny-gpt-oss":
        return {**real_config("20b"), "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 8,
                "vocab_size": 512, "layer_types": ["sliding_attention", "full_attention"], "pad_token_id": 0,
                "eos_token_id": 1}
    if shape == "small-gpt-oss":
        from ops.tools.fixtures import SMALL_GPT_OSS

        return {**real_config("20b"), **SMALL_GPT_OSS}
    if shape == "gpt-oss-20b-4-layers":
        return {**real_config("20b"), "num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2}
    raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}, tiny, tiny-gpt-oss, small-gpt-oss, "
                     "gpt-oss-20b-4-layers")


def write_config_dir(config: str | dict, directory: str | Path, tokenizer: bool = False) -> Path:
    """Write ``config`` (a shape name or a ``config.json`` dict) as ``directory/config.json``; returns the
    directory, a model directory for ``load_format=dummy``. With ``tokenizer``, also a token-id tokenizer
    for it (:func:`write_token_id_tokenizer`), so that the directory can be served over HTTP."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    raw = shape_config(config) if isinstance(config, str) else config
    (directory / "config.json").write_text(json.dumps(raw, indent=1))
    if tokenizer:
        eos = raw.get("eos_token_id")
        write_token_id_tokenizer(directory, raw["vocab_size"], eos[0] if isinstance(eos, list) else eos)
    return directory


def write_token_id_tokenizer(directory: str | Path, vocab_size: int, eos_token_id: int | None = None) -> Path:
    """Write a tokenizer whose every id is a word of its own (``<t0>`` ... ``<tN-1>``, whitespace-split),
    for random-weight models served over HTTP: every id the model emits decodes to text, any id prompt is
    valid, and ``eos_token_id`` is the model's. Not a language tokenizer: benchmarks send token ids.

    Files: ``tokenizer.json`` (a ``tokenizers`` WordLevel model) and ``tokenizer_config.json``, loadable by
    ``transformers.AutoTokenizer``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    directory = Path(directory)
    vocab = {f"<t{i}>": i for i in range(vocab_size)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    eos = f"<t{eos_token_id}>" if eos_token_id is not None else None
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<t0>", eos_token=eos).save_pretrained(directory)
    return directory

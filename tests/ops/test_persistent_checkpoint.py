"""The persistent checkpoint: catalog, compile -> validate round trip, and every corruption caught.

The source is a tiny HF GPT-OSS directory written here (2 layers, H=64, 4 q /
2 kv heads of head_dim 16, E=4 experts, I=64, vocab 128, bf16 with MXFP4
experts, split over two safetensors files with an index), so nothing depends on
other tools.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ops.tools.persistent_checkpoint import (
    SourceError,
    compile_checkpoint,
    main,
    pack_mxfp4,
    unpack_mxfp4,
)
from replicas.persistent.checkpoint import (
    MANIFEST_NAME,
    CheckpointError,
    catalog,
    check_checkpoint_dir,
    validate_checkpoint,
)

ROOT = Path(__file__).resolve().parents[2]
LAYERS = 2
TINY = dict(layers=LAYERS, hidden=64, heads=4, kv_heads=2, head_dim=16, experts=4, inter=64, vocab=128)


def write_hf_gpt_oss(path: Path, *, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                     experts: int, inter: int, vocab: int, tied: bool = False, seed: int = 0) -> dict:
    """Write a random HF GPT-OSS checkpoint (MXFP4 experts, bf16 elsewhere) to ``path``; return its tensors."""
    g = torch.Generator().manual_seed(seed)

    def bf16(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    def u8(*shape):
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)

    t = {"model.embed_tokens.weight": bf16(vocab, hidden), "model.norm.weight": bf16(hidden)}
    if not tied:
        t["lm_head.weight"] = bf16(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = bf16(hidden)
        t[p + "post_attention_layernorm.weight"] = bf16(hidden)
        for name, rows in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
            t[f"{p}self_attn.{name}_proj.weight"] = bf16(rows, hidden)
            t[f"{p}self_attn.{name}_proj.bias"] = bf16(rows)
        t[p + "self_attn.o_proj.weight"] = bf16(hidden, heads * head_dim)
        t[p + "self_attn.o_proj.bias"] = bf16(hidden)
        t[p + "self_attn.sinks"] = bf16(heads)
        t[p + "mlp.router.weight"] = bf16(experts, hidden)
        t[p + "mlp.router.bias"] = bf16(experts)
        t[p + "mlp.experts.gate_up_proj_blocks"] = u8(experts, 2 * inter, hidden // 32, 16)
        t[p + "mlp.experts.gate_up_proj_scales"] = u8(experts, 2 * inter, hidden // 32)
        t[p + "mlp.experts.gate_up_proj_bias"] = bf16(experts, 2 * inter)
        t[p + "mlp.experts.down_proj_blocks"] = u8(experts, hidden, inter // 32, 16)
        t[p + "mlp.experts.down_proj_scales"] = u8(experts, hidden, inter // 32)
        t[p + "mlp.experts.down_proj_bias"] = bf16(experts, hidden)
    path.mkdir(parents=True, exist_ok=True)
    names = sorted(t)
    files = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in files.items():
        save_file({k: t[k] for k in keys}, str(path / file), metadata={"format": "pt"})
    weight_map = {k: file for file, keys in files.items() for k in keys}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "num_hidden_layers": layers,
              "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": head_dim, "num_local_experts": experts, "intermediate_size": inter,
              "vocab_size": vocab, "experts_per_token": 2, "tie_word_embeddings": tied}
    (path / "config.json").write_text(json.dumps(config))
    return t


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "gpt-oss-tiny"
    return path, write_hf_gpt_oss(path, **TINY)


@pytest.fixture(scope="module")
def compiled(source, tmp_path_factory):
    """The tiny source compiled with sha256 into several small shards (read-only: copy to corrupt)."""
    dst = tmp_path_factory.mktemp("persistent") / "ckpt"
    return compile_checkpoint(source[0], dst, shard_size_mb=0.05, sha256=True, progress=False)


def load_all(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def expected_tensors(src: dict, layers: int) -> dict[str, torch.Tensor]:
    """The persistent tensors by definition (docs/persistent_checkpoint.md), built from the HF ones."""
    out = {"embed.weight": src["model.embed_tokens.weight"], "final_norm.weight": src["model.norm.weight"],
           "lm_head.weight": src.get("lm_head.weight", src["model.embed_tokens.weight"])}
    for i in range(layers):
        h, p = f"model.layers.{i}.", f"layers.{i}."
        a, x = h + "self_attn.", h + "mlp.experts."
        out |= {
            p + "attn_norm.weight": src[h + "input_layernorm.weight"],
            p + "attn.qkv.weight": torch.cat([src[f"{a}{n}_proj.weight"] for n in "qkv"]),
            p + "attn.qkv.bias": torch.cat([src[f"{a}{n}_proj.bias"] for n in "qkv"]),
            p + "attn.sinks": src[a + "sinks"],
            p + "attn.o.weight": src[a + "o_proj.weight"],
            p + "attn.o.bias": src[a + "o_proj.bias"],
            p + "mlp_norm.weight": src[h + "post_attention_layernorm.weight"],
            p + "moe.router.weight": src[h + "mlp.router.weight"],
            p + "moe.router.bias": src[h + "mlp.router.bias"],
            p + "moe.gate_up.weight": pack_mxfp4(src[x + "gate_up_proj_blocks"], src[x + "gate_up_proj_scales"]),
            p + "moe.gate_up.bias": src[x + "gate_up_proj_bias"],
            p + "moe.down.weight": pack_mxfp4(src[x + "down_proj_blocks"], src[x + "down_proj_scales"]),
            p + "moe.down.bias": src[x + "down_proj_bias"],
        }
    return out


# ---------------------------------------------------------------- catalog


def test_catalog_is_13_per_layer_plus_3_and_471_for_gpt_oss_120b():
    assert len(catalog(36)) == 13 * 36 + 3 == 471
    assert len(catalog(24)) == 315
    for layers in range(1, 8):
        names = [s.name for s in catalog(layers)]
        assert len(names) == len(set(names)) == 13 * layers + 3
    names = [s.name for s in catalog(2)]
    assert names[0] == "embed.weight" and names[-2:] == ["final_norm.weight", "lm_head.weight"]
    assert names[1:14] == [f"layers.0.{s}" for s in (
        "attn_norm.weight", "attn.qkv.weight", "attn.qkv.bias", "attn.sinks", "attn.o.weight", "attn.o.bias",
        "mlp_norm.weight", "moe.router.weight", "moe.router.bias", "moe.gate_up.weight", "moe.gate_up.bias",
        "moe.down.weight", "moe.down.bias")]
    assert [s.name for s in catalog(2) if s.mxfp4] == [
        f"layers.{i}.moe.{w}.weight" for i in range(2) for w in ("gate_up", "down")]


# ---------------------------------------------------------------- round trip


def test_compile_then_validate_round_trip(source, compiled):
    src_path, src = source
    manifest = validate_checkpoint(compiled, verify_sha256=True)
    assert len(manifest.tensors) == 13 * LAYERS + 3
    assert [r.name for r in manifest.tensors] == [s.name for s in catalog(LAYERS)]
    assert (manifest.format_version, manifest.model_family, manifest.num_layers) == (3, "gpt-oss-tiny", LAYERS)
    assert manifest.model_revision == "local" and manifest.has_sha256
    assert len(manifest.shards) > 1, "the small shard size should split the tensors"
    assert check_checkpoint_dir(compiled)["format_version"] == 3
    assert sorted(p.name for p in compiled.iterdir()) == sorted([*manifest.shards, MANIFEST_NAME, "config.json"])

    stored, want = load_all(compiled), expected_tensors(src, LAYERS)
    assert stored.keys() == want.keys()
    for rec in manifest.tensors:
        t = stored[rec.name]
        assert torch.equal(t, want[rec.name]), rec.name
        assert list(t.shape) == list(rec.shape) and t.numel() * t.element_size() == rec.byte_size
        assert rec.dtype == ("mxfp4" if t.dtype == torch.uint8 else str(t.dtype).removeprefix("torch."))


def test_fused_qkv_is_q_then_k_then_v_rows(source, compiled):
    _, src = source
    stored = load_all(compiled)
    q, k, v = (src[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    qkv = stored["layers.1.attn.qkv.weight"]
    assert qkv.shape == ((4 + 2 + 2) * 16, 64)
    assert torch.equal(qkv, torch.cat([q, k, v])) and torch.equal(qkv[:64], q) and torch.equal(qkv[64:96], k)
    bias = stored["layers.1.attn.qkv.bias"]
    assert torch.equal(bias, torch.cat([src[f"model.layers.1.self_attn.{n}_proj.bias"] for n in "qkv"]))


def test_packed_mxfp4_round_trips_to_the_original_blocks_and_scales(source, compiled):
    _, src = source
    stored = load_all(compiled)
    for w, hf in (("gate_up", "gate_up_proj"), ("down", "down_proj")):
        packed = stored[f"layers.0.moe.{w}.weight"]
        blocks, scales = src[f"model.layers.0.mlp.experts.{hf}_blocks"], src[f"model.layers.0.mlp.experts.{hf}_scales"]
        assert packed.dtype == torch.uint8 and packed.shape == (*scales.shape, 17)
        assert torch.equal(packed[..., :16], blocks) and torch.equal(packed[..., 16], scales)  # the layout
        got_blocks, got_scales = unpack_mxfp4(packed)
        assert torch.equal(got_blocks, blocks) and torch.equal(got_scales, scales)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=3), st.integers(0, 2**31 - 1))
def test_pack_unpack_mxfp4_is_lossless(prefix, seed):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*prefix, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 256, tuple(prefix), generator=g, dtype=torch.uint8)
    b, s = unpack_mxfp4(pack_mxfp4(blocks, scales))
    assert torch.equal(b, blocks) and torch.equal(s, scales)


def test_gpt_oss_head_geometry_gives_a_5120_row_qkv(tmp_path):
    """64 q heads + 8 k + 8 v heads of 64 -> (64+8+8)*64 = 5120 rows, as in GPT-OSS-20b/120b."""
    src = tmp_path / "src"
    write_hf_gpt_oss(src, layers=1, hidden=64, heads=64, kv_heads=8, head_dim=64, experts=2, inter=32, vocab=16)
    manifest = validate_checkpoint(compile_checkpoint(src, tmp_path / "dst", progress=False))
    shapes = {r.name: r.shape for r in manifest.tensors}
    assert shapes["layers.0.attn.qkv.weight"] == (5120, 64) and shapes["layers.0.attn.o.weight"] == (64, 4096)
    assert shapes["layers.0.moe.gate_up.weight"] == (2, 64, 2, 17)  # [E, 2I, H/32, 17]
    assert shapes["layers.0.moe.down.weight"] == (2, 64, 1, 17)  # [E, H, I/32, 17]
    assert len(manifest.shards) == 1 and not manifest.has_sha256


def test_tied_embeddings_give_lm_head_from_the_embedding(tmp_path):
    src = tmp_path / "src"
    t = write_hf_gpt_oss(src, **{**TINY, "layers": 1}, tied=True)
    stored = load_all(compile_checkpoint(src, tmp_path / "dst", progress=False, model_revision="abc123"))
    assert torch.equal(stored["lm_head.weight"], t["model.embed_tokens.weight"])
    assert json.loads((tmp_path / "dst" / MANIFEST_NAME).read_text())["model_revision"] == "abc123"


def test_format_version_2_without_hashes_validates(compiled, tmp_path):
    ckpt = copy_of(compiled, tmp_path)
    edit_manifest(ckpt, lambda m: (m.update(format_version=2), [r.pop("content_sha256") for r in m["tensors"]]))
    assert validate_checkpoint(ckpt).format_version == 2
    assert check_checkpoint_dir(ckpt)["format_version"] == 2


# ---------------------------------------------------------------- source problems


def test_compile_refuses_bad_sources_and_non_empty_destinations(source, tmp_path):
    src_path, _ = source
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(FileExistsError, match="not an empty directory"):
        compile_checkpoint(src_path, tmp_path / "full", progress=False)

    other = tmp_path / "llama"
    shutil.copytree(src_path, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(SourceError, match="not 'gpt_oss'"):
        compile_checkpoint(other, tmp_path / "d1", progress=False)

    (other / "config.json").write_text(json.dumps(cfg))
    shard = other / "model-00001-of-00002.safetensors"
    tensors = load_file(str(shard))
    gone = next(k for k in tensors if k.endswith("sinks"))
    del tensors[gone]
    save_file(tensors, str(shard))
    with pytest.raises(SourceError, match=f"source tensor {gone} is missing"):
        compile_checkpoint(other, tmp_path / "d2", progress=False)

    with pytest.raises(SourceError, match="gpt-oss-120b has 36"):
        compile_checkpoint(src_path, tmp_path / "d3", model_family="gpt-oss-120b", progress=False)


# ---------------------------------------------------------------- corruption


def copy_of(ckpt: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(ckpt, tmp_path / "ckpt"))


def edit_manifest(ckpt: Path, edit) -> None:
    path = ckpt / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def records(m: dict) -> dict[str, dict]:
    return {r["name"]: r for r in m["tensors"]}


def _flip_a_byte_of(ckpt: Path, name: str) -> None:
    rec = records(json.loads((ckpt / MANIFEST_NAME).read_text()))[name]
    shard = ckpt / rec["shard"]
    data = bytearray(shard.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    begin = 8 + header_len + json.loads(data[8:8 + header_len])[name]["data_offsets"][0]
    data[begin] ^= 0xFF
    shard.write_bytes(bytes(data))


def _shard_of(ckpt: Path, name: str) -> Path:
    return ckpt / records(json.loads((ckpt / MANIFEST_NAME).read_text()))[name]["shard"]


def _other_shard(ckpt: Path, name: str) -> str:
    mine = _shard_of(ckpt, name).name
    return next(p.name for p in sorted(ckpt.glob("*.safetensors")) if p.name != mine)


def _add_to_shard(ckpt: Path, name: str) -> None:
    shard = _shard_of(ckpt, name)
    tensors = load_file(str(shard))
    save_file({**tensors, "bogus.weight": torch.zeros(3)}, str(shard), metadata={"format": "pt"})


def _duplicate(m):
    m["tensors"].insert(5, dict(m["tensors"][3]))


def _extra(m):
    m["tensors"].append({**m["tensors"][-1], "name": "layers.2.attn.sinks"})


def _swap(m):
    m["tensors"][3], m["tensors"][4] = m["tensors"][4], m["tensors"][3]


# (kind, tensor named in the message, corruption, caught by the cheap check_checkpoint_dir too)
CORRUPTIONS = [
    ("missing_tensor", "layers.1.attn.sinks",
     lambda c: edit_manifest(c, lambda m: m["tensors"].remove(records(m)["layers.1.attn.sinks"])), True),
    ("extra_tensor", "layers.2.attn.sinks", lambda c: edit_manifest(c, _extra), True),
    ("duplicate_tensor", "layers.0.attn.qkv.bias", lambda c: edit_manifest(c, _duplicate), True),
    ("wrong_order", "layers.0.attn.sinks", lambda c: edit_manifest(c, _swap), True),
    ("wrong_byte_size", "layers.0.attn.o.weight",
     lambda c: edit_manifest(c, lambda m: records(m)["layers.0.attn.o.weight"].update(byte_size=8190)), True),
    ("wrong_dtype", "layers.1.moe.down.weight",
     lambda c: edit_manifest(c, lambda m: records(m)["layers.1.moe.down.weight"].update(dtype="uint8")), True),
    ("wrong_shape", "layers.0.moe.gate_up.weight",
     lambda c: edit_manifest(c, lambda m: records(m)["layers.0.moe.gate_up.weight"].update(shape=[4, 128, 34])),
     True),
    ("unknown_format_version", None, lambda c: edit_manifest(c, lambda m: m.update(format_version=4)), True),
    ("bad_manifest", "embed.weight",
     lambda c: edit_manifest(c, lambda m: m.update(format_version=2)), True),  # v2 cannot carry content_sha256
    ("missing_shard", "embed.weight", lambda c: _shard_of(c, "embed.weight").unlink(), True),
    ("shard_mismatch", "embed.weight",
     lambda c: edit_manifest(c, lambda m: records(m)["embed.weight"].update(shape=[64, 128])), False),
    ("tensor_not_in_shard", "final_norm.weight",
     lambda c: edit_manifest(c, lambda m: records(m)["final_norm.weight"].update(
         shard=_other_shard(c, "final_norm.weight"))), False),
    ("bad_shard", "embed.weight",
     lambda c: os.truncate(_shard_of(c, "embed.weight"), _shard_of(c, "embed.weight").stat().st_size // 2),
     False),
    ("unlisted_tensor", "bogus.weight", lambda c: _add_to_shard(c, "layers.0.attn.sinks"), False),
    ("bad_sha256", "layers.1.moe.gate_up.weight", lambda c: _flip_a_byte_of(c, "layers.1.moe.gate_up.weight"),
     False),
]


@pytest.fixture(scope="module")
def corruption_messages():
    return {}


@pytest.mark.parametrize("kind,tensor,corrupt,cheap", CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_each_corruption_is_caught_with_its_own_message(compiled, tmp_path, corruption_messages,
                                                        kind, tensor, corrupt, cheap):
    ckpt = copy_of(compiled, tmp_path)
    corrupt(ckpt)
    with pytest.raises(CheckpointError) as info:
        validate_checkpoint(ckpt, verify_sha256=True)
    err = info.value
    assert err.kind == kind, str(err)
    assert err.tensor == tensor and (tensor is None or repr(tensor) in str(err)), str(err)
    assert "\n" not in str(err)
    assert str(err) not in corruption_messages.values()
    corruption_messages[kind] = str(err)
    if cheap:  # the build-time check catches manifest-level problems, same kind
        with pytest.raises(CheckpointError) as cheap_info:
            check_checkpoint_dir(ckpt)
        assert cheap_info.value.kind == kind
    else:  # ... and does not read shards
        check_checkpoint_dir(ckpt)


def test_sha256_is_checked_only_when_asked(compiled, tmp_path):
    ckpt = copy_of(compiled, tmp_path)
    edit_manifest(ckpt, lambda m: records(m)["layers.0.attn.sinks"].update(content_sha256="0" * 64))
    validate_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match="'layers.0.attn.sinks' has sha256") as info:
        validate_checkpoint(ckpt, verify_sha256=True)
    assert info.value.kind == "bad_sha256"


def test_verifying_sha256_of_a_checkpoint_without_hashes_fails(compiled, tmp_path):
    ckpt = copy_of(compiled, tmp_path)
    edit_manifest(ckpt, lambda m: [r.pop("content_sha256") for r in m["tensors"]])
    validate_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match="compile with --sha256") as info:
        validate_checkpoint(ckpt, verify_sha256=True)
    assert info.value.kind == "missing_sha256"


def test_missing_directory_manifest_and_bad_json(compiled, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist") as info:
        check_checkpoint_dir(tmp_path / "nope")
    assert info.value.kind == "not_a_directory" and info.value.reason == "checkpoint_invalid"
    ckpt = copy_of(compiled, tmp_path)
    (ckpt / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(CheckpointError, match="is not valid JSON") as info:
        check_checkpoint_dir(ckpt)
    assert info.value.kind == "bad_manifest"
    (ckpt / MANIFEST_NAME).unlink()
    with pytest.raises(CheckpointError, match=f"has no {MANIFEST_NAME}") as info:
        validate_checkpoint(ckpt)
    assert info.value.kind == "missing_manifest"


def test_required_mode_app_config_rejects_a_corrupt_checkpoint(compiled, tmp_path):
    from deployments.config import AppConfig

    AppConfig(persistent_decoder="required", persistent_decoder_checkpoint=str(compiled))
    ckpt = copy_of(compiled, tmp_path)
    edit_manifest(ckpt, lambda m: m["tensors"].pop(7))
    with pytest.raises(ValueError, match="missing tensor 'layers.0.mlp_norm.weight'"):
        AppConfig(persistent_decoder="required", persistent_decoder_checkpoint=str(ckpt))


# ---------------------------------------------------------------- CLI and imports


def run_module(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_cli_validate_exits_zero_ok_and_non_zero_with_one_line(compiled, tmp_path):
    ok = run_module("-m", "ops.tools.persistent_checkpoint", "validate", str(compiled), "--verify-sha256")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith(f"OK: {13 * LAYERS + 3} tensors") and "sha256 verified" in ok.stdout

    ckpt = copy_of(compiled, tmp_path)
    _shard_of(ckpt, "embed.weight").unlink()
    bad = run_module("-m", "ops.tools.persistent_checkpoint", "validate", str(ckpt))
    assert bad.returncode == 1 and bad.stdout == ""
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("INVALID [missing_shard]")
    assert "of tensor 'embed.weight' is missing" in lines[0]


def test_cli_compile_prints_a_summary(source, tmp_path, capsys):
    assert main(["compile", str(source[0]), str(tmp_path / "out"), "--sha256", "--no-progress",
                 "--model-revision", "r1"]) == 0
    out = capsys.readouterr().out
    assert "29 tensors" in out and "gpt-oss-tiny @ r1" in out and "sha256 recorded" in out
    assert main(["compile", str(source[0]), str(tmp_path / "out"), "--no-progress"]) == 1
    assert "not an empty directory" in capsys.readouterr().err


def test_checking_and_validating_import_no_torch(compiled):
    code = (
        "import sys\n"
        "from replicas.persistent.checkpoint import check_checkpoint_dir, validate_checkpoint\n"
        f"check_checkpoint_dir({str(compiled)!r})\n"
        f"validate_checkpoint({str(compiled)!r}, verify_sha256=True)\n"
        "from ops.tools.persistent_checkpoint import main\n"
        f"assert main(['validate', {str(compiled)!r}]) == 0\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'safetensors', 'numpy'))\n"
        "assert not heavy, heavy\n"
    )
    result = run_module("-c", code)
    assert result.returncode == 0, result.stderr

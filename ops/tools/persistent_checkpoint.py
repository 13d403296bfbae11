"""Compile a Hugging Face GPT-OSS checkpoint into a persistent-decoder checkpoint, and validate one.

Usage::

    python -m ops.tools.persistent_checkpoint compile SRC DST [--shard-size-mb 2048] [--sha256]
        [--model-family gpt-oss-120b|gpt-oss-20b|gpt-oss-tiny] [--model-revision REV]
    python -m ops.tools.persistent_checkpoint validate DIR [--verify-sha256]

``compile`` reads ``SRC/config.json`` (``model_type`` ``gpt_oss``) and its
safetensors files one tensor at a time (never the whole model), and writes to
``DST`` (absent or empty) the safetensors shards, then
``persistent_decoder_manifest.json`` last (so a directory without a manifest is
an interrupted compile), plus a copy of ``config.json`` for reference. Peak
memory is about two copies of the largest tensor, whatever ``--shard-size-mb``.

The format (``docs/persistent_checkpoint.md``, ``replicas.persistent.checkpoint``):

=====================================  ==================================================
persistent name                        from the HF GPT-OSS tensors
=====================================  ==================================================
``embed.weight``                       ``model.embed_tokens.weight`` [V, H]
``layers.{i}.attn_norm.weight``        ``model.layers.{i}.input_layernorm.weight`` [H]
``layers.{i}.attn.qkv.weight``         ``self_attn.{q,k,v}_proj.weight`` rows concatenated
                                       [(n_q + 2 n_kv) * head_dim, H]
``layers.{i}.attn.qkv.bias``           ``self_attn.{q,k,v}_proj.bias`` concatenated
``layers.{i}.attn.sinks``              ``self_attn.sinks`` [n_q]
``layers.{i}.attn.o.weight`` / bias    ``self_attn.o_proj.weight`` [H, n_q * head_dim] / [H]
``layers.{i}.mlp_norm.weight``         ``post_attention_layernorm.weight`` [H]
``layers.{i}.moe.router.weight``/bias  ``mlp.router.weight`` [E, H] / ``.bias`` [E]
``layers.{i}.moe.gate_up.weight``      mxfp4 [E, 2I, H/32, 17] from ``mlp.experts.gate_up_proj_{blocks,scales}``
``layers.{i}.moe.gate_up.bias``        ``mlp.experts.gate_up_proj_bias`` [E, 2I]
``layers.{i}.moe.down.weight``         mxfp4 [E, H, I/32, 17] from ``mlp.experts.down_proj_{blocks,scales}``
``layers.{i}.moe.down.bias``           ``mlp.experts.down_proj_bias`` [E, H]
``final_norm.weight``                  ``model.norm.weight`` [H]
``lm_head.weight``                     ``lm_head.weight`` [V, H] (the embedding when tied)
=====================================  ==================================================

Non-expert tensors keep the source dtype (bf16 for the released models).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from replicas.persistent.checkpoint import (
    CURRENT_FORMAT_VERSION,
    DTYPE_SIZES,
    FLOAT_DTYPES,
    MANIFEST_NAME,
    MODEL_FAMILIES,
    MXFP4,
    MXFP4_BLOCK_BYTES,
    MXFP4_BLOCK_VALUES,
    SAFETENSORS_DTYPES,
    CheckpointError,
    Manifest,
    TensorRecord,
    catalog,
    read_safetensors_header,
    validate_checkpoint,
)

__all__ = ["CheckpointError", "Manifest", "SourceError", "compile_checkpoint", "main", "pack_mxfp4",
           "unpack_mxfp4", "validate_checkpoint"]

_FROM_SAFETENSORS = {st: name for name, st in SAFETENSORS_DTYPES.items() if name != MXFP4}
_HF_LAYER = "model.layers.{i}."


class SourceError(ValueError):
    """The source directory is not a GPT-OSS checkpoint this tool can compile."""


# ---------------------------------------------------------------- MXFP4 packing


def pack_mxfp4(blocks, scales):
    """Pack HF MXFP4 ``blocks`` [..., G, 16] and ``scales`` [..., G] (uint8) into [..., G, 17] uint8.

    Byte ``j < 16`` of a group is ``blocks[..., j]`` verbatim (E2M1 codes of values
    ``2j`` in the low nibble and ``2j + 1`` in the high nibble); byte 16 is the
    block's E8M0 scale (value = e2m1 * 2 ** (scale - 127)).
    """
    import torch

    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != MXFP4_BLOCK_BYTES or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not "
                         f"pair as [..., G, {MXFP4_BLOCK_BYTES}] and [..., G]")
    return torch.cat([blocks, scales.unsqueeze(-1)], dim=-1).contiguous()


def unpack_mxfp4(packed):
    """Inverse of :func:`pack_mxfp4`: [..., G, 17] uint8 -> (blocks [..., G, 16], scales [..., G])."""
    return packed[..., :MXFP4_BLOCK_BYTES].contiguous(), packed[..., MXFP4_BLOCK_BYTES].contiguous()


# ---------------------------------------------------------------- source


class _Source:
    """An HF GPT-OSS directory: config plus a name -> (file, header entry) map; loads one tensor at a time."""

    def __init__(self, src: Path):
        if (src / MANIFEST_NAME).exists():
            raise SourceError(f"{src} is already a persistent checkpoint (it has {MANIFEST_NAME})")
        cfg_path = src / "config.json"
        if not cfg_path.is_file():
            raise SourceError(f"{src} has no config.json")
        self.config = json.loads(cfg_path.read_text())
        if self.config.get("model_type") != "gpt_oss":
            raise SourceError(f"{cfg_path}: model_type is {self.config.get('model_type')!r}, not 'gpt_oss'")
        index = src / "model.safetensors.index.json"
        if index.is_file():
            files = sorted({src / f for f in json.loads(index.read_text())["weight_map"].values()})
        else:
            files = sorted(src.glob("*.safetensors"))
        if not files:
            raise SourceError(f"{src} has no safetensors files")
        self.entries = {}
        for file in files:
            try:
                header = read_safetensors_header(file)
            except (OSError, ValueError) as exc:
                raise SourceError(f"{file}: not a readable safetensors file ({exc})") from None
            for name, entry in header.items():
                if name in self.entries:
                    raise SourceError(f"{src}: tensor {name} is in both {self.entries[name][0].name} "
                                      f"and {file.name}")
                self.entries[name] = (file, entry)
        self._handles: dict[Path, object] = {}

    def has(self, name: str) -> bool:
        return name in self.entries

    def expect(self, name: str, shape: tuple, dtypes=FLOAT_DTYPES) -> tuple[str, tuple[int, ...]]:
        """Check ``name``'s stored dtype and shape (``None`` dims match anything); return (dtype, shape)."""
        if name not in self.entries:
            raise SourceError(f"source tensor {name} is missing")
        entry = self.entries[name][1]
        dtype = "uint8" if entry.dtype == "U8" else _FROM_SAFETENSORS.get(entry.dtype, entry.dtype)
        if dtype not in dtypes:
            raise SourceError(f"source tensor {name} has dtype {entry.dtype}; expected {' or '.join(dtypes)}")
        if len(entry.shape) != len(shape) or any(
                w is not None and w != g for g, w in zip(entry.shape, shape, strict=True)):
            want = ["*" if w is None else w for w in shape]
            raise SourceError(f"source tensor {name} has shape {list(entry.shape)}; expected {want}")
        return dtype, entry.shape

    def close(self) -> None:
        self._handles.clear()

    def load(self, name: str):
        from safetensors import safe_open

        file = self.entries[name][0]
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt")
        return self._handles[file].get_tensor(name)


@dataclass
class _Planned:
    name: str
    dtype: str
    shape: tuple[int, ...]
    build: Callable[[], object]

    @property
    def byte_size(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


def _plan(source: _Source, num_layers: int) -> list[_Planned]:
    """Check the source tensors' dtypes and shapes and say how to build each catalog tensor."""
    import torch

    cfg = source.config
    out: list[_Planned] = []

    def copy(name: str, hf: str, shape: tuple) -> None:
        dtype, got = source.expect(hf, shape)
        out.append(_Planned(name, dtype, got, lambda: source.load(hf)))

    def concat(name: str, hfs: list[str], shapes: list[tuple]) -> None:
        infos = [source.expect(hf, s) for hf, s in zip(hfs, shapes, strict=True)]
        if len({d for d, _ in infos}) != 1:
            raise SourceError(f"{', '.join(hfs)} have different dtypes {[d for d, _ in infos]}")
        shape = (sum(s[0] for _, s in infos), *infos[0][1][1:])
        out.append(_Planned(name, infos[0][0], shape, lambda: torch.cat([source.load(h) for h in hfs])))

    def mxfp4(name: str, hf: str, rows: int | None, cols: int | None) -> tuple[int, int]:
        groups = None if cols is None else cols // MXFP4_BLOCK_VALUES
        _, bshape = source.expect(f"{hf}_blocks", (None, rows, groups, MXFP4_BLOCK_BYTES), ("uint8",))
        source.expect(f"{hf}_scales", bshape[:-1], ("uint8",))
        shape = (*bshape[:-1], MXFP4_BLOCK_BYTES + 1)
        out.append(_Planned(name, MXFP4, shape,
                            lambda: pack_mxfp4(source.load(f"{hf}_blocks"), source.load(f"{hf}_scales"))))
        return bshape[0], bshape[1]

    _, (vocab, hidden) = source.expect("model.embed_tokens.weight", (None, None))
    copy("embed.weight", "model.embed_tokens.weight", (vocab, hidden))
    n_q, n_kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    head_dim = cfg.get("head_dim") or (hidden // n_q if n_q else None)
    q_rows = n_q * head_dim if n_q and head_dim else None
    kv_rows = n_kv * head_dim if n_kv and head_dim else None
    for i in range(num_layers):
        hf, p = _HF_LAYER.format(i=i), f"layers.{i}."
        if q_rows is None:  # no head geometry in config: take it from the tensors
            q_rows = source.expect(f"{hf}self_attn.q_proj.weight", (None, hidden))[1][0]
            kv_rows = source.expect(f"{hf}self_attn.k_proj.weight", (None, hidden))[1][0]
        copy(p + "attn_norm.weight", hf + "input_layernorm.weight", (hidden,))
        proj = [f"{hf}self_attn.{x}_proj" for x in "qkv"]
        concat(p + "attn.qkv.weight", [x + ".weight" for x in proj],
               [(q_rows, hidden), (kv_rows, hidden), (kv_rows, hidden)])
        concat(p + "attn.qkv.bias", [x + ".bias" for x in proj], [(q_rows,), (kv_rows,), (kv_rows,)])
        copy(p + "attn.sinks", hf + "self_attn.sinks", (n_q,))
        copy(p + "attn.o.weight", hf + "self_attn.o_proj.weight", (hidden, q_rows))
        copy(p + "attn.o.bias", hf + "self_attn.o_proj.bias", (hidden,))
        copy(p + "mlp_norm.weight", hf + "post_attention_layernorm.weight", (hidden,))
        _, (experts, _) = source.expect(hf + "mlp.router.weight", (None, hidden))
        copy(p + "moe.router.weight", hf + "mlp.router.weight", (experts, hidden))
        copy(p + "moe.router.bias", hf + "mlp.router.bias", (experts,))
        _, two_i = mxfp4(p + "moe.gate_up.weight", hf + "mlp.experts.gate_up_proj", None, hidden)
        copy(p + "moe.gate_up.bias", hf + "mlp.experts.gate_up_proj_bias", (experts, two_i))
        mxfp4(p + "moe.down.weight", hf + "mlp.experts.down_proj", hidden, two_i // 2)
        copy(p + "moe.down.bias", hf + "mlp.experts.down_proj_bias", (experts, hidden))
        if out[-4].shape[0] != experts or out[-2].shape[0] != experts:
            raise SourceError(f"layer {i}: experts tensors disagree with the router's {experts} experts")
    copy("final_norm.weight", "model.norm.weight", (hidden,))
    if source.has("lm_head.weight") or not cfg.get("tie_word_embeddings"):
        copy("lm_head.weight", "lm_head.weight", (vocab, hidden))
    else:
        copy("lm_head.weight", "model.embed_tokens.weight", (vocab, hidden))
    assert [t.name for t in out] == [s.name for s in catalog(num_layers)]
    return out


# ---------------------------------------------------------------- writing


def _tensor_bytes(tensor, planned: _Planned):
    """The tensor's C-order bytes as a numpy uint8 view, after checking it is what the plan said."""
    import torch

    want = torch.uint8 if planned.dtype == MXFP4 else getattr(torch, planned.dtype)
    if tensor.dtype != want or tuple(tensor.shape) != planned.shape:
        raise SourceError(f"{planned.name}: built {tensor.dtype} {list(tensor.shape)}, planned "
                          f"{planned.dtype} {list(planned.shape)} (source header and data disagree)")
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy()


def _shard_groups(planned: list[_Planned], shard_bytes: int) -> list[list[_Planned]]:
    """Split in catalog order; a shard closes before the tensor that would overflow it."""
    groups: list[list[_Planned]] = [[]]
    size = 0
    for t in planned:
        if groups[-1] and size + t.byte_size > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.byte_size
    return groups


def _write_shard(path: Path, tensors: list[_Planned], sha256: bool, bar) -> list[str | None]:
    """Write one safetensors file, streaming tensor by tensor; return each tensor's sha256 (or None)."""
    import hashlib

    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.byte_size]}
        offset += t.byte_size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned, as safetensors writes it
    hashes = []
    tmp = path.with_name(path.name + ".partial")
    with tmp.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t in tensors:
            bar.set_postfix_str(t.name, refresh=False)
            data = _tensor_bytes(t.build(), t)
            hashes.append(hashlib.sha256(data).hexdigest() if sha256 else None)
            f.write(data)
            bar.update(t.byte_size)
            del data
    tmp.replace(path)
    return hashes


def _manifest_text(manifest: Manifest) -> str:
    """The manifest JSON with one tensor record per line (471 lines for GPT-OSS-120B, easy to diff)."""
    data = manifest.to_json()
    tensors = data.pop("tensors")
    head = "".join(f" {json.dumps(k)}: {json.dumps(v)},\n" for k, v in data.items())
    body = ",\n".join(f"  {json.dumps(r)}" for r in tensors)
    return f'{{\n{head} "tensors": [\n{body}\n ]\n}}\n'


def _infer_family(num_layers: int, num_experts: int) -> str:
    if (num_layers, num_experts) == (36, 128):
        return "gpt-oss-120b"
    if (num_layers, num_experts) == (24, 32):
        return "gpt-oss-20b"
    return "gpt-oss-tiny"


def _infer_revision(src: Path) -> str:
    """The HF commit hash when ``src`` is a hub cache snapshot (``.../snapshots/<hash>``), else ``local``."""
    resolved = src.resolve()
    return resolved.name if resolved.parent.name == "snapshots" else "local"


def compile_checkpoint(src: str | Path, dst: str | Path, *, shard_size_mb: float = 2048,
                       sha256: bool = False, model_family: str | None = None,
                       model_revision: str | None = None, progress: bool = True) -> Path:
    """Compile the HF GPT-OSS checkpoint at ``src`` into a persistent checkpoint at ``dst``.

    Args:
        src: directory with ``config.json`` and safetensors (MXFP4 experts).
        dst: output directory; must not exist or be empty.
        shard_size_mb: target shard size in MiB (a larger tensor gets a shard of its own).
        sha256: record ``content_sha256`` for every tensor.
        model_family: ``gpt-oss-120b``/``gpt-oss-20b``/``gpt-oss-tiny``; inferred from layers and experts.
        model_revision: recorded revision; default the hub snapshot hash, else ``local``.
        progress: show a tqdm bar (bytes written) on stderr.

    Returns:
        ``dst`` as a Path, after :func:`validate_checkpoint` passed on it (headers, no hashing).

    Raises:
        SourceError: ``src`` is not a compilable GPT-OSS checkpoint.
        FileExistsError: ``dst`` exists and is not empty.
        CheckpointError: the written checkpoint failed validation (a bug).
    """
    from tqdm import tqdm

    src, dst = Path(src), Path(dst)
    if shard_size_mb <= 0:
        raise ValueError(f"shard_size_mb must be positive, got {shard_size_mb}")
    source = _Source(src)
    num_layers = source.config.get("num_hidden_layers")
    if not isinstance(num_layers, int) or num_layers < 1:
        raise SourceError(f"{src}/config.json: num_hidden_layers {num_layers!r} is not a positive integer")
    planned = _plan(source, num_layers)
    experts = next(t.shape[0] for t in planned if t.name == "layers.0.moe.router.weight")
    family = model_family or _infer_family(num_layers, experts)
    if family not in MODEL_FAMILIES:
        raise ValueError(f"model_family {family!r} is not one of {', '.join(MODEL_FAMILIES)}")
    if MODEL_FAMILIES[family] not in (None, num_layers):
        raise SourceError(f"{src} has {num_layers} layers; {family} has {MODEL_FAMILIES[family]}")
    revision = model_revision or _infer_revision(src)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"{dst} exists and is not an empty directory")
    dst.mkdir(parents=True, exist_ok=True)

    groups = _shard_groups(planned, max(1, int(shard_size_mb * (1 << 20))))
    records: list[TensorRecord] = []
    total = sum(t.byte_size for t in planned)
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="compile",
              disable=not progress, file=sys.stderr) as bar:
        for k, group in enumerate(groups, 1):
            shard = f"persistent-{k:05d}-of-{len(groups):05d}.safetensors"
            hashes = _write_shard(dst / shard, group, sha256, bar)
            records += [TensorRecord(t.name, shard, t.dtype, t.shape, t.byte_size, h)
                        for t, h in zip(group, hashes, strict=True)]
    source.close()
    manifest = Manifest(dst, CURRENT_FORMAT_VERSION, family, revision, num_layers, tuple(records))
    shutil.copyfile(src / "config.json", dst / "config.json")
    tmp = dst / (MANIFEST_NAME + ".partial")
    tmp.write_text(_manifest_text(manifest))
    tmp.replace(dst / MANIFEST_NAME)  # last: a directory without a manifest is an interrupted compile
    validate_checkpoint(dst)
    return dst


# ---------------------------------------------------------------- CLI


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _describe(m: Manifest) -> str:
    return (f"{len(m.tensors)} tensors, {len(m.shards)} shard(s), {_human(m.total_bytes)}, "
            f"{m.model_family} @ {m.model_revision}, {m.num_layers} layers, format_version {m.format_version}")


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 1 invalid checkpoint or source)."""
    parser = argparse.ArgumentParser(prog="python -m ops.tools.persistent_checkpoint", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compile", help="HF GPT-OSS directory -> persistent checkpoint")
    c.add_argument("src", type=Path)
    c.add_argument("dst", type=Path)
    c.add_argument("--shard-size-mb", type=float, default=2048, help="target shard size in MiB (default 2048)")
    c.add_argument("--sha256", action="store_true", help="record content_sha256 for every tensor")
    c.add_argument("--model-family", choices=list(MODEL_FAMILIES), help="default: inferred from the config")
    c.add_argument("--model-revision", help="default: the hub snapshot hash of SRC, else 'local'")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    v = sub.add_parser("validate", help="check a persistent checkpoint against its manifest and shards")
    v.add_argument("dir", type=Path)
    v.add_argument("--verify-sha256", action="store_true", help="hash every tensor and compare")
    args = parser.parse_args(argv)

    try:
        if args.command == "compile":
            start = time.perf_counter()
            dst = compile_checkpoint(args.src, args.dst, shard_size_mb=args.shard_size_mb, sha256=args.sha256,
                                     model_family=args.model_family, model_revision=args.model_revision,
                                     progress=not args.no_progress)
            m = validate_checkpoint(dst)
            sha = "recorded" if m.has_sha256 else "not recorded"
            print(f"compiled {args.src} -> {dst}: {_describe(m)}, sha256 {sha}, "
                  f"{time.perf_counter() - start:.1f} s")
        else:
            m = validate_checkpoint(args.dir, verify_sha256=args.verify_sha256)
            print(f"OK: {_describe(m)}{', sha256 verified' if args.verify_sha256 else ''}")
    except CheckpointError as exc:
        print(f"INVALID [{exc.kind}] {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    except (SourceError, FileExistsError, ValueError) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The persistent-decoder checkpoint: its catalog, manifest, and checks (no torch here).

A persistent checkpoint (docs/design.md "Persistent checkpoint"; full spec in
``docs/persistent_checkpoint.md``) is a local directory of safetensors shards
plus ``persistent_decoder_manifest.json``::

    {"format_version": 3,
     "model_family": "gpt-oss-120b" | "gpt-oss-20b" | "gpt-oss-tiny",
     "model_revision": "b5c939de",
     "num_layers": 36,
     "tensors": [{"name": "embed.weight", "shard": "persistent-00001-of-00038.safetensors",
                  "dtype": "bfloat16", "shape": [201088, 2880], "byte_size": 1158266880,
                  "content_sha256": "..."}, ...]}

``tensors`` lists exactly :func:`catalog` ``(num_layers)`` in that order:
``13 * num_layers + 3`` records (471 for GPT-OSS-120B). Expert weights have
dtype ``"mxfp4"``: one uint8 tensor ``[E, rows, cols / 32, 17]`` per weight,
each 17-byte group being the 16 bytes of a 32-value E2M1 block followed by its
E8M0 scale byte. Every other tensor is ``bfloat16``, ``float16`` or ``float32``.

Format versions: 3 adds ``content_sha256`` (lowercase hex SHA-256 of the
tensor's bytes as stored in the shard), on every record or on none; a version-2
record must not carry it. Otherwise 2 and 3 are identical.

Two levels of checking:

* :func:`check_checkpoint_dir` -- cheap, manifest only (version, fields, catalog
  count and order, dtype/shape/byte-size arithmetic, shard files present). The
  app config runs it at build time, so this module must not import torch.
* :func:`validate_checkpoint` -- also opens every shard's safetensors header
  (parsed here, no torch) and checks each tensor's stored dtype, shape and byte
  range against its record; optionally streams and hashes the bytes.

Both raise :class:`CheckpointError`, whose ``kind`` names the corruption.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

MANIFEST_NAME = "persistent_decoder_manifest.json"
FORMAT_VERSIONS = (2, 3)
CURRENT_FORMAT_VERSION = 3

# Families and the layer count each requires (None: any, for test-sized models).
MODEL_FAMILIES: dict[str, int | None] = {"gpt-oss-120b": 36, "gpt-oss-20b": 24, "gpt-oss-tiny": None}

FLOAT_DTYPES = ("bfloat16", "float16", "float32")
MXFP4 = "mxfp4"
# Bytes per element of the record's ``shape`` (mxfp4: the packed uint8 layout).
DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4, MXFP4: 1}
# How each manifest dtype is stored in a safetensors shard.
SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", MXFP4: "U8"}

MXFP4_BLOCK_VALUES = 32  # values per block, sharing one E8M0 scale
MXFP4_BLOCK_BYTES = 16  # two E2M1 values per byte
MXFP4_PACKED_BYTES = MXFP4_BLOCK_BYTES + 1  # the block's bytes, then its scale byte

LAYER_SLOTS_PER_LAYER = 13
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_RECORD_KEYS = ("name", "shard", "dtype", "shape", "byte_size", "content_sha256")
_HASH_CHUNK = 16 << 20


class CheckpointError(RuntimeError):
    """The persistent checkpoint is missing or invalid.

    ``replicas.persistent.contract.CheckpointError`` is this class, re-exported
    there as part of the decoder's error family.

    Attributes:
        kind: which corruption, a stable snake_case string: ``not_a_directory``,
            ``missing_manifest``, ``bad_manifest``, ``unknown_format_version``,
            ``duplicate_tensor``, ``missing_tensor``, ``extra_tensor``, ``wrong_order``,
            ``wrong_dtype``, ``wrong_shape``, ``wrong_byte_size``, ``missing_shard``,
            ``bad_shard``, ``tensor_not_in_shard``, ``shard_mismatch``,
            ``unlisted_tensor``, ``missing_sha256``, ``bad_sha256`` (``invalid`` when unset).
        tensor: the persistent name of the tensor concerned, when there is one.
    """

    reason = "checkpoint_invalid"

    def __init__(self, message: str, kind: str = "invalid", tensor: str | None = None):
        super().__init__(message)
        self.kind = kind
        self.tensor = tensor


# ---------------------------------------------------------------- catalog


@dataclass(frozen=True)
class Slot:
    """One catalog entry: the persistent tensor ``name``, its rank, and whether it is MXFP4-packed."""

    name: str
    rank: int
    mxfp4: bool = False


# Per layer, in order: (suffix, rank, mxfp4).
_LAYER_SLOTS = (
    ("attn_norm.weight", 1, False),  # [H]
    ("attn.qkv.weight", 2, False),  # [(n_q + 2 n_kv) * head_dim, H] = rows of q, then k, then v
    ("attn.qkv.bias", 1, False),  # [(n_q + 2 n_kv) * head_dim]
    ("attn.sinks", 1, False),  # [n_q]
    ("attn.o.weight", 2, False),  # [H, n_q * head_dim]
    ("attn.o.bias", 1, False),  # [H]
    ("mlp_norm.weight", 1, False),  # [H]
    ("moe.router.weight", 2, False),  # [E, H]
    ("moe.router.bias", 1, False),  # [E]
    ("moe.gate_up.weight", 4, True),  # mxfp4 [E, 2I, H/32, 17], rows gate/up interleaved
    ("moe.gate_up.bias", 2, False),  # [E, 2I]
    ("moe.down.weight", 4, True),  # mxfp4 [E, H, I/32, 17]
    ("moe.down.bias", 2, False),  # [E, H]
)
assert len(_LAYER_SLOTS) == LAYER_SLOTS_PER_LAYER


def catalog(num_layers: int) -> tuple[Slot, ...]:
    """The ``13 * num_layers + 3`` tensors of a persistent checkpoint, in manifest order.

    ``embed.weight``; for each layer ``i`` the 13 ``layers.{i}.*`` slots (input
    norm, fused qkv weight and bias, sinks, o_proj weight and bias,
    post-attention norm, router weight and bias, experts gate_up weight and bias,
    experts down weight and bias); ``final_norm.weight``; ``lm_head.weight``.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    slots = [Slot("embed.weight", 2)]
    for i in range(num_layers):
        slots += [Slot(f"layers.{i}.{suffix}", rank, mx) for suffix, rank, mx in _LAYER_SLOTS]
    slots += [Slot("final_norm.weight", 1), Slot("lm_head.weight", 2)]
    return tuple(slots)


# ---------------------------------------------------------------- manifest


@dataclass(frozen=True)
class TensorRecord:
    """One manifest record; ``shape`` is the stored shape (mxfp4: the packed uint8 shape)."""

    name: str
    shard: str
    dtype: str
    shape: tuple[int, ...]
    byte_size: int
    content_sha256: str | None = None

    @property
    def expected_byte_size(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]

    def to_json(self) -> dict:
        out = {"name": self.name, "shard": self.shard, "dtype": self.dtype,
               "shape": list(self.shape), "byte_size": self.byte_size}
        if self.content_sha256 is not None:
            out["content_sha256"] = self.content_sha256
        return out


@dataclass(frozen=True)
class Manifest:
    """A parsed, manifest-level-valid ``persistent_decoder_manifest.json`` of the checkpoint at ``path``."""

    path: Path
    format_version: int
    model_family: str
    model_revision: str
    num_layers: int
    tensors: tuple[TensorRecord, ...]

    @property
    def shards(self) -> tuple[str, ...]:
        """Shard file names, in order of first use."""
        return tuple(dict.fromkeys(r.shard for r in self.tensors))

    @property
    def total_bytes(self) -> int:
        return sum(r.byte_size for r in self.tensors)

    @property
    def has_sha256(self) -> bool:
        return bool(self.tensors) and self.tensors[0].content_sha256 is not None

    def to_json(self) -> dict:
        return {"format_version": self.format_version, "model_family": self.model_family,
                "model_revision": self.model_revision, "num_layers": self.num_layers,
                "tensors": [r.to_json() for r in self.tensors]}


def _fail(kind: str, message: str, tensor: str | None = None) -> NoReturn:
    raise CheckpointError(message, kind=kind, tensor=tensor)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_record(where: str, index: int, raw, version: int) -> TensorRecord:
    """Field-level checks of one record (types, names); semantics come later."""
    if not isinstance(raw, dict):
        _fail("bad_manifest", f"{where}: tensors[{index}] is not an object")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        _fail("bad_manifest", f"{where}: tensors[{index}] has no string 'name'")
    unknown = sorted(set(raw) - set(_RECORD_KEYS))
    if unknown:
        _fail("bad_manifest", f"{where}: tensor {name!r} has unknown field(s) {unknown}", name)
    for key in ("shard", "dtype", "shape", "byte_size"):
        if key not in raw:
            _fail("bad_manifest", f"{where}: tensor {name!r} has no {key!r}", name)
    shard = raw["shard"]
    if (not isinstance(shard, str) or Path(shard).name != shard or shard.startswith(".")
            or not shard.endswith(".safetensors")):
        _fail("bad_manifest", f"{where}: tensor {name!r} has shard {shard!r}; expected a file name "
              "ending in .safetensors inside the checkpoint directory", name)
    if not isinstance(raw["dtype"], str):
        _fail("bad_manifest", f"{where}: tensor {name!r} has a non-string dtype {raw['dtype']!r}", name)
    shape = raw["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        _fail("bad_manifest", f"{where}: tensor {name!r} has shape {shape!r}; expected a list of "
              "non-negative integers", name)
    if not _is_int(raw["byte_size"]) or raw["byte_size"] < 0:
        _fail("bad_manifest", f"{where}: tensor {name!r} has byte_size {raw['byte_size']!r}; expected "
              "a non-negative integer", name)
    sha = raw.get("content_sha256")
    if sha is not None:
        if version < 3:
            _fail("bad_manifest", f"{where}: tensor {name!r} has content_sha256, which format_version "
                  f"{version} does not support (needs 3)", name)
        if not isinstance(sha, str) or not _SHA256_RE.fullmatch(sha):
            _fail("bad_manifest", f"{where}: tensor {name!r} has content_sha256 {sha!r}; expected 64 "
                  "lowercase hex digits", name)
    return TensorRecord(name, shard, raw["dtype"], tuple(shape), raw["byte_size"], sha)


def _check_catalog(where: str, records: tuple[TensorRecord, ...], num_layers: int) -> None:
    """Names: no duplicates, none missing, none extra, catalog order; then per-slot dtype/shape/bytes."""
    slots = catalog(num_layers)
    expected = [s.name for s in slots]
    names = [r.name for r in records]
    first_at: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in first_at:
            _fail("duplicate_tensor", f"{where}: tensor {name!r} is listed twice (positions "
                  f"{first_at[name]} and {i})", name)
        first_at[name] = i
    for i, name in enumerate(expected):
        if name not in first_at:
            _fail("missing_tensor", f"{where}: missing tensor {name!r} (catalog position {i} of "
                  f"{len(expected)} for num_layers={num_layers})", name)
    known = set(expected)
    for i, name in enumerate(names):
        if name not in known:
            _fail("extra_tensor", f"{where}: extra tensor {name!r} at position {i} is not in the "
                  f"catalog for num_layers={num_layers}", name)
    for i, (got, want) in enumerate(zip(names, expected, strict=True)):
        if got != want:
            _fail("wrong_order", f"{where}: tensors out of order: position {i} holds {got!r}, the "
                  f"catalog expects {want!r}", got)
    for slot, rec in zip(slots, records, strict=True):
        allowed = (MXFP4,) if slot.mxfp4 else FLOAT_DTYPES
        if rec.dtype not in allowed:
            _fail("wrong_dtype", f"{where}: tensor {rec.name!r} has dtype {rec.dtype!r}; expected "
                  f"{' or '.join(allowed)}", rec.name)
        if len(rec.shape) != slot.rank or (slot.mxfp4 and rec.shape[-1] != MXFP4_PACKED_BYTES):
            want = f"[E, rows, cols/32, {MXFP4_PACKED_BYTES}]" if slot.mxfp4 else f"rank {slot.rank}"
            _fail("wrong_shape", f"{where}: tensor {rec.name!r} has shape {list(rec.shape)}; "
                  f"expected {want}", rec.name)
        if rec.byte_size != rec.expected_byte_size:
            _fail("wrong_byte_size", f"{where}: tensor {rec.name!r} has byte_size {rec.byte_size}, but "
                  f"{rec.dtype} {list(rec.shape)} is {rec.expected_byte_size} bytes", rec.name)


def _read_manifest(path: str | Path) -> tuple[Manifest, dict]:
    """Manifest-level checks (see :func:`check_checkpoint_dir`); returns the manifest and its raw JSON."""
    path = Path(path)
    if not path.is_dir():
        _fail("not_a_directory", f"persistent-decoder checkpoint {path} does not exist or is not a directory")
    mpath = path / MANIFEST_NAME
    if not mpath.is_file():
        _fail("missing_manifest", f"persistent-decoder checkpoint {path} has no {MANIFEST_NAME}")
    try:
        data = json.loads(mpath.read_text())
    except (OSError, ValueError) as exc:
        _fail("bad_manifest", f"{mpath} is not valid JSON: {exc}")
    where = str(mpath)
    if not isinstance(data, dict):
        _fail("bad_manifest", f"{where}: the manifest is not a JSON object")
    version = data.get("format_version")
    if not _is_int(version) or version not in FORMAT_VERSIONS:
        _fail("unknown_format_version", f"{where}: unknown format_version {version!r}; this build reads "
              f"{', '.join(map(str, FORMAT_VERSIONS))}")
    family = data.get("model_family")
    if family not in MODEL_FAMILIES:
        _fail("bad_manifest", f"{where}: model_family {family!r} is not one of {', '.join(MODEL_FAMILIES)}")
    revision = data.get("model_revision")
    if not isinstance(revision, str) or not revision:
        _fail("bad_manifest", f"{where}: model_revision {revision!r} is not a non-empty string")
    num_layers = data.get("num_layers")
    if not _is_int(num_layers) or num_layers < 1:
        _fail("bad_manifest", f"{where}: num_layers {num_layers!r} is not a positive integer")
    if MODEL_FAMILIES[family] not in (None, num_layers):
        _fail("bad_manifest", f"{where}: model_family {family} has {MODEL_FAMILIES[family]} layers, "
              f"the manifest says num_layers={num_layers}")
    raw_tensors = data.get("tensors")
    if not isinstance(raw_tensors, list):
        _fail("bad_manifest", f"{where}: 'tensors' is not a list")
    records = tuple(_parse_record(where, i, raw, version) for i, raw in enumerate(raw_tensors))
    hashed = [r.content_sha256 is not None for r in records]
    if any(hashed) and not all(hashed):
        rec = records[hashed.index(False)]
        _fail("bad_manifest", f"{where}: tensor {rec.name!r} has no content_sha256 while others do "
              "(all records carry one or none)", rec.name)
    _check_catalog(where, records, num_layers)
    for rec in records:
        if not (path / rec.shard).is_file():
            _fail("missing_shard", f"{path}: shard {rec.shard} of tensor {rec.name!r} is missing", rec.name)
    return Manifest(path, version, family, revision, num_layers, records), data


def read_manifest(path: str | Path) -> Manifest:
    """Parse the manifest of the checkpoint at ``path`` with the checks of :func:`check_checkpoint_dir`."""
    return _read_manifest(path)[0]


def check_checkpoint_dir(path: str | Path) -> dict:
    """Cheap build-time check of the checkpoint directory ``path`` (manifest only, no shard reads).

    Checks: the manifest is readable JSON of a known ``format_version`` with the
    required fields; ``tensors`` is exactly the catalog for ``num_layers``, in
    order; each record's dtype suits its slot and ``byte_size == prod(shape) *
    element size``; every shard file named exists.

    Returns:
        The parsed manifest JSON.

    Raises:
        CheckpointError: with a message naming the path, the tensor, and what is wrong.
    """
    return _read_manifest(path)[1]


# ---------------------------------------------------------------- shards


@dataclass(frozen=True)
class ShardEntry:
    """One tensor in a safetensors header; ``begin``/``end`` are absolute file offsets."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def read_safetensors_header(path: str | Path) -> dict[str, ShardEntry]:
    """Parse a safetensors file's header (``u64 LE length``, JSON, then the data) without reading data.

    Raises:
        ValueError: not a well-formed safetensors file (including data ranges past its end).
    """
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(f"header length {n} runs past the end of the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise ValueError(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    data_start = 8 + n
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = info["data_offsets"]
            entry = ShardEntry(info["dtype"], tuple(info["shape"]), data_start + begin, data_start + end)
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"header entry {name!r} is malformed") from None
        if not 0 <= begin <= end or entry.end > size:
            raise ValueError(f"tensor {name!r} data [{begin}, {end}) runs past the end of the file")
        entries[name] = entry
    return entries


def _file_sha256(path: Path, begin: int, end: int) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        f.seek(begin)
        left = end - begin
        while left:
            chunk = f.read(min(left, _HASH_CHUNK))
            if not chunk:
                break
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def validate_checkpoint(path: str | Path, verify_sha256: bool = False) -> Manifest:
    """Deep validation: :func:`check_checkpoint_dir`, then every shard against the manifest.

    For each record in manifest order: its shard is a readable safetensors file;
    the tensor is in it, stored with the dtype (``mxfp4`` as ``U8``), shape and
    byte count the record states; with ``verify_sha256``, the stored bytes hash
    to ``content_sha256`` (which every record must then carry). Finally, no
    shard holds a tensor the manifest does not list. Only safetensors headers
    are parsed unless hashing, so this is quick even for GPT-OSS-120B.

    Raises:
        CheckpointError: the first problem found, ``kind`` naming it.
    """
    manifest = _read_manifest(path)[0]
    root = manifest.path
    if verify_sha256 and not manifest.has_sha256:
        first = manifest.tensors[0].name
        _fail("missing_sha256", f"{root}: cannot verify sha256: tensor {first!r} has no content_sha256 "
              f"(format_version {manifest.format_version}; compile with --sha256)", first)
    headers: dict[str, dict[str, ShardEntry]] = {}
    for rec in manifest.tensors:
        shard = root / rec.shard
        if rec.shard not in headers:
            try:
                headers[rec.shard] = read_safetensors_header(shard)
            except (OSError, ValueError) as exc:
                _fail("bad_shard", f"{shard}: not a readable safetensors file ({exc}); it holds tensor "
                      f"{rec.name!r}", rec.name)
        entry = headers[rec.shard].get(rec.name)
        if entry is None:
            _fail("tensor_not_in_shard", f"{shard}: tensor {rec.name!r} listed in the manifest is not in "
                  "this shard", rec.name)
        want_dtype = SAFETENSORS_DTYPES[rec.dtype]
        stored = entry.end - entry.begin
        if entry.dtype != want_dtype or entry.shape != rec.shape or stored != rec.byte_size:
            _fail("shard_mismatch", f"{shard}: tensor {rec.name!r} is stored as {entry.dtype} "
                  f"{list(entry.shape)} ({stored} bytes); the manifest says {rec.dtype} "
                  f"{list(rec.shape)} ({rec.byte_size} bytes, stored as {want_dtype})", rec.name)
        if verify_sha256:
            actual = _file_sha256(shard, entry.begin, entry.end)
            if actual != rec.content_sha256:
                _fail("bad_sha256", f"{shard}: tensor {rec.name!r} has sha256 {actual[:16]}..., the "
                      f"manifest says {rec.content_sha256[:16]}...", rec.name)
    listed = {r.name: r.shard for r in manifest.tensors}
    for shard_name, entries in headers.items():
        for name in entries:
            if listed.get(name) != shard_name:
                _fail("unlisted_tensor", f"{root / shard_name}: holds tensor {name!r}, which the "
                      "manifest does not list in this shard", name)
    return manifest

"""A test double of the ``aiter.MK1`` module boundary.

It is NOT AMD's code and proves nothing about the real kernel: it implements,
in plain Python/torch, the import surface docs/design.md records for ``aiter.MK1``
(squashed commit 4b492bb) so that ``replicas/persistent/mk1.py`` can be tested
on a machine with no AMD GPU. What it does:

* records every call and its arguments (:attr:`MK1Double.calls`);
* validates what the real module is documented to require: ``MK1Config``
  fields and their allowed values, ``is_supported`` passing only gfx950 and
  batch 1, contiguous 1-D ``uint8`` planes of ``block_count * block_stride``
  bytes, a contiguous 1-D int32 block map covering the quantum with page ids in
  range, ``[len, 64]`` bf16 RoPE tables;
* decodes *scripted* tokens (:attr:`MK1Double.script`, consumed in order) and,
  for each step at position ``p``, writes a marker byte (:func:`marker`) over
  that token's row in every layer's K and V plane at byte offset
  ``block_map[p // 16] * block_stride + (p % 16) * row_bytes``, so a test can
  check that it wrote through the engine's own cache where the block map says;
* fails on demand (:meth:`MK1Double.fail_next`): ``PrelaunchError`` before
  anything is written, ``BackendLaunchError`` after the first step's write, or
  an invalid result; and construction faults (:attr:`MK1Double.construction_fault`).

Use: ``double = MK1Double(script=[...])`` is one fresh "module"; inject it at
the adapter's import seam with
``monkeypatch.setattr(replicas.persistent.mk1, "_import_mk1", lambda: double)``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

PAGE_SIZE = 16
ROPE_COLUMNS = 64
SUPPORTED_ARCHITECTURES = ("gfx950",)
CACHE_SCALARS = ("bfloat16", "float16")
MODES = ("auto", "required")
BACKEND = "gpt_oss_gfx950_atom_v1"
MODEL_FAMILY = "gpt-oss-120b"
MODEL_REVISION = "b5c939de"


# --- errors (distinct classes from ours, as the real module's are) -----------------------------


class MK1Error(RuntimeError):
    """Base of the double's errors."""


class PrelaunchError(MK1Error):
    """Rejected before launch: nothing changed."""


class BackendLaunchError(MK1Error):
    """Failed during/after launch: state may have changed."""


class UnsupportedConfigurationError(MK1Error):
    """The configuration cannot run."""


class CheckpointError(MK1Error):
    """The checkpoint directory is unusable."""


class NativeBinaryError(MK1Error):
    """The native library cannot be loaded."""


# --- data types ---------------------------------------------------------------------------------


@dataclass(kw_only=True)
class MK1Config:
    device: Any
    max_sequence_length: int = 32768
    cache_scalar: str = "bfloat16"
    batch_size: int = 1
    backend: str = BACKEND
    model_family: str = MODEL_FAMILY
    model_revision: str = MODEL_REVISION
    gpu_architecture: str | None = None
    mode: str = "auto"

    def __post_init__(self):
        if self.cache_scalar not in CACHE_SCALARS:
            raise UnsupportedConfigurationError(f"cache_scalar {self.cache_scalar!r} not in {CACHE_SCALARS}")
        if self.mode not in MODES:
            raise UnsupportedConfigurationError(f"mode {self.mode!r} not in {MODES}")
        if not isinstance(self.max_sequence_length, int) or self.max_sequence_length < 1:
            raise UnsupportedConfigurationError(f"bad max_sequence_length {self.max_sequence_length!r}")


@dataclass(kw_only=True)
class AtomCacheBinding:
    key_planes: tuple
    value_planes: tuple
    block_counts: tuple
    block_strides: tuple
    pools: tuple


@dataclass(kw_only=True)
class QuantumRequest:
    pending_token: int
    committed_kv_length: int
    max_sequence_length: int
    max_tokens: int
    eos_token_id: int
    ignore_eos: bool
    full_block_map: torch.Tensor
    rope_cosine: torch.Tensor
    rope_sine: torch.Tensor
    sliding_block_map: torch.Tensor | None = None
    cancellation_flag: Any = None


@dataclass
class QuantumResult:
    finish_reason: str
    emitted_tokens: list[int]
    committed_kv_length: int
    pending_token: int
    completed_epochs: int


@dataclass
class Call:
    """One recorded call: ``name`` and its arguments."""

    name: str
    args: dict = field(default_factory=dict)


def marker(layer: int, position: int, plane: int) -> int:
    """The byte the double writes for ``position`` in ``layer``'s K (``plane=0``) or V (1) plane; never 0."""
    return (layer * 7 + position * 3 + plane * 101) % 255 + 1


# --- the module double --------------------------------------------------------------------------


class MK1Double:
    """One fresh ``aiter.MK1`` stand-in with its own call log, script and faults.

    Args:
        script: tokens ``run_quantum`` emits, consumed in order across quanta.
    """

    MK1Config = MK1Config
    AtomCacheBinding = AtomCacheBinding
    QuantumRequest = QuantumRequest
    QuantumResult = QuantumResult
    PrelaunchError = PrelaunchError
    BackendLaunchError = BackendLaunchError
    UnsupportedConfigurationError = UnsupportedConfigurationError
    CheckpointError = CheckpointError
    NativeBinaryError = NativeBinaryError

    def __init__(self, script: list[int] | None = None):
        self.calls: list[Call] = []
        self.script: list[int] = list(script or [])
        self.construction_fault: str | None = None
        """``"checkpoint"``, ``"unsupported"`` or ``"native"``: ``from_checkpoint`` raises that error."""
        self._faults: list[str] = []
        self._lock = threading.Lock()
        double = self

        class PersistentDecoder(_Decoder):
            _double = double

        self.PersistentDecoder = PersistentDecoder

    def record(self, name: str, **args) -> None:
        with self._lock:
            self.calls.append(Call(name, args))

    def calls_named(self, name: str) -> list[Call]:
        return [c for c in self.calls if c.name == name]

    def fail_next(self, fault: str) -> None:
        """Make the next ``run_quantum`` fail: ``"prelaunch"``, ``"launch"``, ``"zero"``,
        ``"committed"``, ``"pending"``, ``"too_many"`` or ``"garbage"``."""
        self._faults.append(fault)

    def is_supported(self, cfg: MK1Config) -> tuple[bool, list[str]]:
        self.record("is_supported", cfg=cfg)
        reasons = []
        if cfg.gpu_architecture not in SUPPORTED_ARCHITECTURES:
            reasons.append(f"gpu_architecture {cfg.gpu_architecture!r} is not gfx950")
        if cfg.batch_size != 1:
            reasons.append(f"batch_size {cfg.batch_size} != 1")
        if cfg.backend != BACKEND:
            reasons.append(f"backend {cfg.backend!r} != {BACKEND!r}")
        if cfg.model_family != MODEL_FAMILY:
            reasons.append(f"model_family {cfg.model_family!r} != {MODEL_FAMILY!r}")
        if cfg.model_revision != MODEL_REVISION:
            reasons.append(f"model_revision {cfg.model_revision!r} != {MODEL_REVISION!r}")
        return not reasons, reasons


class _Decoder:
    """The double's ``PersistentDecoder``; ``_double`` is set per :class:`MK1Double`."""

    _double: MK1Double

    def __init__(self, cfg: MK1Config, checkpoint_dir: str):
        self.cfg = cfg
        self.checkpoint_dir = checkpoint_dir
        self.binding: AtomCacheBinding | None = None

    @classmethod
    def from_checkpoint(cls, cfg: MK1Config, checkpoint_dir: str) -> _Decoder:
        d = cls._double
        d.record("from_checkpoint", cfg=cfg, checkpoint_dir=checkpoint_dir)
        fault = d.construction_fault
        if fault == "checkpoint" or not Path(checkpoint_dir).is_dir():
            raise CheckpointError(f"cannot load a persistent checkpoint from {checkpoint_dir}")
        if fault == "unsupported":
            raise UnsupportedConfigurationError("injected: unsupported configuration")
        if fault == "native":
            raise NativeBinaryError("injected: native library failed to load")
        supported, reasons = d.is_supported(cfg)
        if not supported:
            raise UnsupportedConfigurationError("; ".join(reasons))
        return cls(cfg, checkpoint_dir)

    def bind_cache(self, binding: AtomCacheBinding) -> None:
        self._double.record("bind_cache", binding=binding)
        fields = (binding.key_planes, binding.value_planes, binding.block_counts, binding.block_strides, binding.pools)
        if not all(isinstance(f, tuple) for f in fields) or len({len(f) for f in fields}) != 1:
            raise UnsupportedConfigurationError("binding fields must be per-layer tuples of one length")
        for i, (k, v) in enumerate(zip(binding.key_planes, binding.value_planes, strict=True)):
            for plane in (k, v):
                if not isinstance(plane, torch.Tensor) or plane.dtype != torch.uint8 or plane.dim() != 1:
                    raise UnsupportedConfigurationError(f"layer {i}: planes must be 1-D uint8 tensors")
                if not plane.is_contiguous():
                    raise UnsupportedConfigurationError(f"layer {i}: planes must be contiguous")
                if plane.numel() != binding.block_counts[i] * binding.block_strides[i]:
                    raise UnsupportedConfigurationError(f"layer {i}: plane bytes != block_count * block_stride")
        self.binding = binding

    def run_quantum(self, req: QuantumRequest) -> QuantumResult:
        d = self._double
        d.record("run_quantum", request=req)
        fault = d._faults.pop(0) if d._faults else None
        b = self.binding
        if b is None:
            raise PrelaunchError("no cache bound")
        self._validate(req, b)
        if fault == "prelaunch":
            raise PrelaunchError("injected prelaunch rejection")
        pending, committed = req.pending_token, req.committed_kv_length
        emitted: list[int] = []
        finish = "max_tokens"
        row = b.block_strides[0] // PAGE_SIZE
        for _ in range(req.max_tokens):
            page = int(req.full_block_map[committed // PAGE_SIZE])
            start = page * b.block_strides[0] + (committed % PAGE_SIZE) * row
            for layer in range(len(b.key_planes)):
                b.key_planes[layer][start:start + row] = marker(layer, committed, 0)
                b.value_planes[layer][start:start + row] = marker(layer, committed, 1)
            if fault == "launch":
                raise BackendLaunchError("injected failure after launch (KV already written)")
            if not d.script:
                raise BackendLaunchError("the double's token script is exhausted")
            pending = d.script.pop(0)
            committed += 1
            emitted.append(pending)
            if not req.ignore_eos and pending == req.eos_token_id:
                finish = "eos"
                break
            if committed >= req.max_sequence_length:
                finish = "max_sequence_length"
                break
        result = QuantumResult(finish, emitted, committed, pending, len(emitted))
        if fault == "zero":
            result.emitted_tokens, result.committed_kv_length = [], req.committed_kv_length
        elif fault == "committed":
            result.committed_kv_length += 1
        elif fault == "pending":
            result.pending_token += 1
        elif fault == "too_many":
            result.emitted_tokens = emitted + [pending] * (req.max_tokens + 1 - len(emitted))
            result.committed_kv_length = req.committed_kv_length + len(result.emitted_tokens)
        elif fault == "garbage":
            result.emitted_tokens = None
        return result

    def _validate(self, req: QuantumRequest, b: AtomCacheBinding) -> None:
        if not isinstance(req, QuantumRequest):
            raise PrelaunchError(f"expected aiter.MK1.QuantumRequest, got {type(req).__name__}")
        bm = req.full_block_map
        if bm.dtype != torch.int32 or bm.dim() != 1 or not bm.is_contiguous():
            raise PrelaunchError("full_block_map must be a contiguous 1-D int32 tensor")
        if bm.numel() * PAGE_SIZE < req.committed_kv_length + req.max_tokens:
            raise PrelaunchError("full_block_map does not cover the quantum")
        if bm.numel() and (int(bm.min()) < 0 or int(bm.max()) >= min(b.block_counts)):
            raise PrelaunchError("full_block_map holds a page id out of range")
        for name in ("rope_cosine", "rope_sine"):
            t = getattr(req, name)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16 or t.dim() != 2 or t.shape[1] != ROPE_COLUMNS:
                raise PrelaunchError(f"{name} must be a [len, 64] bf16 tensor")
            if t.shape[0] < req.committed_kv_length + req.max_tokens:
                raise PrelaunchError(f"{name} has {t.shape[0]} rows; the quantum reaches position "
                                     f"{req.committed_kv_length + req.max_tokens - 1}")
        if not 1 <= req.max_tokens <= 8:
            raise PrelaunchError(f"max_tokens {req.max_tokens} not in 1..8")
        if req.committed_kv_length + req.max_tokens > req.max_sequence_length:
            raise PrelaunchError("quantum passes max_sequence_length")

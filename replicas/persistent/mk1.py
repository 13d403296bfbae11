"""``mk1`` persistent backend: an adapter over AMD aiter's ``aiter.MK1`` megakernel (gfx950).

What it does, in order (docs/design.md "What the MK1 adapter maps", docs/mk1.md):

1. **Envelope.** :class:`Mk1Envelope` collects the facts MK1 depends on
   (device architecture read from the device properties, KV dtype and
   geometry, TP/PP, model revision, batch, prefix caching, chunked prefill);
   :func:`envelope_reasons` returns one precise sentence per violated rule.
2. **Import.** ``aiter.MK1`` is imported lazily, inside the backend, through
   one function, :func:`_import_mk1` (the seam tests replace with a test
   double). A missing module is our :class:`NativeBinaryError`: AMD aiter is
   built from source on ROCm; the PyPI project named ``aiter`` is unrelated.
3. **Construction.** ``MK1Config`` → ``is_supported`` → ``PersistentDecoder.from_checkpoint``;
   their errors map to ours.
4. **Binding.** Our :class:`CacheBinding` (flat ``uint8`` views of the engine's
   own K/V planes, bytes per page) is checked and turned into aiter's
   ``AtomCacheBinding``: no second cache.
5. **Quanta.** Each of our :class:`QuantumRequest` becomes an aiter
   ``QuantumRequest`` with the block map as contiguous int32 page ids on the
   device and the model's RoPE tables (:func:`mk1_rope_tables`); the
   result is converted and checked with :func:`validate_result`. aiter's
   ``PrelaunchError`` becomes ours (the lane falls back); anything raised once
   the launch was asked for becomes :class:`BackendLaunchError` (terminal; this
   backend then refuses further quanta as ``decoder_unhealthy``).

MK1 checks ONE eos id on device, so ``checks_stop_set_on_device = False``.
With several stop ids the quantum still runs its full size with one of them as
MK1's eos: it may decode past another stop id, and the lane, which checks every
emitted token on the host (``replicas.stops.accept_tokens``), cuts the output at
the first stop id and drops the rest of the quantum (its KV lies in pages the
request holds until it ends). The tokens are the same as with an on-device check
of the whole set; only the steps after such a stop are wasted, once per request.

This adapter has never run on an MI355X; it is tested only against a test
double of the ``aiter.MK1`` module boundary (``tests/replicas/persistent/mk1_double``).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from replicas.kernels.paged_attention import PAGE_SIZE
from replicas.persistent.checkpoint import CheckpointError, check_checkpoint_dir
from replicas.persistent.contract import (
    PERSISTENT_BACKENDS,
    BackendLaunchError,
    CacheBinding,
    InvalidQuantumResultError,
    NativeBinaryError,
    PersistentBackend,
    PrelaunchError,
    QuantumRequest,
    QuantumResult,
    UnsupportedConfigurationError,
    validate_request,
    validate_result,
)

# --- the facts of aiter.MK1 (squashed commit 4b492bb), docs/design.md "What the MK1 adapter maps" --

MK1_MODULE = "aiter.MK1"
MK1_BACKEND = "gpt_oss_gfx950_atom_v1"
MK1_MODEL_FAMILY = "gpt-oss-120b"
MK1_MODEL_REVISION = "b5c939de"
MK1_ARCHITECTURE = "gfx950"
MK1_CACHE_SCALAR = "bfloat16"
"""The KV scalar we run MK1 with. ``MK1Config`` also accepts ``float16``; our KV cache is bf16
(docs/design.md "KV cache geometry")."""
MK1_MODES = ("auto", "required")
MK1_REQUIRED_NAMES = (
    "MK1Config", "is_supported", "PersistentDecoder", "QuantumRequest", "AtomCacheBinding",
    "PrelaunchError", "BackendLaunchError", "UnsupportedConfigurationError", "CheckpointError",
    "NativeBinaryError",
)
"""What ``aiter.MK1`` must export for this adapter (checked at import)."""

GPT_OSS_120B_KV = (36, 8, 64)
"""``(num_layers, num_kv_heads, head_dim)`` of GPT-OSS-120B: the KV geometry MK1 is built for."""

ROPE_TABLE_COLUMNS = 64
"""Columns of MK1's ``rope_cosine``/``rope_sine`` tables; the first ``head_dim // 2`` = 32 are filled."""

BUILD_FROM_SOURCE = (
    "AMD aiter must be built from source on a ROCm machine (https://github.com/ROCm/aiter); "
    "never `pip install aiter`: the PyPI project named aiter is an unrelated async-iterator library"
)


def _import_mk1() -> ModuleType:
    """Import ``aiter.MK1``: the ONE place this adapter crosses the module boundary.

    Tests replace this function with a test double of the module.

    Raises:
        NativeBinaryError: the module (or its native library) cannot be loaded,
            or it lacks a name of the 4b492bb surface (:data:`MK1_REQUIRED_NAMES`).
    """
    try:
        mk1 = importlib.import_module(MK1_MODULE)
    except Exception as exc:  # noqa: BLE001 - ImportError, or the native library failing to load
        raise NativeBinaryError(f"cannot import {MK1_MODULE} ({type(exc).__name__}: {exc}); {BUILD_FROM_SOURCE}") from exc
    missing = [name for name in MK1_REQUIRED_NAMES if not hasattr(mk1, name)]
    if missing:
        raise NativeBinaryError(
            f"{MK1_MODULE} lacks {', '.join(missing)}: not the surface this adapter targets "
            f"(aiter commit 4b492bb); {BUILD_FROM_SOURCE}"
        )
    return mk1


# --- envelope -----------------------------------------------------------------------------------


def probe_gpu_architecture(device: torch.device | str) -> tuple[str, str | None]:
    """``(platform, gfx_arch)`` of ``device`` from its properties.

    ``platform`` is ``"cpu"``, ``"cuda"`` (an NVIDIA build of torch) or
    ``"rocm"``; ``gfx_arch`` is the ``gcnArchName`` of a ROCm device with its
    feature suffixes cut (``"gfx950:sramecc+:xnack-"`` → ``"gfx950"``), else None.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return device.type, None
    if torch.version.hip is None:
        return "cuda", None
    name = torch.cuda.get_device_properties(device).gcnArchName
    return "rocm", str(name).split(":", 1)[0]


@dataclass(frozen=True, kw_only=True)
class Mk1Envelope:
    """The facts MK1's support depends on, as plain values (:func:`envelope_reasons` judges them).

    Attributes:
        device: the replica's torch device, as a string.
        platform: ``"cpu"``, ``"cuda"`` (NVIDIA), ``"rocm"`` or another device type.
        gpu_architecture: gfx name of a ROCm device (from ``gcnArchName``), else None.
        kv_dtype: the KV cache's element dtype.
        kv_geometry: ``(num_layers, num_kv_heads, head_dim)`` of the KV cache.
        tensor_parallel_size / pipeline_parallel_size: the replica's parallelism.
        model_family: family of the persistent checkpoint (``gpt-oss-120b``), or None if unknown.
        model_revision: revision of the served weights, or None if unknown.
        batch_size: sequences per decode step on the lane.
        prefix_caching / chunked_prefill: whether the lane uses them.
        max_sequence_length: the lane's context limit (the RoPE tables' length).
    """

    device: str
    platform: str
    gpu_architecture: str | None
    kv_dtype: torch.dtype
    kv_geometry: tuple[int, int, int]
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    model_family: str | None = MK1_MODEL_FAMILY
    model_revision: str | None
    batch_size: int = 1
    prefix_caching: bool
    chunked_prefill: bool
    max_sequence_length: int


def envelope_reasons(env: Mk1Envelope) -> list[str]:
    """Every rule of MK1's envelope that ``env`` breaks, one precise sentence each (empty: supported)."""
    reasons = []
    if env.gpu_architecture != MK1_ARCHITECTURE:
        if env.platform == "rocm":
            found = f"an AMD GPU of architecture {env.gpu_architecture} (gcnArchName)"
        elif env.platform == "cuda":
            found = "an NVIDIA GPU (a CUDA build of torch: no gcnArchName)"
        else:
            found = f"a {env.platform} device, not an AMD GPU"
        reasons.append(f"device {env.device} is {found}: aiter.MK1 runs only on {MK1_ARCHITECTURE} (MI355X)")
    if env.kv_dtype != torch.bfloat16:
        reasons.append(f"KV cache dtype is {str(env.kv_dtype).removeprefix('torch.')}: aiter.MK1 needs a bfloat16 KV cache")
    if tuple(env.kv_geometry) != GPT_OSS_120B_KV:
        reasons.append(
            f"KV cache geometry (layers, kv_heads, head_dim) = {tuple(env.kv_geometry)} is not "
            f"{MK1_MODEL_FAMILY}'s {GPT_OSS_120B_KV}"
        )
    if env.tensor_parallel_size != 1:
        reasons.append(f"tensor_parallel_size={env.tensor_parallel_size}: aiter.MK1 runs one GPU per replica (TP 1)")
    if env.pipeline_parallel_size != 1:
        reasons.append(f"pipeline_parallel_size={env.pipeline_parallel_size}: aiter.MK1 runs one GPU per replica (PP 1)")
    if env.model_family != MK1_MODEL_FAMILY:
        reasons.append(f"model family {env.model_family!r}: aiter.MK1 is built for {MK1_MODEL_FAMILY}")
    if env.model_revision is None:
        reasons.append(f"model revision unknown: aiter.MK1 is built for {MK1_MODEL_FAMILY} revision {MK1_MODEL_REVISION}")
    elif env.model_revision != MK1_MODEL_REVISION:
        reasons.append(
            f"model revision {env.model_revision!r} is not the {MK1_MODEL_FAMILY} revision "
            f"aiter.MK1 is built for ({MK1_MODEL_REVISION})"
        )
    if env.batch_size != 1:
        reasons.append(f"batch_size={env.batch_size}: aiter.MK1 decodes batch 1")
    if env.prefix_caching:
        reasons.append("prefix caching is on for the persistent lane: aiter.MK1 needs it off")
    if env.chunked_prefill:
        reasons.append("chunked prefill is on for the persistent lane: aiter.MK1 needs it off")
    if env.max_sequence_length < 2:
        reasons.append(f"max_sequence_length={env.max_sequence_length} leaves no room to decode")
    return reasons


class Mk1EnvelopeError(UnsupportedConfigurationError):
    """The replica is outside MK1's envelope; ``reasons`` lists every broken rule."""

    def __init__(self, reasons: list[str]):
        super().__init__("aiter.MK1 does not support this replica: " + "; ".join(reasons))
        self.reasons = tuple(reasons)


# --- RoPE tables (YaRN) -------------------------------------------------------------------------


def mk1_rope_tables(length: int, model_config, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """MK1's ``(rope_cosine, rope_sine)`` for the served model: ``[length, 64]`` bf16, columns
    ``0..head_dim/2-1`` filled, the rest 0.

    The frequencies are the model's own (:func:`replicas.models.gpt_oss.rope_inv_freq` over its config's
    ``head_dim``, ``rope_theta`` and ``rope_scaling``: YaRN for GPT-OSS), so the engine's prefill and MK1's
    decode rotate alike. Row ``p``, column ``i < head_dim/2``: ``cos(p * inv_freq_i) * mscale`` (``sin``
    likewise), computed in fp32 then cast to bf16, as transformers' ``GptOssRotaryEmbedding`` does.

    Raises:
        UnsupportedConfigurationError: ``head_dim / 2`` exceeds MK1's :data:`ROPE_TABLE_COLUMNS`.
    """
    from replicas.models.gpt_oss import rope_inv_freq

    pairs = model_config.head_dim // 2
    if pairs > ROPE_TABLE_COLUMNS:
        raise UnsupportedConfigurationError(
            f"head_dim {model_config.head_dim} needs {pairs} RoPE columns; MK1 has {ROPE_TABLE_COLUMNS}")
    inv_freq, mscale = rope_inv_freq(model_config.head_dim, model_config.rope_theta,
                                     getattr(model_config, "rope_scaling", None))
    freqs = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [length, pairs] fp32
    cos = torch.zeros(length, ROPE_TABLE_COLUMNS, dtype=torch.bfloat16)
    sin = torch.zeros(length, ROPE_TABLE_COLUMNS, dtype=torch.bfloat16)
    cos[:, :pairs] = (freqs.cos() * mscale).to(torch.bfloat16)
    sin[:, :pairs] = (freqs.sin() * mscale).to(torch.bfloat16)
    return cos.to(device), sin.to(device)


# --- cache binding ------------------------------------------------------------------------------


def check_binding(binding: CacheBinding) -> None:
    """Check our binding is what ``AtomCacheBinding`` takes: bf16 GPT-OSS-120B planes, flat uint8, page-sized.

    Raises:
        UnsupportedConfigurationError: naming the first layer/plane that is off.
    """
    if binding.dtype != torch.bfloat16:
        raise UnsupportedConfigurationError(f"KV cache dtype {binding.dtype}: aiter.MK1 binds a bfloat16 cache")
    layers = len(binding.key_planes)
    geometry = (layers, binding.page_shape[1], binding.page_shape[2])
    if geometry != GPT_OSS_120B_KV or binding.page_shape[0] != PAGE_SIZE:
        raise UnsupportedConfigurationError(
            f"KV planes (layers, kv_heads, head_dim) = {geometry}, page {binding.page_shape[0]}: "
            f"aiter.MK1 binds {MK1_MODEL_FAMILY}'s {GPT_OSS_120B_KV} with {PAGE_SIZE}-token pages"
        )
    stride = PAGE_SIZE * binding.page_shape[1] * binding.page_shape[2] * 2
    fields = (binding.value_planes, binding.block_counts, binding.block_strides, binding.pools)
    if any(len(f) != layers for f in fields):
        raise UnsupportedConfigurationError("cache binding: per-layer tuples differ in length")
    for i in range(layers):
        if binding.block_strides[i] != stride:
            raise UnsupportedConfigurationError(f"layer {i}: {binding.block_strides[i]} bytes per page, expected {stride}")
        for kind, plane in (("key", binding.key_planes[i]), ("value", binding.value_planes[i])):
            if plane.dtype != torch.uint8 or plane.dim() != 1 or not plane.is_contiguous():
                raise UnsupportedConfigurationError(f"layer {i} {kind} plane must be a contiguous 1-D uint8 view")
            if plane.numel() != binding.block_counts[i] * stride:
                raise UnsupportedConfigurationError(
                    f"layer {i} {kind} plane has {plane.numel()} bytes, expected {binding.block_counts[i]} pages x {stride}"
                )


def atom_cache_binding(mk1: Any, binding: CacheBinding) -> Any:
    """aiter's ``AtomCacheBinding`` over the same planes as ``binding`` (checked first; shares storage)."""
    check_binding(binding)
    return mk1.AtomCacheBinding(
        key_planes=tuple(binding.key_planes),
        value_planes=tuple(binding.value_planes),
        block_counts=tuple(int(n) for n in binding.block_counts),
        block_strides=tuple(int(s) for s in binding.block_strides),
        pools=tuple(int(p) for p in binding.pools),
    )


# --- the backend --------------------------------------------------------------------------------


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Same device, where an index of None means "the current one" (``cuda`` == ``cuda:0`` on device 0)."""
    if a.type != b.type:
        return False
    if a.type == "cuda" and (a.index is None) != (b.index is None):
        current = torch.cuda.current_device()
        return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
    return a.index == b.index


def _as_token_list(tokens: Any) -> list[int]:
    if isinstance(tokens, torch.Tensor):
        return [int(t) for t in tokens.reshape(-1).tolist()]
    return [int(t) for t in tokens]


@dataclass
class _NativeErrors:
    """aiter's error classes, looked up once on the imported module."""

    prelaunch: type[BaseException]
    launch: type[BaseException]
    construction: dict[type[BaseException], type[Exception]] = field(default_factory=dict)


@PERSISTENT_BACKENDS.register("mk1")
class MK1Backend(PersistentBackend):
    """The persistent contract over ``aiter.MK1`` (gfx950, GPT-OSS-120B, bf16 KV, batch 1).

    Args:
        envelope: the replica's facts; checked before aiter is imported.
        checkpoint: the persistent-decoder checkpoint directory (``from_checkpoint``).
        mode: MK1's ``mode``, ``"auto"`` or ``"required"``.

    Raises:
        Mk1EnvelopeError: (an :class:`UnsupportedConfigurationError`) outside the envelope.
        NativeBinaryError: ``aiter.MK1`` cannot be imported (build it from source on ROCm).
        UnsupportedConfigurationError: ``MK1Config``/``is_supported`` refuse the config.
        CheckpointError: ``from_checkpoint`` refuses the directory.
    """

    name = "mk1"
    checks_stop_set_on_device = False
    """MK1 stops on one eos id only: with several stop ids it may run past the others (the lane cuts there)."""
    takes_cached_pages = False
    """MK1's envelope requires prefix caching off (``envelope_reasons``): the lane never shares pages with it."""

    def __init__(self, envelope: Mk1Envelope, checkpoint: str | Path, model_config, mode: str = "required"):
        if mode not in MK1_MODES:
            raise UnsupportedConfigurationError(f"MK1 mode {mode!r} is not one of {MK1_MODES}")
        reasons = envelope_reasons(envelope)
        if reasons:
            raise Mk1EnvelopeError(reasons)
        self.envelope = envelope
        self.device = torch.device(envelope.device)
        self.max_sequence_length = envelope.max_sequence_length
        self.unhealthy_reason: str | None = None
        self._bound = False
        self._block_counts: tuple[int, ...] = ()
        mk1 = _import_mk1()
        self._mk1 = mk1
        self._errors = _NativeErrors(
            prelaunch=mk1.PrelaunchError,
            launch=mk1.BackendLaunchError,
            construction={
                mk1.UnsupportedConfigurationError: UnsupportedConfigurationError,
                mk1.CheckpointError: CheckpointError,
                mk1.NativeBinaryError: NativeBinaryError,
            },
        )
        with self._construction_errors("MK1Config"):
            self.config = mk1.MK1Config(
                device=self.device,
                max_sequence_length=envelope.max_sequence_length,
                cache_scalar=MK1_CACHE_SCALAR,
                batch_size=envelope.batch_size,
                backend=MK1_BACKEND,
                model_family=MK1_MODEL_FAMILY,
                model_revision=envelope.model_revision,
                gpu_architecture=envelope.gpu_architecture,
                mode=mode,
            )
        with self._construction_errors("is_supported"):
            supported, native_reasons = mk1.is_supported(self.config)
        if not supported:
            raise UnsupportedConfigurationError(
                "aiter.MK1 is_supported refused the config: " + "; ".join(str(r) for r in native_reasons)
            )
        with self._construction_errors("PersistentDecoder.from_checkpoint"):
            self.decoder = mk1.PersistentDecoder.from_checkpoint(self.config, str(checkpoint))
        # Built once, on the device, from the model's own RoPE, and passed to every quantum (a quantum
        # allocates nothing).
        self.rope_cosine, self.rope_sine = mk1_rope_tables(envelope.max_sequence_length, model_config, self.device)
        eos = tuple(getattr(model_config, "eos_token_ids", ()))
        self.eos_token_id = min(eos) if eos else 0
        """The id passed as MK1's ``eos_token_id`` when a quantum has no stop id (then with ``ignore_eos``)."""

    @classmethod
    def for_core(cls, core, checkpoint: str | Path | None, mode: str = "required") -> MK1Backend:
        """The backend for a replica's :class:`~replicas.engine.EngineCore` (what the factory calls).

        Envelope facts: the device and its ``gcnArchName``; the KV tensor's
        dtype and geometry; TP = PP = 1 (a replica is one GPU: the engine has no
        tensor or pipeline parallelism); ``model_family`` and ``model_revision``
        from the checkpoint manifest; batch 1 (the lane runs one request);
        prefix caching as the lane's page allocator has it; chunked prefill off
        (``PersistentLane`` prefills a prompt in one forward).

        Raises:
            CheckpointError: no checkpoint directory, or a bad manifest.
            plus everything :class:`MK1Backend` raises.
        """
        if not checkpoint:
            raise CheckpointError("the mk1 backend needs a persistent-decoder checkpoint directory (none given)")
        manifest = check_checkpoint_dir(checkpoint)
        family, revision = manifest.get("model_family"), manifest.get("model_revision")
        device = core.runner.device
        platform, arch = probe_gpu_architecture(device)
        kv = core.kv_cache.tensor
        envelope = Mk1Envelope(
            device=str(device), platform=platform, gpu_architecture=arch,
            kv_dtype=kv.dtype, kv_geometry=(kv.shape[1], kv.shape[4], kv.shape[5]),
            model_family=None if family is None else str(family),
            model_revision=None if revision is None else str(revision),
            prefix_caching=bool(core.allocator.enable_prefix_caching), chunked_prefill=False,
            max_sequence_length=core.config.max_model_len,
        )
        backend = cls(envelope, checkpoint, core.model.config, mode)
        check_binding(CacheBinding.from_kv_tensor(kv))  # fail at construction, not when the lane binds
        return backend

    @contextmanager
    def _construction_errors(self, step: str) -> Iterator[None]:
        """Map aiter's construction-time errors raised inside the block to ours."""
        try:
            yield
        except tuple(self._errors.construction) as exc:
            ours = next(o for n, o in self._errors.construction.items() if isinstance(exc, n))
            raise ours(f"aiter.MK1 {step}: {exc}") from exc

    # --- contract ---------------------------------------------------------------------------

    def bind_cache(self, binding: CacheBinding) -> None:
        """Bind the engine's planes (checked by :func:`check_binding`) as aiter's ``AtomCacheBinding``.

        Raises:
            UnsupportedConfigurationError: our check or aiter's refuses the binding.
        """
        if binding.key_planes and not _same_device(binding.key_planes[0].device, self.device):
            raise UnsupportedConfigurationError(
                f"KV planes are on {binding.key_planes[0].device}, the decoder on {self.device}"
            )
        atom = atom_cache_binding(self._mk1, binding)
        with self._construction_errors("bind_cache"):
            self.decoder.bind_cache(atom)
        self._block_counts = binding.block_counts
        self._bound = True

    def native_request(self, req: QuantumRequest) -> Any:
        """aiter's ``QuantumRequest`` for ``req`` (checks first; raises :class:`PrelaunchError`).

        Block maps go to the device as contiguous int32; the RoPE tables are the
        ones built at construction. With one stop id that id is MK1's eos; with
        several, MK1's eos is the model's primary EOS (:attr:`eos_token_id`) if it is
        one of them, else the smallest (MK1 runs past the others; the lane cuts the
        output at the first stop id).
        ``cancellation_flag`` is not passed: its native type is not in the
        contract; the lane checks cancellation between quanta (at most 8 tokens).
        """
        if self.unhealthy_reason is not None:
            raise PrelaunchError(f"the mk1 decoder is unhealthy ({self.unhealthy_reason})", "decoder_unhealthy")
        if not self._bound:
            raise PrelaunchError("no KV cache bound", "unsupported_envelope")
        validate_request(req)
        if req.max_sequence_length > self.max_sequence_length:
            raise PrelaunchError(
                f"max_sequence_length {req.max_sequence_length} exceeds the decoder's {self.max_sequence_length}",
                "max_sequence_length",
            )
        if req.cancellation_flag is not None and req.cancellation_flag.is_set():
            raise PrelaunchError("cancelled before launch", "cancelled")
        # MK1's boundary: its kernel stops on one eos id, or on none with its ignore_eos flag; with several
        # stop ids it gets one of them (the model's primary EOS if it is one) and the lane cuts at the others
        stops = sorted(set(req.stop_token_ids))
        if not stops:
            eos, ignore_eos = self.eos_token_id, True
        else:
            eos, ignore_eos = (self.eos_token_id if self.eos_token_id in stops else stops[0]), False
        full = self._device_block_map(req.full_block_map, "full_block_map")
        sliding = None if req.sliding_block_map is None else self._device_block_map(req.sliding_block_map, "sliding_block_map")
        return self._mk1.QuantumRequest(
            pending_token=int(req.pending_token),
            committed_kv_length=int(req.committed_kv_length),
            max_sequence_length=int(req.max_sequence_length),
            max_tokens=int(req.max_tokens),
            eos_token_id=int(eos),
            ignore_eos=bool(ignore_eos),
            full_block_map=full,
            rope_cosine=self.rope_cosine,
            rope_sine=self.rope_sine,
            sliding_block_map=sliding,
            cancellation_flag=None,
        )

    def _device_block_map(self, block_map: torch.Tensor, what: str) -> torch.Tensor:
        if block_map.dtype != torch.int32 or block_map.dim() != 1:
            raise PrelaunchError(f"{what} must be a 1-D int32 tensor", "unsupported_envelope")
        if block_map.numel() and not (0 <= int(block_map.min()) and int(block_map.max()) < min(self._block_counts)):
            raise PrelaunchError(f"{what} holds a page id outside 0..{min(self._block_counts) - 1}", "unsupported_envelope")
        return block_map.to(self.device).contiguous()

    def run_quantum(self, req: QuantumRequest) -> QuantumResult:
        """Launch one MK1 quantum and check its result.

        Raises:
            PrelaunchError: our checks or aiter's ``PrelaunchError`` (cache untouched).
            BackendLaunchError: aiter's ``BackendLaunchError`` or any other
                failure of the launch (terminal; the backend turns unhealthy).
            InvalidQuantumResultError: the result breaks :func:`validate_result` (likewise).
        """
        native_req = self.native_request(req)
        try:
            native = self.decoder.run_quantum(native_req)
        except self._errors.prelaunch as exc:
            raise PrelaunchError(f"aiter.MK1 rejected the quantum before launch: {exc}", "unsupported_envelope") from exc
        except Exception as exc:  # noqa: BLE001 - after the launch was asked for, everything is terminal
            what = "failed after launch" if isinstance(exc, self._errors.launch) else f"raised {type(exc).__name__}"
            self.unhealthy_reason = BackendLaunchError.reason
            raise BackendLaunchError(f"aiter.MK1 quantum {what}: {exc}") from exc
        try:
            try:
                result = QuantumResult(
                    finish_reason=str(native.finish_reason),
                    emitted_tokens=_as_token_list(native.emitted_tokens),
                    committed_kv_length=int(native.committed_kv_length),
                    pending_token=int(native.pending_token),
                    completed_epochs=int(native.completed_epochs),
                )
            except (AttributeError, TypeError, ValueError) as exc:
                raise InvalidQuantumResultError(f"aiter.MK1 returned an unreadable result: {exc}") from exc
            validate_result(req, result)
        except InvalidQuantumResultError:
            self.unhealthy_reason = InvalidQuantumResultError.reason
            raise
        return result

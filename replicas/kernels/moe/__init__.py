"""GPT-OSS's mixture of experts over MXFP4 experts: one backend per model, chosen once at load.

:func:`resolve_moe` picks the kernels from the engine config (``moe_backend``, ``moe_repack``,
``moe_tiles``) and the device, and returns a :class:`MoEChoice` that the engine records and
``/debug/stats`` shows; :class:`MoE` runs that choice. Nothing here is read from the environment or
from a module global at call time.

Decode backends (at most :data:`DECODE_MAX_TOKENS` tokens per call, capturable in CUDA graphs):

=================== ============================================== ==========================
name                runs on                                        file
=================== ============================================== ==========================
``hopper_bulk``     NVIDIA sm_90+, bf16 models, torch's NVRTC       :mod:`.hopper_bulk`
``triton_tc``       NVIDIA, bf16/fp16 models (tensor cores)        :mod:`.triton_tc`
``triton_fp32``     NVIDIA, fp32 models (exact fp32 sums)           :mod:`.triton_fp32`
``triton_portable`` any GPU Triton supports (ROCm included)        :mod:`.triton_portable`
``reference``       anywhere (the CPU path)                        :mod:`.reference`
=================== ============================================== ==========================

``auto`` takes the first of these that runs here. A backend with a grouped decode kernel (``hopper_bulk``)
serves calls of up to :data:`GROUPED_DECODE_MAX_TOKENS` tokens with it, decode rows and prompt tokens alike
(:meth:`MoE.partials`). More tokens than that (than :data:`DECODE_MAX_TOKENS` on other backends) take the
prefill path, also chosen once (:attr:`MoEChoice.prefill`):

- ``grouped_gemm`` (a GPU with Triton and the engine config's ``prefill_kernels``): token-expert pairs
  grouped by expert on the device, tensor-core GEMMs with E2M1 decoded in the kernel, bias and clamped
  SwiGLU fused (:mod:`.grouped_gemm`); no host sync, so standard-lane decode graphs capture any batch;
- ``prefill_dequantize`` (a GPU with ``prefill_kernels`` off): every routed expert dequantized once by
  one Triton launch per matrix (:mod:`.prefill_dequantize`), then dense GEMMs;
- ``reference`` (CPU): the same in torch (:func:`.reference.moe_reference`).

Each decode backend is a class registered in :mod:`.backends` (:data:`MOE_REGISTRY`): its capabilities are
class attributes and its kernels live in its own file; adding one is that file plus one registration.

Shared formats, so that no backend imports another: the MXFP4 weight format (:mod:`.mxfp4`), the
repacked decode layout that ``hopper_bulk`` reads (:mod:`.decode_layout`; experts are repacked in place at
load when ``moe_repack`` holds and that backend runs), the tensor-core activation format and E2M1-decoding
PTX of ``hopper_bulk`` and ``triton_tc`` (:mod:`.mma_format`), and the Triton E2M1 decoding of
``triton_fp32`` and the prefill dequantization (:mod:`.e2m1`). ``docs/kernels.md`` has the catalog.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from replicas.kernels.moe.backends import (
    MOE_REGISTRY,
    MoEBackend,
    MoEBackendError,
    triton_importable,
)

if TYPE_CHECKING:  # torch is imported where it runs, so that the engine config can import MOE_REGISTRY cheaply
    import torch

    from replicas.kernels.moe.reference import moe_reference

__all__ = ["DECODE_MAX_TOKENS", "MOE_BACKENDS", "MOE_REGISTRY", "TILE_KEYS", "MoE", "MoEBackend", "MoEBackendError",
           "MoEChoice", "moe_reference", "resolve_moe"]

MOE_BACKENDS = MOE_REGISTRY.names()
"""The built-in decode backends' names, in the order ``auto`` tries them (a snapshot taken at import;
:data:`~.backends.MOE_REGISTRY`, the registry of :class:`~.backends.MoEBackend` classes, is the live list
that ``resolve_moe``, the engine config's ``moe_backend`` choices and the CLI's read)."""

DECODE_MAX_TOKENS = 16
"""Most tokens per call of a decode backend: above it, dequantize-then-GEMM beats re-reading the packed
experts per (token, expert) pair, and the standard lane's decode graphs stop there for GPT-OSS."""

GROUPED_DECODE_MAX_TOKENS = 256
"""Most tokens per call of a backend's grouped decode kernel (:attr:`.backends.MoEBackend.grouped_decode`:
``hopper_bulk``'s :mod:`.hopper_grouped`, 1,024 (token, expert) pairs at top-4). Up to this many tokens it
beats the grouped GEMMs (``decode_moe`` study; level with them at 256 on an H100); a row-exact decode step
of more rows runs it on slices of this many rows (rows are independent, so slicing changes no bits)."""


TILE_KEYS = {name: cls.tile_keys for name, cls in MOE_REGISTRY.items()}
"""Tile arguments each built-in backend's kernels take (``moe_tiles`` may set them; the defaults are the
kernels'): a snapshot of :attr:`.backends.MoEBackend.tile_keys`."""

ROW_EXACT_BLOCK_M = {"decode": 16, "prefill": 64}
"""The grouped GEMMs' M-block height per row family when the engine runs row-exact kernels
(``batch_invariant``): one height for every token count, so a pair's row never changes tile shape. Prompts
of 128 to 8,192 tokens route 4 to 256 pairs per expert; decode steps (up to 256 sequences) about 2 to 8 (16
wastes least), on backends without a grouped decode kernel (``hopper_bulk`` has one: :attr:`MoE.row_exact_decode`;
``docs/exactness.md``)."""


@dataclass(frozen=True)
class MoEChoice:
    """The MoE kernels one model runs, resolved once at load.

    Attributes:
        backend: the decode backend (a name in :data:`MOE_REGISTRY`).
        prefill: ``grouped_gemm``, ``prefill_dequantize`` (GPU) or ``reference`` (CPU): see the module doc.
        repack: whether the experts are repacked into :mod:`.decode_layout` at load (``hopper_bulk`` only).
        tiles: tile arguments passed to the decode kernels (its :attr:`~.backends.MoEBackend.tile_keys`).
        reason: why this backend (``auto`` resolution or the config's request).
    """

    backend: str
    prefill: str
    repack: bool
    tiles: dict[str, int] = field(default_factory=dict)
    reason: str = ""

    def describe(self) -> dict:
        """A JSON-able record (``/debug/stats``, span attributes)."""
        return {"moe_backend": self.backend, "moe_prefill": self.prefill, "moe_repack": self.repack,
                "moe_tiles": dict(self.tiles), "moe_reason": self.reason}


def resolve_moe(requested: str, device: torch.device, dtype: torch.dtype, repack: bool = True,
                tiles: dict[str, int] | None = None, prefill_kernels: bool = True) -> MoEChoice:
    """The MoE kernels for a ``dtype`` model on ``device``.

    Args:
        requested: ``auto`` or a name in :data:`MOE_REGISTRY`.
        repack: repack the experts at load for a backend that reads the decode layout (``hopper_bulk``;
            :attr:`~.backends.MoEBackend.repacks_experts`), ignored by the others.
        tiles: tile arguments for the decode kernels; every key must be one of the backend's
            :attr:`~.backends.MoEBackend.tile_keys`.
        prefill_kernels: on a GPU, the grouped GEMMs serve more than :data:`DECODE_MAX_TOKENS` tokens
            (else the per-expert dequantization).

    Raises:
        MoEBackendError: an unknown name, a named backend that cannot run here, or unknown tile keys.
    """
    import torch

    device = torch.device(device)
    if requested == "auto":
        name, reason = next((n, "auto") for n, cls in MOE_REGISTRY.items() if cls.why_not(device, dtype) is None)
    elif requested in MOE_REGISTRY:
        why = MOE_REGISTRY.get(requested).why_not(device, dtype)
        if why is not None:
            raise MoEBackendError(f"moe_backend={requested} {why} (device {device}, dtype "
                                  f"{str(dtype).removeprefix('torch.')}); use moe_backend=auto")
        name, reason = requested, "config"
    else:
        raise MoEBackendError(f"unknown moe_backend {requested!r}; choose auto or one of "
                              f"{', '.join(MOE_REGISTRY.names())}")
    backend = MOE_REGISTRY.get(name)
    tiles = dict(tiles or {})
    unknown = sorted(set(tiles) - set(backend.tile_keys))
    if unknown:
        raise MoEBackendError(f"moe_tiles {unknown} are not tiles of {name} (its tiles: "
                              f"{', '.join(backend.tile_keys) or 'none'})")
    gpu = device.type == "cuda" and triton_importable()
    prefill = ("grouped_gemm" if prefill_kernels else "prefill_dequantize") if gpu else "reference"
    return MoEChoice(name, prefill, repack and backend.repacks_experts, tiles, reason)


def _packed(experts) -> tuple:
    return (experts.gate_up_proj_blocks, experts.gate_up_proj_scales, experts.gate_up_proj_bias,
            experts.down_proj_blocks, experts.down_proj_scales, experts.down_proj_bias, experts.alpha, experts.limit)


class MoE:
    """Runs one :class:`MoEChoice`: the decode kernel (loaded once, :meth:`.backends.MoEBackend.load`) and the
    prefill path.

    ``experts`` arguments are GPT-OSS ``Experts`` modules (packed ``*_blocks``/``*_scales`` uint8, biases
    ``[E, 2I]``/``[E, hidden]``, ``alpha``, ``limit``; ``decode_layout`` True once repacked).

    Args:
        choice: the resolved backend.
        pdl: launch the decode kernels with programmatic dependent launch where they support it
            (``hopper_bulk``, ``triton_tc``; see :mod:`replicas.kernels.pdl`).
    """

    def __init__(self, choice: MoEChoice, pdl: bool = False):
        self.choice = choice
        self._decode = self.backend.load(dict(choice.tiles), repack=choice.repack, pdl=pdl)
        self._grouped_decode = self._exact_decode = None
        if self.backend.grouped_decode:
            self._grouped_decode = self.backend.load_grouped(dict(choice.tiles), repack=choice.repack, pdl=pdl)
            self._exact_decode = self.backend.load_row_exact(dict(choice.tiles), repack=choice.repack, pdl=pdl)
        self._dequantize = self._grouped = self._grouped_partials = None
        if choice.prefill in ("prefill_dequantize", "grouped_gemm"):  # the dequantizing path stays the fallback
            from replicas.kernels.moe.prefill_dequantize import triton_dequantize_mxfp4

            self._dequantize = triton_dequantize_mxfp4
        if choice.prefill == "grouped_gemm":
            from replicas.kernels.moe.grouped_gemm import experts_moe, experts_partials

            self._grouped, self._grouped_partials = experts_moe, experts_partials

    @property
    def backend(self) -> type[MoEBackend]:
        """The registered class of :attr:`MoEChoice.backend` (its capabilities)."""
        return MOE_REGISTRY.get(self.choice.backend)

    @property
    def capturable_at_any_batch(self) -> bool:
        """Whether every token count runs without a host sync (the prefill path is the grouped GEMMs), so
        the standard lane's decode graphs may capture batches above :data:`DECODE_MAX_TOKENS`."""
        return self.choice.prefill == "grouped_gemm"

    @property
    def kernel_max_tokens(self) -> int:
        """Most tokens of a call (decode rows or prompt tokens) that :meth:`partials` gives the decode
        kernels (which read activations in the tensor-core format when :attr:`takes_mxfp4_activations`):
        :data:`GROUPED_DECODE_MAX_TOKENS` with a grouped decode kernel, else :data:`DECODE_MAX_TOKENS`.
        :meth:`row_exact_partials` gives them every decode step when :attr:`row_exact_decode`."""
        return DECODE_MAX_TOKENS if self._grouped_decode is None else GROUPED_DECODE_MAX_TOKENS

    def reads_mxfp4(self, tokens: int, prefill: bool, row_exact: bool) -> bool:
        """Whether a call of ``tokens`` rows (``prefill``: prompt tokens) reads the tensor-core activation
        format (the add + RMSNorm before it then writes it): :attr:`takes_mxfp4_activations`, and the decode
        kernels serve the call (on the row-exact path, ``row_exact``: decode rows with
        :attr:`row_exact_decode`; else up to :attr:`kernel_max_tokens`)."""
        if not self.takes_mxfp4_activations:
            return False
        if row_exact:
            return not prefill and self.row_exact_decode
        return tokens <= self.kernel_max_tokens

    @property
    def row_exact_decode(self) -> bool:
        """Whether row-exact decode rows at every count run the backend's own kernels (its row-exact one-pair
        kernel up to :data:`DECODE_MAX_TOKENS` tokens, its grouped kernel above: one row-exact family),
        rather than the grouped GEMMs at :data:`ROW_EXACT_BLOCK_M` ``["decode"]``."""
        return self._grouped_decode is not None

    @property
    def takes_mxfp4_activations(self) -> bool:
        """Whether the decode kernel reads activations in the tensor-core format (the add+RMSNorm before
        it then writes them too, saving a conversion per layer)."""
        return self.backend.takes_mxfp4_activations

    def prepare(self, experts) -> bool:
        """Repack ``experts``' blocks in place for ``hopper_bulk`` when the choice says so, and tag the module;
        returns whether it repacked. Call once after loading, never inside a CUDA-graph capture.

        Raises:
            RuntimeError: called during a CUDA-graph capture."""
        import torch

        if not self.choice.repack or getattr(experts, "decode_layout", False):
            return False
        if experts.gate_up_proj_blocks.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("MoE.prepare inside a CUDA-graph capture")
        from replicas.kernels.moe.decode_layout import repack_

        with torch.no_grad():
            repack_(experts.gate_up_proj_blocks)
            repack_(experts.down_proj_blocks)
        experts.decode_layout = True
        return True

    def partials(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts,
                 x_mxfp4: torch.Tensor | None = None) -> torch.Tensor | None:
        """Per routed expert, its weighted output ``[T, K, hidden]`` fp32 (``x`` ``[T, hidden]``, ``weights``
        and ``ids`` ``[T, K]`` on the device), or None where no partials kernel serves ``T`` tokens: up to
        :data:`DECODE_MAX_TOKENS` the decode backend's (if it has one); above it, up to
        :attr:`kernel_max_tokens` (decode rows and prompt tokens alike), the backend's grouped decode kernel;
        else the grouped GEMMs (if they are the prefill path). ``x_mxfp4``: ``x`` in the tensor-core format,
        when :attr:`takes_mxfp4_activations` and the caller has it (decode kernels only)."""
        extra = {"x_mxfp4": x_mxfp4} if x_mxfp4 is not None else {}
        if x.shape[0] > DECODE_MAX_TOKENS:
            if x.shape[0] <= self.kernel_max_tokens:  # only a grouped decode kernel serves more than 16
                return self._grouped_decode(x, weights, ids, *_packed(experts), **extra)
            return self._grouped_partials(x, weights, ids, experts) if self._grouped_partials else None
        if not self.backend.returns_partials:
            return None
        return self._decode(x, weights, ids, *_packed(experts), **extra)

    def row_exact_partials(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts,
                           prefill: bool, x_mxfp4: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`partials` with each pair's row bitwise independent of the other tokens and of their number:
        ``[T, K, hidden]`` fp32. Decode rows (not ``prefill``) with :attr:`row_exact_decode`: the backend's
        row-exact one-pair kernel (:meth:`.backends.MoEBackend.load_row_exact`) up to
        :data:`DECODE_MAX_TOKENS` tokens, its grouped kernel above (on slices of
        :data:`GROUPED_DECODE_MAX_TOKENS` rows); otherwise the grouped GEMMs at every token count with the
        fixed M-block height of :data:`ROW_EXACT_BLOCK_M` (``prefill``: prompt tokens, else decode rows).

        Raises:
            RuntimeError: neither a row-exact decode family nor the grouped GEMMs are available."""
        if not prefill and self.row_exact_decode:
            if x.shape[0] <= DECODE_MAX_TOKENS:
                return self._exact_decode(x, weights, ids, *_packed(experts),
                                    **({"x_mxfp4": x_mxfp4} if x_mxfp4 is not None else {}))
            import torch

            step = GROUPED_DECODE_MAX_TOKENS
            parts = [self._grouped_decode(x[i:i + step], weights[i:i + step], ids[i:i + step], *_packed(experts),
                                          **({"x_mxfp4": x_mxfp4[i:i + step]} if x_mxfp4 is not None else {}))
                     for i in range(0, x.shape[0], step)]
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        if self._grouped_partials is None:
            raise RuntimeError(f"row-exact MoE needs the grouped GEMMs (prefill path is {self.choice.prefill})")
        return self._grouped_partials(x, weights, ids, experts,
                                      block_m=ROW_EXACT_BLOCK_M["prefill" if prefill else "decode"])

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """``residual + sum_k weights[:, k] * expert_{ids[:, k]}(x)`` ``[T, hidden]`` in ``x.dtype``: the decode
        kernel for up to :data:`DECODE_MAX_TOKENS` tokens, else the prefill path (:attr:`MoEChoice.prefill`)."""
        if x.shape[0] > DECODE_MAX_TOKENS and self._grouped is not None:
            out = self._grouped(x, weights, ids, experts)
            return out if residual is None else residual + out
        if x.shape[0] <= DECODE_MAX_TOKENS:
            parts = self.partials(x, weights, ids, experts)
            if parts is not None:
                out = parts.sum(1)
                return (out if residual is None else residual.float() + out).to(x.dtype)
            if self.backend.adds_residual:
                return self._decode(x, weights, ids, *_packed(experts), residual=residual)
        from replicas.kernels.moe.reference import moe_reference

        fast = self._dequantize
        out = moe_reference(x, weights, ids, experts, dequantize=fast,
                            dequantize_repacked=functools.partial(fast, repacked=True) if fast else None)
        return out if residual is None else residual + out


def __getattr__(name: str):
    """``moe_reference`` on first access (PEP 562): the torch reference stays out of a plain import."""
    if name == "moe_reference":
        from replicas.kernels.moe.reference import moe_reference

        return moe_reference
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

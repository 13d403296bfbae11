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

``auto`` takes the first of these that runs here. More tokens than :data:`DECODE_MAX_TOKENS` (prefill,
large standard-lane batches) take the prefill path, also chosen once (:attr:`MoEChoice.prefill`):

- ``grouped_gemm`` (a GPU with Triton and the engine config's ``prefill_kernels``): token-expert pairs
  grouped by expert on the device, tensor-core GEMMs with E2M1 decoded in the kernel, bias and clamped
  SwiGLU fused (:mod:`.grouped_gemm`); no host sync, so standard-lane decode graphs capture any batch;
- ``prefill_dequantize`` (a GPU with ``prefill_kernels`` off): every routed expert dequantized once by
  one Triton launch per matrix (:mod:`.prefill_dequantize`), then dense GEMMs;
- ``reference`` (CPU): the same in torch (:func:`.reference.moe_reference`).

Shared formats: the MXFP4 weight format (:mod:`.mxfp4`), the repacked decode layout that ``hopper_bulk``
reads (:mod:`.decode_layout`; experts are repacked in place at load when ``moe_repack`` holds and that
backend runs), and the tensor-core activation format of ``hopper_bulk`` and ``triton_tc``
(:func:`.triton_tc.mxfp4_activations`). ``docs/kernels.md`` has the catalog.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from replicas.kernels.moe.reference import moe_reference

MOE_BACKENDS = ("hopper_bulk", "triton_tc", "triton_fp32", "triton_portable", "reference")
"""Decode backends, in the order ``auto`` tries them (the engine config's ``moe_backend`` choices)."""

DECODE_MAX_TOKENS = 16
"""Most tokens per call of a decode backend: above it, dequantize-then-GEMM beats re-reading the packed
experts per (token, expert) pair, and the standard lane's decode graphs stop there for GPT-OSS."""

TILE_KEYS = {
    "hopper_bulk": ("num_warps", "down_num_warps", "pairs", "down_pairs", "stages", "blocks_per_sm"),
    "triton_tc": ("num_warps", "down_num_warps", "depth", "down_depth", "pairs", "down_pairs"),
    "triton_fp32": ("block_j", "block_r", "blocks_per_step", "num_warps"),
    "triton_portable": ("block_j", "block_r", "groups_per_tile"),
    "reference": (),
}
"""Tile arguments each backend's kernels take (``moe_tiles`` may set them; the defaults are the kernels')."""

PARTIALS_BACKENDS = ("hopper_bulk", "triton_tc", "triton_fp32")
"""Backends that return per-expert fp32 partials ``[T, K, hidden]``, summed in order by the next add+RMSNorm."""

ROW_EXACT_BLOCK_M = {"decode": 16, "prefill": 64}
"""The grouped GEMMs' M-block height per row family when the engine runs row-exact kernels
(``batch_invariant``): one height for every token count, so a pair's row never changes tile shape. Decode
steps (up to 256 sequences) route about 2 to 8 pairs per expert (16 wastes least); prompts of 128 to 8,192
tokens 4 to 256 (``docs/exactness.md``)."""

MXFP4_ACTIVATION_BACKENDS = ("hopper_bulk", "triton_tc")
"""Backends that read activations in the tensor-core format; the add+RMSNorm before them writes it."""


class MoEBackendError(ValueError):
    """The requested MoE backend (or its tiles) cannot run on this device and dtype; the message says why."""


@dataclass(frozen=True)
class MoEChoice:
    """The MoE kernels one model runs, resolved once at load.

    Attributes:
        backend: the decode backend (one of :data:`MOE_BACKENDS`).
        prefill: ``grouped_gemm``, ``prefill_dequantize`` (GPU) or ``reference`` (CPU): see the module doc.
        repack: whether the experts are repacked into :mod:`.decode_layout` at load (``hopper_bulk`` only).
        tiles: tile arguments passed to the decode kernels (keys of :data:`TILE_KEYS`).
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


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _why_not(name: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``name`` cannot run for a ``dtype`` model on ``device`` (None: it can)."""
    if name == "reference":
        return None
    if device.type != "cuda":
        return "needs a GPU"
    if not _triton_importable():
        return "needs Triton"
    hip = bool(torch.version.hip)
    if name == "triton_portable":
        return None
    if hip:
        return "needs an NVIDIA GPU (inline PTX)"
    if name == "triton_fp32":
        return None if dtype == torch.float32 else "is for fp32 models"
    if dtype == torch.float32:
        return "rounds activations to bf16; fp32 models use triton_fp32"
    if name == "triton_tc":
        return None
    # hopper_bulk
    if dtype != torch.bfloat16:
        return "needs a bf16 model"
    from replicas.kernels.moe import hopper_bulk

    index = device.index if device.index is not None else torch.cuda.current_device()
    if not hopper_bulk.available(index):
        return "needs compute capability 9.0+ and torch's NVRTC"
    return None


def resolve_moe(requested: str, device: torch.device, dtype: torch.dtype, repack: bool = True,
                tiles: dict[str, int] | None = None, prefill_kernels: bool = True) -> MoEChoice:
    """The MoE kernels for a ``dtype`` model on ``device``.

    Args:
        requested: ``auto`` or one of :data:`MOE_BACKENDS`.
        repack: repack the experts for ``hopper_bulk`` at load (ignored by the other backends).
        tiles: tile arguments for the decode kernels; every key must be one of the backend's
            :data:`TILE_KEYS`.
        prefill_kernels: on a GPU, the grouped GEMMs serve more than :data:`DECODE_MAX_TOKENS` tokens
            (else the per-expert dequantization).

    Raises:
        MoEBackendError: an unknown name, a named backend that cannot run here, or unknown tile keys.
    """
    device = torch.device(device)
    if requested == "auto":
        name, reason = next((n, "auto") for n in MOE_BACKENDS if _why_not(n, device, dtype) is None)
    elif requested in MOE_BACKENDS:
        why = _why_not(requested, device, dtype)
        if why is not None:
            raise MoEBackendError(f"moe_backend={requested} {why} (device {device}, dtype "
                                  f"{str(dtype).removeprefix('torch.')}); use moe_backend=auto")
        name, reason = requested, "config"
    else:
        raise MoEBackendError(f"unknown moe_backend {requested!r}; choose auto or one of {', '.join(MOE_BACKENDS)}")
    tiles = dict(tiles or {})
    unknown = sorted(set(tiles) - set(TILE_KEYS[name]))
    if unknown:
        raise MoEBackendError(f"moe_tiles {unknown} are not tiles of {name} (its tiles: "
                              f"{', '.join(TILE_KEYS[name]) or 'none'})")
    gpu = device.type == "cuda" and _triton_importable()
    prefill = ("grouped_gemm" if prefill_kernels else "prefill_dequantize") if gpu else "reference"
    return MoEChoice(name, prefill, repack and name == "hopper_bulk", tiles, reason)


def _packed(experts) -> tuple:
    return (experts.gate_up_proj_blocks, experts.gate_up_proj_scales, experts.gate_up_proj_bias,
            experts.down_proj_blocks, experts.down_proj_scales, experts.down_proj_bias, experts.alpha, experts.limit)


class MoE:
    """Runs one :class:`MoEChoice`: the decode kernel (loaded once) and the prefill path.

    ``experts`` arguments are GPT-OSS ``Experts`` modules (packed ``*_blocks``/``*_scales`` uint8, biases
    ``[E, 2I]``/``[E, hidden]``, ``alpha``, ``limit``; ``decode_layout`` True once repacked).

    Args:
        choice: the resolved backend.
        pdl: launch the decode kernels with programmatic dependent launch where they support it
            (``hopper_bulk``, ``triton_tc``; see :mod:`replicas.kernels.pdl`).
    """

    def __init__(self, choice: MoEChoice, pdl: bool = False):
        self.choice = choice
        self._decode = self._load_decode(choice, pdl)
        self._dequantize = self._grouped = self._grouped_partials = None
        if choice.prefill in ("prefill_dequantize", "grouped_gemm"):  # the dequantizing path stays the fallback
            from replicas.kernels.moe.prefill_dequantize import triton_dequantize_mxfp4

            self._dequantize = triton_dequantize_mxfp4
        if choice.prefill == "grouped_gemm":
            from replicas.kernels.moe.grouped_gemm import experts_moe, experts_partials

            self._grouped, self._grouped_partials = experts_moe, experts_partials

    @staticmethod
    def _load_decode(choice: MoEChoice, pdl: bool):
        tiles = dict(choice.tiles)
        if choice.backend == "hopper_bulk":
            from replicas.kernels.moe.hopper_bulk import cuda_moe_bulk

            return functools.partial(cuda_moe_bulk, repacked=choice.repack, pdl=pdl, **tiles)
        if choice.backend == "triton_tc":
            from replicas.kernels.moe.triton_tc import triton_moe_tc

            return functools.partial(triton_moe_tc, pdl=pdl, **tiles)
        if choice.backend == "triton_fp32":
            from replicas.kernels.moe.triton_fp32 import triton_moe_gemv

            return functools.partial(triton_moe_gemv, **tiles)
        if choice.backend == "triton_portable":
            from replicas.kernels.moe.triton_portable import triton_moe

            return functools.partial(triton_moe, **tiles)
        return None

    @property
    def capturable_at_any_batch(self) -> bool:
        """Whether every token count runs without a host sync (the prefill path is the grouped GEMMs), so
        the standard lane's decode graphs may capture batches above :data:`DECODE_MAX_TOKENS`."""
        return self.choice.prefill == "grouped_gemm"

    @property
    def takes_mxfp4_activations(self) -> bool:
        """Whether the decode kernel reads activations in the tensor-core format (the add+RMSNorm before
        it then writes them too, saving a conversion per layer)."""
        return self.choice.backend in MXFP4_ACTIVATION_BACKENDS

    def prepare(self, experts) -> bool:
        """Repack ``experts``' blocks in place for ``hopper_bulk`` when the choice says so, and tag the module;
        returns whether it repacked. Call once after loading, never inside a CUDA-graph capture.

        Raises:
            RuntimeError: called during a CUDA-graph capture."""
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
        :data:`DECODE_MAX_TOKENS` the decode backend's (if it has one), above it the grouped GEMMs (if
        they are the prefill path). ``x_mxfp4``: ``x`` in the tensor-core format, when
        :attr:`takes_mxfp4_activations` and the caller has it (decode sizes only)."""
        if x.shape[0] > DECODE_MAX_TOKENS:
            return self._grouped_partials(x, weights, ids, experts) if self._grouped_partials else None
        if self.choice.backend not in PARTIALS_BACKENDS:
            return None
        extra = {"x_mxfp4": x_mxfp4} if x_mxfp4 is not None else {}
        return self._decode(x, weights, ids, *_packed(experts), **extra)

    def row_exact_partials(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts,
                           prefill: bool) -> torch.Tensor:
        """:meth:`partials` through the grouped GEMMs at every token count with the fixed M-block height of
        :data:`ROW_EXACT_BLOCK_M` (``prefill``: prompt tokens, else decode rows): ``[T, K, hidden]`` fp32,
        each pair's row bitwise independent of the other tokens.

        Raises:
            RuntimeError: the grouped GEMMs are not this choice's prefill path."""
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
            if self.choice.backend == "triton_portable":
                return self._decode(x, weights, ids, *_packed(experts), residual=residual)
        fast = self._dequantize
        out = moe_reference(x, weights, ids, experts, dequantize=fast,
                            dequantize_repacked=functools.partial(fast, repacked=True) if fast else None)
        return out if residual is None else residual + out

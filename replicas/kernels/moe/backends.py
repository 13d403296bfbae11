"""The MoE decode backends as registered: one class per backend, its capabilities and its entry point.

Each backend's kernels live in its own file (named as the backend, e.g. :mod:`.triton_tc`); the class here
says, before anything is loaded or launched, where the backend runs (:meth:`MoEBackend.why_not`) and what
it can do (class attributes), and loads its entry point lazily (:meth:`MoEBackend.load`), so that
importing this module needs neither Triton nor a GPU. Adding a backend is its kernel file plus one
registered class here: ``resolve_moe``, the engine config's ``moe_backend`` choices and the CLI's read
:data:`MOE_REGISTRY`.

Registration order is the order ``moe_backend=auto`` tries them (the first whose ``why_not`` is None).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from replicas.registry import Registry

if TYPE_CHECKING:
    import torch


class MoEBackendError(ValueError):
    """The requested MoE backend (or its tiles) cannot run on this device and dtype; the message says why."""


class MoEBackend:
    """One MoE decode backend (at most ``DECODE_MAX_TOKENS`` tokens per call, capturable in CUDA graphs).

    Subclasses register themselves with ``@MOE_REGISTRY.register(name)``; nothing is instantiated: the
    class is the backend's description.

    Capabilities (class attributes, read by :func:`~replicas.kernels.moe.resolve_moe` and
    :class:`~replicas.kernels.moe.MoE` before any kernel is loaded):

    Attributes:
        name: the registered name (the engine config's ``moe_backend`` value); set by the registry.
        tile_keys: tile arguments its kernels take (``moe_tiles`` may set them; defaults are the kernels').
        returns_partials: the kernel returns per-expert fp32 partials ``[T, K, hidden]``, summed in a fixed
            order by the next add+RMSNorm (else it returns the layer's output itself).
        takes_mxfp4_activations: the kernel reads activations in the tensor-core format
            (:mod:`.mma_format`); the add+RMSNorm before it then writes them too.
        adds_residual: the kernel takes the residual and returns ``residual + moe(x)`` in ``x.dtype``.
        repacks_experts: the experts are repacked into :mod:`.decode_layout` at load when ``moe_repack``
            holds (its kernel reads that layout).
        grouped_decode: the backend has a second decode kernel for calls of more tokens than
            ``DECODE_MAX_TOKENS`` (:meth:`load_grouped`) whose rows are bitwise those of its row-exact
            one-pair kernel (:meth:`load_row_exact`), so the two are one row-exact family
            (``docs/exactness.md``).
    """

    name: ClassVar[str] = "abstract"
    tile_keys: ClassVar[tuple[str, ...]] = ()
    returns_partials: ClassVar[bool] = False
    takes_mxfp4_activations: ClassVar[bool] = False
    adds_residual: ClassVar[bool] = False
    repacks_experts: ClassVar[bool] = False
    grouped_decode: ClassVar[bool] = False

    @classmethod
    def why_not(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why this backend cannot run for a ``dtype`` model on ``device`` (None: it can). The text completes
        ``moe_backend=<name> ...`` in :class:`MoEBackendError`'s message. Launches no model kernel (it may
        compile a probe, as ``hopper_bulk`` does)."""
        raise NotImplementedError

    @classmethod
    def load(cls, tiles: dict[str, int], *, repack: bool, pdl: bool) -> Callable | None:
        """The decode entry point with its tiles bound (imports the kernel module), or None for a backend
        without a decode kernel (the reference path). ``repack``: the experts are in
        :mod:`.decode_layout`; ``pdl``: launch with programmatic dependent launch where supported."""
        raise NotImplementedError

    @classmethod
    def load_grouped(cls, tiles: dict[str, int], *, repack: bool, pdl: bool) -> Callable | None:
        """The grouped decode entry point (:attr:`grouped_decode`) with its tiles bound, or None."""
        return None

    @classmethod
    def load_row_exact(cls, tiles: dict[str, int], *, repack: bool, pdl: bool) -> Callable | None:
        """With :attr:`grouped_decode`: the decode kernel for up to ``DECODE_MAX_TOKENS`` row-exact rows, whose
        rows the grouped kernel reproduces bit for bit (may differ from :meth:`load`'s, the fastest)."""
        return None


MOE_REGISTRY: Registry[type[MoEBackend]] = Registry("moe_backend", MoEBackend)
"""The registered decode backends, in the order ``auto`` tries them."""


def triton_importable() -> bool:
    """Whether Triton imports here."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _gpu_with_triton(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "needs a GPU"
    if not triton_importable():
        return "needs Triton"
    return None


def _nvidia(device: torch.device) -> str | None:
    import torch

    why = _gpu_with_triton(device)
    if why is None and torch.version.hip:
        return "needs an NVIDIA GPU (inline PTX)"
    return why


GROUPED_TILES = {"grouped_pairs": "pairs", "grouped_down_pairs": "down_pairs",
                 "grouped_blocks_per_sm": "blocks_per_sm", "tokens_per_chunk": "tokens_per_chunk"}
"""``hopper_bulk``'s tiles of its grouped decode kernel (``moe_tiles`` key → the argument of
:func:`~.hopper_grouped.cuda_moe_grouped`); its warps are the one-pair kernel's."""

WARP_TILES = ("num_warps", "down_num_warps")
"""``hopper_bulk``'s tiles that all its kernels take: the warps split the K steps and fix the order of a row's
sums, so the row-exact one-pair kernel and the grouped kernel must have the same."""


@MOE_REGISTRY.register("hopper_bulk")
class HopperBulk(MoEBackend):
    """CUDA C++ through torch's NVRTC, weights bulk-copied to shared memory (:mod:`.hopper_bulk`): NVIDIA
    sm_90+, bf16 models."""

    tile_keys = (*WARP_TILES, "pairs", "down_pairs", "stages", "blocks_per_sm", *GROUPED_TILES)
    returns_partials = True
    takes_mxfp4_activations = True
    repacks_experts = True
    grouped_decode = True

    @classmethod
    def why_not(cls, device, dtype):
        import torch

        why = _nvidia(device)
        if why is not None:
            return why
        if dtype == torch.float32:
            return "rounds activations to bf16; fp32 models use triton_fp32"
        if dtype != torch.bfloat16:
            return "needs a bf16 model"
        from replicas.kernels.moe import hopper_bulk

        index = device.index if device.index is not None else torch.cuda.current_device()
        if not hopper_bulk.available(index):
            return "needs compute capability 9.0+ and torch's NVRTC"
        return None

    @classmethod
    def load(cls, tiles, *, repack, pdl):
        from replicas.kernels.moe.hopper_bulk import cuda_moe_bulk

        return functools.partial(cuda_moe_bulk, repacked=repack, pdl=pdl,
                                 **{k: v for k, v in tiles.items() if k not in GROUPED_TILES})

    @classmethod
    def load_row_exact(cls, tiles, *, repack, pdl):
        """:func:`~.hopper_bulk.cuda_moe_bulk` in the folded family (``fold_scales``), whose rows the grouped
        kernel reproduces bit for bit at the same warps."""
        return functools.partial(cls.load(tiles, repack=repack, pdl=pdl), fold_scales=True)

    @classmethod
    def load_grouped(cls, tiles, *, repack, pdl):
        """:func:`~.hopper_grouped.cuda_moe_grouped` with the one-pair kernel's :data:`WARP_TILES` (they fix
        the order of a row's sums) and the :data:`GROUPED_TILES`."""
        from replicas.kernels.moe.hopper_grouped import cuda_moe_grouped

        shared = {k: v for k, v in tiles.items() if k in WARP_TILES}
        own = {GROUPED_TILES[k]: v for k, v in tiles.items() if k in GROUPED_TILES}
        return functools.partial(cuda_moe_grouped, repacked=repack, pdl=pdl, **shared, **own)


@MOE_REGISTRY.register("triton_tc")
class TritonTc(MoEBackend):
    """Triton with inline-PTX tensor-core MMAs (:mod:`.triton_tc`): NVIDIA, bf16/fp16 models."""

    tile_keys = ("num_warps", "down_num_warps", "depth", "down_depth", "pairs", "down_pairs")
    returns_partials = True
    takes_mxfp4_activations = True

    @classmethod
    def why_not(cls, device, dtype):
        import torch

        why = _nvidia(device)
        if why is None and dtype == torch.float32:
            return "rounds activations to bf16; fp32 models use triton_fp32"
        return why

    @classmethod
    def load(cls, tiles, *, repack, pdl):
        from replicas.kernels.moe.triton_tc import triton_moe_tc

        return functools.partial(triton_moe_tc, pdl=pdl, **tiles)


@MOE_REGISTRY.register("triton_fp32")
class TritonFp32(MoEBackend):
    """Triton on the SIMT cores, exact fp32 sums (:mod:`.triton_fp32`): NVIDIA, fp32 models."""

    tile_keys = ("block_j", "block_r", "blocks_per_step", "num_warps")
    returns_partials = True

    @classmethod
    def why_not(cls, device, dtype):
        import torch

        why = _nvidia(device)
        if why is None and dtype != torch.float32:
            return "is for fp32 models"
        return why

    @classmethod
    def load(cls, tiles, *, repack, pdl):
        from replicas.kernels.moe.triton_fp32 import triton_moe_gemv

        return functools.partial(triton_moe_gemv, **tiles)


@MOE_REGISTRY.register("triton_portable")
class TritonPortable(MoEBackend):
    """Plain Triton (:mod:`.triton_portable`): any GPU Triton supports (ROCm included)."""

    tile_keys = ("block_j", "block_r", "groups_per_tile")
    adds_residual = True

    @classmethod
    def why_not(cls, device, dtype):
        return _gpu_with_triton(device)

    @classmethod
    def load(cls, tiles, *, repack, pdl):
        from replicas.kernels.moe.triton_portable import triton_moe

        return functools.partial(triton_moe, **tiles)


@MOE_REGISTRY.register("reference")
class Reference(MoEBackend):
    """Torch (:func:`.reference.moe_reference`): anywhere (the CPU path); no decode kernel."""

    @classmethod
    def why_not(cls, device, dtype):
        return None

    @classmethod
    def load(cls, tiles, *, repack, pdl):
        return None

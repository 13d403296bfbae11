"""Programmatic dependent launch (PDL) for the decode step's Triton kernels (Hopper and newer).

A decode step is a few hundred short launches back to back, and every launch
starts by waiting for DRAM (``docs/decisions/0012-programmatic-dependent-launch.md`` has the gaps and what PDL
saves). With PDL (CUDA's programmatic stream serialization; PTX
``griddepcontrol``, Triton's ``gdc_wait`` / ``gdc_launch_dependents`` and the
``launch_pdl`` launch option) a kernel's CTAs may start while the previous
kernel is still running; they first do what does not depend on it (address
arithmetic, loads of weights), then wait (``griddepcontrol.wait``: the previous
grid has completed and its writes are visible) and only then read its outputs.
CUDA graph capture keeps these programmatic edges.

The rule every kernel here follows, which makes it safe: **wait, then let the
next kernel launch** (:func:`pdl_wait` does both). So when a kernel starts,
the kernel two launches back has completed: before its own wait a kernel may
read weights and whatever was written two or more launches back, and must not
write anything.

Off (``PDL=False``) on the CPU interpreter, on ROCm, before sm_90, and where the engine config says
``pdl=false`` (each kernel wrapper takes ``pdl``; :class:`replicas.kernels.decode_ops.DecodeOps` passes
the value resolved at load).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@functools.cache
def _capable(device_index: int) -> bool:
    from triton.language.extra import cuda as tl_cuda

    return torch.cuda.get_device_capability(device_index)[0] >= 9 and hasattr(tl_cuda, "gdc_wait")


def supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can launch with PDL: an NVIDIA GPU of compute capability 9.0+ and a
    Triton with ``gdc_wait``."""
    return device.type == "cuda" and not torch.version.hip and _capable(device.index or 0)


def pdl_args(t: torch.Tensor, enabled: bool = True) -> dict:
    """Launch keyword arguments for a kernel that takes a ``PDL: tl.constexpr`` and calls :func:`pdl_wait`:
    ``{"PDL": True, "launch_pdl": True}`` when ``enabled`` and :func:`supported` for ``t``'s device, else
    ``{"PDL": False}``."""
    if enabled and t.is_cuda and not torch.version.hip and _capable(t.device.index or 0):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """With ``PDL``: wait until the previous kernel has completed (its writes visible), then allow the next
    kernel to launch. Everything before this call may read only weights and data written two or more
    launches back, and may write nothing."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()

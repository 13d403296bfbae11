"""Grid-wide "last program to arrive" for Triton kernels whose final step needs every program's result.

The pattern of CUDA's ``threadFenceReduction`` sample: each program stores its
partial result, fences (its writes become visible GPU-wide), and increments a
global arrival counter; the program that sees ``num_programs - 1`` fences again
(so it reads everyone's partials) and finishes the job, then resets the counter
to 0 so the next launch (a CUDA-graph replay) starts clean. Used by the fused
router launch (:mod:`replicas.kernels.triton_router`) and the greedy step
epilogue (:mod:`replicas.kernels.triton_greedy`). One launch at a time per
counter.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gpu_fence(FENCE: tl.constexpr):
    """With ``FENCE``: this thread's earlier memory operations are ordered GPU-wide before its later ones
    (PTX ``fence.acq_rel.gpu``). Off on the CPU interpreter, which runs programs one after another."""
    if FENCE:
        tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def arrive(counter_ptr, FENCE: tl.constexpr):
    """Publish this program's stores and count its arrival; True in the last program to arrive (which must
    then call :func:`gpu_fence` before reading the others' stores, and reset ``*counter_ptr`` to 0)."""
    gpu_fence(FENCE)  # every thread's stores are visible GPU-wide before the arrival below
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    return arrived == tl.num_programs(0) - 1

"""Kernels written in CUDA C++, compiled at run time with NVRTC and launched through the driver API.

For what Triton does not let a kernel say: the MoE kernel of
:mod:`replicas.kernels.moe.hopper_bulk` stages its weights in shared memory with
Hopper's bulk copies (``cp.async.bulk`` completing on an ``mbarrier``), which
needs a dynamic shared-memory size that the kernel chooses itself.

Compilation uses torch's NVRTC binding (``torch.cuda._utils._nvrtc_compile``,
torch >= 2.8: the CUDA runtime compiler that ships with torch's CUDA wheels),
so nothing beyond torch is needed. Launches go through ``cuLaunchKernelEx`` on
the current torch stream, so they are captured into CUDA graphs like any other
kernel, optionally with programmatic dependent launch
(:mod:`replicas.kernels.pdl`: the same attribute that Triton's ``launch_pdl``
sets).
"""

from __future__ import annotations

import ctypes
import functools

import torch

CUDA_PRELUDE = r"""
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;

struct alignas(16) U4 { u32 x, y, z, w; };

__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

__device__ __forceinline__ void bars_init(u32 base, int n) {  // n barriers (arrival count 1), 8 bytes apart
  for (int i = 0; i < n; ++i) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(base + 8 * i) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ float bf16_to_f32(u16 v) { return __uint_as_float(((u32)v) << 16); }

__device__ __forceinline__ u16 f32_to_bf16(float f) {  // round to nearest even (finite inputs)
  u32 u = __float_as_uint(f);
  return (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ void pdl_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

__device__ __forceinline__ void bar_expect(u32 bar, u32 bytes) {
  asm volatile("{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1; }"
               :: "r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void bar_wait(u32 bar, u32 parity) {
  u32 done = 0;
  while (!done) {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  }
}
"""
"""Types and device helpers shared by the CUDA source kernels: shared-memory addresses, bf16 conversions,
PDL's wait, 1-D bulk
copies (``cp.async.bulk`` global → shared, completing on an ``mbarrier``'s transaction count) and the
barrier's expect / wait (PTX ISA 8.x, "Data Movement and Conversion: cp.async.bulk", "mbarrier")."""

_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # cuda.h CUfunction_attribute
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # cuda.h CUlaunchAttributeID


class _LaunchAttribute(ctypes.Structure):
    """cuda.h ``CUlaunchAttribute``: an id, padding to 8 bytes, a 64-byte value union."""
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class _LaunchConfig(ctypes.Structure):
    """cuda.h ``CUlaunchConfig``."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


@functools.cache
def _libcuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return lib


def _check(result: int, what: str) -> None:
    if result != 0:
        msg = ctypes.c_char_p()
        _libcuda().cuGetErrorString(result, ctypes.byref(msg))
        raise RuntimeError(f"{what} failed: CUDA error {result} ({(msg.value or b'?').decode()})")


class CudaKernel:
    """One ``extern "C" __global__`` function compiled from ``source`` for the current device.

    Args:
        source: CUDA C++ (no headers are included: NVRTC's built-ins only).
        name: the kernel's name.
        shared_bytes: its dynamic shared memory per block (bytes); above 48 KiB the function is opted in.
        options: extra NVRTC options.

    Raises:
        RuntimeError: torch has no NVRTC binding, compilation failed (the log is in the message), or the
            driver refused the module.
    """

    def __init__(self, source: str, name: str, shared_bytes: int, options: tuple[str, ...] = ()):
        try:
            from torch.cuda._utils import _nvrtc_compile
        except ImportError as exc:  # pragma: no cover - depends on the torch build
            raise RuntimeError("CUDA source kernels need torch's NVRTC binding (torch >= 2.8)") from exc
        binary, lowered = _nvrtc_compile(source, name, nvcc_options=["-std=c++17", *options])
        lib = _libcuda()
        self._module = ctypes.c_void_p()
        _check(lib.cuModuleLoadData(ctypes.byref(self._module), binary), "cuModuleLoadData")
        self._function = ctypes.c_void_p()
        _check(lib.cuModuleGetFunction(ctypes.byref(self._function), self._module, (lowered or name).encode()),
               "cuModuleGetFunction")
        if shared_bytes > 48 * 1024:
            _check(lib.cuFuncSetAttribute(self._function, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                          shared_bytes), "cuFuncSetAttribute")
        self.shared_bytes = shared_bytes
        self.name = name

    def __call__(self, grid: tuple[int, int, int], block: int, args: list, pdl: bool = False) -> None:
        """Launch on torch's current stream.

        Args:
            grid: blocks in x, y, z. block: threads per block (x only).
            args: the kernel's parameters in order, as ctypes values (``c_uint64`` for pointers, ``c_int``,
                ``c_int64``, ``c_float``) or tensors (passed as their data pointers).
            pdl: launch with programmatic stream serialization (the kernel must follow
                :mod:`replicas.kernels.pdl`'s rule: ``griddepcontrol.wait`` before reading what the previous
                launch wrote).
        """
        values = [ctypes.c_uint64(a.data_ptr()) if isinstance(a, torch.Tensor) else a for a in args]
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        attr = _LaunchAttribute()
        attr.id = _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value[0] = 1
        config = _LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(block, 1, 1), self.shared_bytes,
                               ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
                               ctypes.pointer(attr) if pdl else None, 1 if pdl else 0)
        _check(_libcuda().cuLaunchKernelEx(ctypes.byref(config), self._function, ctypes.cast(params, ctypes.c_void_p), None),
               f"launch of {self.name}")

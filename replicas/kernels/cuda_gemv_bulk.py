"""Batch-one bf16 GEMV whose weight rows arrive in shared memory by bulk copy (CUDA C++, Hopper).

Why: a batch-one GEMV only streams its weights, and the Triton GEMV
(:mod:`replicas.kernels.triton_gemv`) keeps one 16-byte step per thread in
flight: at gpt-oss-120b's attention projections it moves 2.9-3.1 TB/s alone
and less inside the decode step (``docs/benchmarks.md``). Here persistent
blocks (a few per SM) each take every so-many tile of ``R`` rows, and one thread
keeps ``S`` tiles' ``cp.async.bulk`` copies in flight (one per row, completing on
the tile's ``mbarrier``). The first ``S`` tiles are requested *before* the
block waits on the previous launch (programmatic dependent launch: weights do
not depend on it), so a projection's weights start streaming while the kernel
before it finishes. Each warp takes one row of a tile: lane ``l`` multiplies
16-byte chunks ``l, l + 32, ...`` by the same chunks of ``x``, which it keeps in
registers for the whole launch; fp32 sums, one warp reduction, bias, rounded
once to bf16.

Reference: ``torch.nn.functional.linear`` (same math; fp32 summation order
differs). NVIDIA sm_90+; compiled at first use by
:class:`~replicas.kernels.cuda_source.CudaKernel`; ``tests/gpu`` checks it.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from replicas.kernels.cuda_source import CUDA_PRELUDE, CudaKernel
from replicas.kernels.pdl import pdl_args

TILE_OVERRIDES: dict[str, int] = {}
"""Tiles that win over :func:`cuda_gemv_bulk`'s arguments (``ops.bench_engine --variants "gemv=rows:8"``)."""

_SOURCE = r"""
#define NT (32 * R)
#define CHUNKS (K / 8)
#define KC ((CHUNKS + 31) / 32)
#define ROW_BYTES (K * 2)
#define STAGE_BYTES (R * ROW_BYTES)
#define SMEM_STAGES 128

__device__ __forceinline__ float dot8(const U4& w, const U4& x, float acc) {
  const u32 wv[4] = {w.x, w.y, w.z, w.w}, xv[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc = fmaf(__uint_as_float(wv[i] << 16), __uint_as_float(xv[i] << 16), acc);
    acc = fmaf(__uint_as_float(wv[i] & 0xffff0000u), __uint_as_float(xv[i] & 0xffff0000u), acc);
  }
  return acc;
}

// Tile t: rows [t * R, t * R + R), one bulk copy per row into stage `stage`.
__device__ __forceinline__ void issue_tile(u32 base, int stage, int t, const u8* w, i64 stride_w_bytes) {
  const u32 bar = base + 8 * stage, dst = base + SMEM_STAGES + stage * STAGE_BYTES;
  bar_expect(bar, STAGE_BYTES);
#pragma unroll
  for (int r = 0; r < R; ++r) bulk_load(dst + r * ROW_BYTES, w + (i64)(t * R + r) * stride_w_bytes, ROW_BYTES, bar);
}

// y[n] = sum_k W[n, k] x[k] (+ bias[n]) for N = n_tiles * R rows; persistent blocks take tiles
// blockIdx.x, blockIdx.x + gridDim.x, ...; warp r of a block computes row r of each tile.
extern "C" __global__ void __launch_bounds__(NT) gemv_bulk(
    const u16* __restrict__ x, const u8* __restrict__ w, const u16* __restrict__ bias, u16* __restrict__ y,
    i64 stride_w_bytes, int n_tiles) {
  extern __shared__ __align__(128) u8 smem[];
  const int tid = threadIdx.x, lane = tid & 31, row = tid >> 5;
  const u32 base = smem_u32(smem);
  if (tid == 0) bars_init(base, S);
  __syncthreads();
  if (tid == 0) {
    for (int i = 0; i < S; ++i) {
      const int t = blockIdx.x + i * gridDim.x;
      if (t < n_tiles) issue_tile(base, i, t, w, stride_w_bytes);
    }
  }
  pdl_wait();  // x comes from the launch just before
  U4 xr[KC];
#pragma unroll
  for (int i = 0; i < KC; ++i) {
    const int c = lane + 32 * i;
    xr[i] = c < CHUNKS ? reinterpret_cast<const U4*>(x)[c] : U4{0u, 0u, 0u, 0u};
  }
  int it = 0;
  for (int t = blockIdx.x; t < n_tiles; t += gridDim.x, ++it) {
    const int stage = it % S;
    const int n = t * R + row;
    const float b = HAS_BIAS ? bf16_to_f32(bias[n]) : 0.f;  // loaded now, used after the sums
    bar_wait(base + 8 * stage, (it / S) & 1);
    const U4* wr = reinterpret_cast<const U4*>(smem + SMEM_STAGES + stage * STAGE_BYTES + row * ROW_BYTES);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int i = 0; i < KC; ++i) {
      const int c = lane + 32 * i;
      if (c < CHUNKS) acc[i % 4] = dot8(wr[c], xr[i], acc[i % 4]);
    }
    float s = (acc[0] + acc[1]) + (acc[2] + acc[3]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    __syncthreads();  // every warp is done with this stage
    if (tid == 0 && t + S * (int)gridDim.x < n_tiles) issue_tile(base, stage, t + S * gridDim.x, w, stride_w_bytes);
    if (lane == 0) y[n] = f32_to_bf16(s + b);
  }
}
"""


def kernel_source(k: int, rows: int, stages: int, has_bias: bool) -> str:
    """The CUDA C++ of one configuration: ``k`` inputs, ``rows`` per tile (one warp each), ``stages`` tiles in
    flight per block, with or without bias."""
    head = "".join(f"#define {n} {v}\n" for n, v in {"K": k, "R": rows, "S": stages, "HAS_BIAS": int(has_bias)}.items())
    return head + CUDA_PRELUDE + _SOURCE


def shared_bytes(k: int, rows: int, stages: int) -> int:
    """Dynamic shared memory of one block (bytes): barriers, then ``stages`` tiles of ``rows`` bf16 rows."""
    return 128 + stages * rows * k * 2


@functools.cache
def _kernel(k: int, rows: int, stages: int, has_bias: bool) -> CudaKernel:
    return CudaKernel(kernel_source(k, rows, stages, has_bias), "gemv_bulk", shared_bytes(k, rows, stages))


@functools.cache
def _device_limits(device: torch.device) -> tuple[int, int, int]:
    """(SMs, shared memory per SM, per block opt-in), bytes."""
    p = torch.cuda.get_device_properties(device)
    return p.multi_processor_count, p.shared_memory_per_multiprocessor, p.shared_memory_per_block_optin


def supports(x: torch.Tensor, weight: torch.Tensor, rows: int = 4) -> bool:
    """Whether :func:`cuda_gemv_bulk` takes these operands: one bf16 row on an NVIDIA GPU of compute
    capability 9.0+, a bf16 weight ``[N, K]`` with unit stride along K, ``K`` a multiple of 8 (16-byte rows),
    16-byte aligned rows, ``N`` a multiple of the tile's rows, and K at most 8192 (``x`` stays in registers)."""
    n, k = weight.shape
    return (x.is_cuda and not torch.version.hip and x.dim() == 2 and x.shape == (1, k)
            and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and weight.stride(1) == 1
            and k % 8 == 0 and k <= 8192 and (weight.stride(0) * 2) % 16 == 0 and weight.data_ptr() % 16 == 0
            and n % (TILE_OVERRIDES.get("rows", rows)) == 0
            and torch.cuda.get_device_capability(x.device)[0] >= 9)


def cuda_gemv_bulk(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, rows: int = 4,
                   stages: int = 4, blocks_per_sm: int = 2) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for one bf16 row: ``x`` ``[1, K]``, ``weight`` ``[N, K]``, ``bias``
    ``[N]`` bf16 or None → ``[1, N]`` bf16, summed in fp32 and rounded once.

    Args:
        rows: rows per tile (one warp each; must divide N). stages: tiles in flight per block (fewer when
            they do not fit ``blocks_per_sm`` blocks per SM in shared memory). blocks_per_sm: persistent
            blocks per SM. Defaults: the fastest of ``python -m ops.bench_kernels --kernels dense`` on an
            H200 at gpt-oss-120b's attention projections.

    Raises:
        ValueError: operands :func:`supports` does not take, or a bias of another shape or dtype.
    """
    tiles = {"rows": rows, "stages": stages, "blocks_per_sm": blocks_per_sm} | TILE_OVERRIDES
    rows, stages, blocks_per_sm = tiles["rows"], tiles["stages"], tiles["blocks_per_sm"]
    if not supports(x, weight, rows):
        raise ValueError(f"cuda_gemv_bulk: unsupported operands x {tuple(x.shape)} {x.dtype}, weight "
                         f"{tuple(weight.shape)} {weight.dtype} stride {weight.stride()} ({rows} rows per tile)")
    n, k = weight.shape
    if bias is not None and (bias.shape != (n,) or bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
        raise ValueError(f"cuda_gemv_bulk: bias must be contiguous bf16 [{n}], got {bias.dtype} {tuple(bias.shape)}")
    sms, per_sm, per_block = _device_limits(x.device)
    fit = (min(per_sm // blocks_per_sm - 1024, per_block) - 128) // (rows * k * 2)
    stages = max(1, min(stages, fit))
    n_tiles = n // rows
    y = torch.empty(1, n, dtype=torch.bfloat16, device=x.device)
    _kernel(k, rows, stages, bias is not None)(
        (min(n_tiles, blocks_per_sm * sms), 1, 1), 32 * rows,
        [x.contiguous(), weight, bias if bias is not None else weight, y, ctypes.c_int64(weight.stride(0) * 2),
         ctypes.c_int(n_tiles)],
        pdl="launch_pdl" in pdl_args(x))
    return y

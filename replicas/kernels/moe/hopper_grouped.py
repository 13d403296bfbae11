"""MXFP4 MoE for calls of many tokens: each expert tile is read and decoded once for all its tokens, with each
token's arithmetic exactly that of :mod:`replicas.kernels.moe.hopper_bulk`'s folded family (CUDA C++, Hopper).

:mod:`.hopper_bulk` computes every (token, expert) pair alone: a block bulk-copies one tile of the pair's
expert into shared memory, decodes its E2M1 codes and multiplies them with the token's activations on the
tensor cores. Its tile shape, warps and the order of the K steps come from the config, never from the pair
count, so a pair's result does not depend on the other pairs of the launch. But an expert routed to by
eight tokens is read and decoded eight times.

Here a block takes one tile of one *expert*: it bulk-copies the tile once, and each warp decodes each of
its K steps once, multiplies the decoded pairs by their rows' block scales (the folded family,
:data:`~.hopper_bulk.STEP_ARITHMETIC`: exact), and runs the step's MMAs once per 8 of the expert's tokens,
token ``8 j + n`` in MMA column ``n``; a lane feeds its column's token, reading that token's activations
from global memory (mostly L2). Each token's sums are the same MMA chains, the same cross-warp sum and the
same epilogue as the folded one-pair kernel's with its token in column 0 (the step code and
:data:`~.hopper_bulk.ROW_ARITHMETIC` are the same code in both, and an MMA column's sums depend only on its
own token), so every row is the one-pair kernel's, bit for bit, whatever the number of tokens, their
company and their order, as long as both launches use the same warps per block (the warps split the K steps
and their partial sums are added in warp order); rows per tile and tokens per pass may differ. This makes
the two one row-exact family for decode (``docs/exactness.md``); ``tests/gpu`` checks the bits.

Every block finds the experts' tokens itself: it counts the pairs per expert in shared memory, scans the
counts (one warp) into the list of experts with tokens and places each pair's index in its expert's
segment. Tiles are numbered over the experts with tokens only, expert by expert, so a launch reads each
routed expert once and no other; each persistent block takes a contiguous range of them.
``docs/decisions/0030-folded-decode-moe.md`` has the measurements, and the variants that lost (the
block-scaled grouped kernel of decision 0029, activation rows staged in shared memory, two tiles in flight).

Inputs, outputs and numerics: :func:`~replicas.kernels.moe.hopper_bulk.cuda_moe_bulk`'s. NVIDIA sm_90+ only.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from replicas.kernels.cuda_source import CUDA_PRELUDE, CudaKernel
from replicas.kernels.moe.hopper_bulk import (
    ROW_ARITHMETIC,
    STEP_ARITHMETIC,
    _device_limits,
    check_tiles_and_buffers,
    grid_size,
    launch_operands,
    step_defines,
)
from replicas.kernels.moe.mma_format import X_SHIFT
from replicas.kernels.moe.mxfp4 import BLOCK_SIZE, check_packed_moe
from replicas.kernels.pdl import pdl_args

MAX_PAIRS = 1024
"""Most (token, expert) pairs per call: 256 tokens of 4 experts (pair indices are kept as 16-bit)."""

MAX_EXPERTS = 256
"""Most experts per layer (the per-expert counts live in shared memory)."""

_SOURCE = r"""
#define NT (32 * W)
#define ROWS (16 * P)
#define NS ((G + 3) / 4)
#define FULL 0xffffffffu

// This lane's 32 activations (16 bf16 pairs): block g of an x row, or the zero block.
__device__ __forceinline__ void load_x(u32 (&x)[16], const u8* p) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const U4 v = reinterpret_cast<const U4*>(p)[i];
    x[4 * i] = v.x; x[4 * i + 1] = v.y; x[4 * i + 2] = v.z; x[4 * i + 3] = v.w;
  }
}

#define X_ROW(pair) (xa + (i64)(GATE_UP ? (pair) / top_k : (pair)) * stride_x_bytes)

// Persistent blocks over the tiles of the experts that have pairs, numbered expert by expert: block b takes
// the contiguous range [b n / grid, (b + 1) n / grid), so it meets few experts. Each tile is bulk-copied into
// shared memory; each warp decodes its K steps once and multiplies them by an expert's tokens 8 at a time
// (token 8 j8 + r8 in MMA column r8, its activations read from global memory, mostly L2).
// GATE_UP: rows interleave gate (2j) and up (2j + 1); writes h[pair, mma_position(j)] = swiglu(...) * 2**64
// (bf16). Else (down): writes out[pair, r] = w_pair * (y + bias). Every token's arithmetic is hopper_bulk's
// folded one-pair kernel's.
extern "C" __global__ void __launch_bounds__(NT) KERNEL_NAME(
    const u8* __restrict__ xa, const i64* __restrict__ ids, const void* __restrict__ route_w,
    const u8* __restrict__ blocks, const u8* __restrict__ scales, const u16* __restrict__ bias,
    void* __restrict__ out, i64 stride_be, i64 stride_se, i64 stride_bias, i64 stride_x_bytes,
    i64 stride_out, int nrows_total, int n_experts, int top_k, int n_pairs, float alpha, float limit) {
  extern __shared__ __align__(128) u8 smem[];
  const int tid = threadIdx.x, lane = tid & 31, kw = tid >> 5, q = lane & 3, r8 = lane >> 2;
  const int tiles_per_expert = nrows_total / ROWS;
  const u32 base = smem_u32(smem), bar = base;
  int* s_meta = reinterpret_cast<int*>(smem + SMEM_META);     // [0]: experts with pairs
  int* s_cnt = reinterpret_cast<int*>(smem + SMEM_CNT);       // [MAX_EXPERTS] pairs per expert
  int* s_end = reinterpret_cast<int*>(smem + SMEM_END);       // [MAX_EXPERTS] segment starts, then ends
  u16* s_act = reinterpret_cast<u16*>(smem + SMEM_ACT);       // [MAX_EXPERTS] the experts with pairs, ascending
  u16* s_list = reinterpret_cast<u16*>(smem + SMEM_LIST);     // [MAX_PAIRS] pair indices by expert segment
  const u8* st = smem + SMEM_STAGE;                           // the tile: scales, then packed rows
  float* red = reinterpret_cast<float*>(smem + SMEM_R);       // [2][NJ][W][ROWS] per-warp row sums
  if (tid == 0) bars_init(base, 1);
  if (tid < 16) reinterpret_cast<u32*>(smem + SMEM_ZERO)[tid] = 0u;  // a block of zero activations
  for (int i = tid; i < n_experts; i += NT) s_cnt[i] = 0;
#if GATE_UP
  pdl_wait();  // the expert ids come from the launch just before
#endif
  __syncthreads();
  for (int i = tid; i < n_pairs; i += NT) atomicAdd(&s_cnt[(int)ids[i]], 1);
  __syncthreads();
  if (kw == 0) {  // exclusive scan of the counts (segment starts) and the experts with pairs
    int run = 0, n_act = 0;
    for (int e0 = 0; e0 < n_experts; e0 += 32) {
      const int e = e0 + lane, c = e < n_experts ? s_cnt[e] : 0;
      int v = c;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int n = __shfl_up_sync(FULL, v, o);
        if (lane >= o) v += n;
      }
      if (e < n_experts) s_end[e] = run + v - c;
      const u32 act = __ballot_sync(FULL, c > 0);
      if (c > 0) s_act[n_act + __popc(act & ((1u << lane) - 1u))] = (u16)e;
      run += __shfl_sync(FULL, v, 31);
      n_act += __popc(act);
    }
    if (lane == 0) s_meta[0] = n_act;
  }
  __syncthreads();
  // each pair into its expert's segment (the order inside a segment does not change any token's bits)
  for (int i = tid; i < n_pairs; i += NT) s_list[atomicAdd(&s_end[(int)ids[i]], 1)] = (u16)i;
  __syncthreads();
  const int n_tiles = s_meta[0] * tiles_per_expert;
  const int t_lo = (int)((i64)blockIdx.x * n_tiles / gridDim.x), t_hi = (int)((i64)(blockIdx.x + 1) * n_tiles / gridDim.x);
  // thread 0: tile t's scales and rows
#define ISSUE_W(t)                                                                                        \
  do {                                                                                                    \
    const int e_ = s_act[(t) / tiles_per_expert], r_ = ((t) % tiles_per_expert) * ROWS;                  \
    bar_expect(bar, ROWS * G * 17);                                                                       \
    bulk_load(base + SMEM_STAGE, scales + e_ * stride_se + (i64)r_ * G, ROWS * G, bar);                  \
    bulk_load(base + SMEM_STAGE + SCALE_BYTES, blocks + e_ * stride_be + (i64)r_ * ROW_BYTES, ROWS * ROW_BYTES, bar); \
  } while (0)
  if (tid == 0 && t_lo < t_hi) ISSUE_W(t_lo);
#if !GATE_UP
  pdl_wait();  // h comes from the launch just before; ids and weights from two launches back
#endif
  const u8* zero = smem + SMEM_ZERO;
  int chunk = 0;
  for (int t = t_lo, it = 0; t < t_hi; ++t, ++it) {
    const int e = s_act[t / tiles_per_expert], r0 = (t % tiles_per_expert) * ROWS;
    const int end = s_end[e], begin = end - s_cnt[e];
    const u16* bias_e = bias + (i64)e * stride_bias;
    bar_wait(bar, it & 1);  // the tile
    for (int c0 = begin; c0 < end; c0 += NJ, ++chunk) {
      const int nj = min(NJ, end - c0);
      float* red_c = red + (chunk & 1) * NJ * W * ROWS;
      // lane (r8, q) sums rows a, b of tokens 8 j8 + 2q and 8 j8 + 2q + 1: acc[j8][p][0..3] as mma_step's r
      float acc[NJ / 8][P][4];
#pragma unroll
      for (int j8 = 0; j8 < NJ / 8; ++j8)
#pragma unroll
        for (int p = 0; p < P; ++p)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[j8][p][i] = 0.f;
      for (int s = kw; s < NS; s += W) {
        const int g = 4 * s + q;
        const int gc = g < G ? g : G - 1;  // past the row's end: a valid block times zero activations
        u32 x[NJ / 8][16];
#pragma unroll
        for (int j8 = 0; j8 < NJ / 8; ++j8) {
          const int jj = 8 * j8 + r8;
          load_x(x[j8], g < G && jj < nj ? X_ROW(s_list[c0 + jj]) + g * 64 : zero);
        }
#pragma unroll
        for (int p = 0; p < P; ++p) {
          const int ra = 16 * p + r8, rb = ra + 8;
          u32 d[32];
          decode_step(d, *reinterpret_cast<const U4*>(st + SCALE_BYTES + ra * ROW_BYTES + gc * 16),
                      *reinterpret_cast<const U4*>(st + SCALE_BYTES + rb * ROW_BYTES + gc * 16));
          fold_scales(d, st[ra * G + gc], st[rb * G + gc]);
#pragma unroll
          for (int j8 = 0; j8 < NJ / 8; ++j8) {
            if (8 * j8 < nj) {
              float r[4];
              mma_step(r, d, x[j8]);
#pragma unroll
              for (int i = 0; i < 4; ++i) acc[j8][p][i] += r[i];
            }
          }
        }
      }
#pragma unroll
      for (int j8 = 0; j8 < NJ / 8; ++j8) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int j = 8 * j8 + 2 * q + h;
          if (j < nj) {
#pragma unroll
            for (int p = 0; p < P; ++p) {
              red_c[(j * W + kw) * ROWS + 16 * p + r8] = acc[j8][p][h];
              red_c[(j * W + kw) * ROWS + 16 * p + r8 + 8] = acc[j8][p][2 + h];
            }
          }
        }
      }
      // every warp is done with this chunk (after the last one, with the tile); red is double-buffered, so
      // the next chunk's sums may be written while this one's are being read
      __syncthreads();
      if (tid == 0 && c0 + NJ >= end && t + 1 < t_hi) ISSUE_W(t + 1);
#if GATE_UP
      for (int u = tid; u < nj * (ROWS / 2); u += NT) {
        const int j = u / (ROWS / 2), i = u % (ROWS / 2), pair = s_list[c0 + j];
        float gate = bf16_to_f32(bias_e[r0 + 2 * i]), up = bf16_to_f32(bias_e[r0 + 2 * i + 1]);
#pragma unroll
        for (int w = 0; w < W; ++w) {
          gate += red_c[(j * W + w) * ROWS + 2 * i];
          up += red_c[(j * W + w) * ROWS + 2 * i + 1];
        }
        reinterpret_cast<u16*>(out)[pair * stride_out + mma_position(r0 / 2 + i)] =
            f32_to_bf16(swiglu_h(gate, up, alpha, limit));
      }
#else
      for (int u = tid; u < nj * ROWS; u += NT) {
        const int j = u / ROWS, i = u % ROWS, pair = s_list[c0 + j];
        float y = bf16_to_f32(bias_e[r0 + i]);
#pragma unroll
        for (int w = 0; w < W; ++w) y += red_c[(j * W + w) * ROWS + i];
        const float rw = ROUTE_F32 ? reinterpret_cast<const float*>(route_w)[pair]
                                   : bf16_to_f32(reinterpret_cast<const u16*>(route_w)[pair]);
        reinterpret_cast<float*>(out)[pair * stride_out + r0 + i] = rw * y;
      }
#endif
    }
  }
}
"""


def shared_layout(g: int, warps: int, pairs: int, tokens_per_chunk: int) -> dict[str, int]:
    """Byte offsets of one block's dynamic shared memory (its ``#define`` values), in order: the tile's
    barrier at 0, the number of experts with pairs (``SMEM_META``), the per-expert counts (``SMEM_CNT``),
    segment ends (``SMEM_END``) and the experts with pairs (``SMEM_ACT``), the pair list (``SMEM_LIST``), one
    tile of ``16 * pairs`` rows of ``g`` blocks (``SMEM_STAGE``: scales, 128-byte aligned, then the packed
    rows at ``SCALE_BYTES``), the per-warp row sums of two chunks of ``tokens_per_chunk`` (``SMEM_R``), one
    block of zero activations (``SMEM_ZERO``); ``SMEM_BYTES`` in all."""
    rows = 16 * pairs
    row_bytes = g * 16
    scale_bytes = -(-rows * g // 128) * 128
    smem_cnt = 144
    smem_end = smem_cnt + 4 * MAX_EXPERTS
    smem_act = smem_end + 4 * MAX_EXPERTS
    smem_list = smem_act + 2 * MAX_EXPERTS
    smem_stage = -(-(smem_list + 2 * MAX_PAIRS) // 128) * 128
    smem_r = smem_stage + -(-(scale_bytes + rows * row_bytes) // 128) * 128
    smem_zero = smem_r + 2 * tokens_per_chunk * warps * rows * 4
    return {"ROW_BYTES": row_bytes, "SCALE_BYTES": scale_bytes, "SMEM_META": 128, "SMEM_CNT": smem_cnt,
            "SMEM_END": smem_end, "SMEM_ACT": smem_act, "SMEM_LIST": smem_list, "SMEM_STAGE": smem_stage,
            "SMEM_R": smem_r, "SMEM_ZERO": smem_zero, "SMEM_BYTES": smem_zero + 64}


def kernel_source(g: int, warps: int, pairs: int, tokens_per_chunk: int, gate_up: bool, route_f32: bool,
                  repacked: bool = False) -> str:
    """The CUDA C++ of one launch: ``g`` blocks of 32 values per row, ``warps`` per block, ``16 * pairs``
    rows per tile, ``tokens_per_chunk`` tokens (a multiple of 8) per pass over a tile, the gate_up or the
    down launch, fp32 (else bf16) routing weights, packed words in the checkpoint's or the decode layout
    (``repacked``)."""
    defines = {"G": g, "W": warps, "P": pairs, "NJ": tokens_per_chunk, "GATE_UP": int(gate_up),
               "ROUTE_F32": int(route_f32), "KERNEL_NAME": _name(gate_up),
               "X_SHIFT": X_SHIFT.value, "X_SCALE": f"{float(2 ** X_SHIFT.value)!r}f"}
    defines |= shared_layout(g, warps, pairs, tokens_per_chunk)
    head = "".join(f"#define {k} {v}\n" for k, v in defines.items())
    return head + step_defines(repacked) + CUDA_PRELUDE + ROW_ARITHMETIC + STEP_ARITHMETIC + _SOURCE


def _name(gate_up: bool) -> str:
    """The launches' names (what profilers show): ``moe_grouped_gate_up``, ``moe_grouped_down_proj``."""
    return "moe_grouped_gate_up" if gate_up else "moe_grouped_down_proj"


@functools.cache
def _kernel(g: int, warps: int, pairs: int, tokens_per_chunk: int, gate_up: bool, route_f32: bool,
            repacked: bool) -> CudaKernel:
    return CudaKernel(kernel_source(g, warps, pairs, tokens_per_chunk, gate_up, route_f32, repacked),
                      _name(gate_up), shared_layout(g, warps, pairs, tokens_per_chunk)["SMEM_BYTES"])


def cuda_moe_grouped(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    gate_up_blocks: torch.Tensor, gate_up_scales: torch.Tensor, gate_up_bias: torch.Tensor,
    down_blocks: torch.Tensor, down_scales: torch.Tensor, down_bias: torch.Tensor,
    alpha: float, limit: float, x_mxfp4: torch.Tensor | None = None, num_warps: int = 4,
    down_num_warps: int = 4, pairs: int = 1, down_pairs: int = 1, blocks_per_sm: int = 8,
    tokens_per_chunk: int = 8, repacked: bool = False, pdl: bool = True,
) -> torch.Tensor:
    """Per routed expert, its weighted output: ``[T, K, hidden]`` fp32 (two launches), each (token, expert)
    pair's row bitwise equal to :func:`~replicas.kernels.moe.hopper_bulk.cuda_moe_bulk`'s with
    ``fold_scales`` and the same ``num_warps`` and ``down_num_warps``.

    Args:
        x, weights, ids, the packed experts, alpha, limit, x_mxfp4, num_warps, down_num_warps, pairs,
            down_pairs, blocks_per_sm, repacked, pdl: as
            :func:`~replicas.kernels.moe.hopper_bulk.cuda_moe_bulk` (``pairs``: 16-row pairs per tile).
        tokens_per_chunk: tokens of one expert multiplied per pass over its tile, a multiple of 8 (a block
            makes ``ceil(tokens / tokens_per_chunk)`` passes); changes speed, never bits.
        The tile defaults are the best that ``python -m benchmarks.decode_moe`` found on an H100 at
        gpt-oss-120b's shape for 1 to 256 tokens (``docs/decisions/0030-folded-decode-moe.md``).

    Each block takes a contiguous range of the tiles (numbered expert by expert), so ``blocks_per_sm`` and
    the grid follow :func:`~.hopper_bulk.grid_size` over the most tiles the launch can have.

    Returns:
        ``[T, K, hidden]`` fp32; ``x + out.sum(1)`` (in order) is the MoE layer with its residual.

    Raises:
        ValueError: as :func:`~replicas.kernels.moe.hopper_bulk.cuda_moe_bulk`, more than :data:`MAX_PAIRS`
            pairs or :data:`MAX_EXPERTS` experts, or ``tokens_per_chunk`` not a positive multiple of 8.
    """
    t, hidden, k, inter = check_packed_moe(x, ids, gate_up_blocks, down_blocks)
    n_experts = gate_up_blocks.shape[0]
    check_tiles_and_buffers(hidden, inter, pairs, down_pairs, gate_up_scales, down_scales, gate_up_bias, down_bias)
    if t * k > MAX_PAIRS or n_experts > MAX_EXPERTS:
        raise ValueError(f"{t} tokens x {k} experts of {n_experts}: at most {MAX_PAIRS} (token, expert) pairs "
                         f"and {MAX_EXPERTS} experts per call")
    if tokens_per_chunk < 8 or tokens_per_chunk % 8:
        raise ValueError(f"tokens_per_chunk must be a positive multiple of 8, got {tokens_per_chunk}")
    sms, limit_bytes, smem_per_sm = _device_limits(x.device)
    layouts = {}
    for gate_up, g, w, p in ((True, hidden // BLOCK_SIZE, num_warps, pairs),
                             (False, inter // BLOCK_SIZE, down_num_warps, down_pairs)):
        layouts[gate_up] = shared_layout(g, w, p, tokens_per_chunk)["SMEM_BYTES"]
        if layouts[gate_up] > limit_bytes:
            raise ValueError(f"a tile of {16 * p} rows x {g} blocks needs {layouts[gate_up]} bytes of shared "
                             f"memory; a block may have {limit_bytes}")
    x_mxfp4, weights, ids = launch_operands(x, weights, ids, x_mxfp4)
    launch_pdl = "launch_pdl" in pdl_args(x, pdl)
    n_pairs = t * k
    most_experts = min(n_experts, n_pairs)
    i64, i32, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_float
    h = torch.empty(n_pairs, inter, dtype=torch.bfloat16, device=x.device)
    tiles = most_experts * 2 * inter // (16 * pairs)
    _kernel(hidden // BLOCK_SIZE, num_warps, pairs, tokens_per_chunk, True, False, repacked)(
        (grid_size(tiles, sms, blocks_per_sm, layouts[True], smem_per_sm, 32 * num_warps), 1, 1), 32 * num_warps,
        [x_mxfp4, ids, weights, gate_up_blocks, gate_up_scales, gate_up_bias, h,
         i64(gate_up_blocks.stride(0)), i64(gate_up_scales.stride(0)), i64(gate_up_bias.stride(0)),
         i64(x_mxfp4.stride(0) * 2), i64(h.stride(0)), i32(2 * inter), i32(n_experts), i32(k), i32(n_pairs),
         f32(alpha), f32(limit)],
        pdl=launch_pdl)
    out = torch.empty(t, k, hidden, dtype=torch.float32, device=x.device)
    tiles = most_experts * hidden // (16 * down_pairs)
    _kernel(inter // BLOCK_SIZE, down_num_warps, down_pairs, tokens_per_chunk, False,
            weights.dtype == torch.float32, repacked)(
        (grid_size(tiles, sms, blocks_per_sm, layouts[False], smem_per_sm, 32 * down_num_warps), 1, 1),
        32 * down_num_warps,
        [h, ids, weights, down_blocks, down_scales, down_bias, out,
         i64(down_blocks.stride(0)), i64(down_scales.stride(0)), i64(down_bias.stride(0)),
         i64(h.stride(0) * 2), i64(hidden), i32(hidden), i32(n_experts), i32(k), i32(n_pairs), f32(alpha),
         f32(limit)],
        pdl=launch_pdl)
    return out

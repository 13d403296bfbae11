"""MXFP4 MoE for decode steps of many tokens: each expert tile is read and decoded once for all its tokens,
with each token's arithmetic exactly that of :mod:`replicas.kernels.moe.hopper_bulk` (CUDA C++, Hopper).

:mod:`.hopper_bulk` computes every (token, expert) pair alone: a block bulk-copies one tile of the pair's
expert into shared memory, decodes its E2M1 codes and multiplies them with the token's activations on the
tensor cores. Its tile shape, warps and the order of the K steps come from the config, never from the pair
count, so a pair's result does not depend on the other pairs of the launch. But an expert routed to by
eight tokens is read and decoded eight times, which is why above a few tokens per expert it loses to the
grouped GEMMs.

Here a block takes one tile of one *expert*: it bulk-copies the tile once, and each warp decodes each of
its K steps once and multiplies the decoded step by the activations of every token routed to that expert
(``tokens_per_chunk`` at a time), with the same MMA sequence, the same two accumulator chains, the same
per-block scaling, the same lane-quad and cross-warp sums and the same epilogue as the one-pair kernel.
Each token's sums are therefore the one-pair kernel's, bit for bit, whatever the number of tokens, their
company and their order, as long as both launches use the same warps per block (the warps split the K steps
and their partial sums are added in warp order); the rows per tile may differ (rows never mix). This makes
the two kernels one row-exact family for decode (``docs/exactness.md``); ``tests/gpu`` checks the bits.

Every block finds the experts' tokens itself: it counts the pairs per expert in shared memory, scans the
counts (one warp) into the list of experts with tokens and places each pair's index in its expert's
segment. Tiles are numbered over the experts with tokens only, so a launch reads each routed expert once
and no other; blocks are persistent (``blocks_per_sm``, :func:`~.hopper_bulk.grid_size` over the most tiles
the launch can have) and keep ``stages`` tiles' copies in flight. Activations are read from global memory
(they stay in L2: at most 1,024 rows per launch) by the lanes that supply the MMA's B operand.

Inputs, outputs and numerics: :func:`~replicas.kernels.moe.hopper_bulk.cuda_moe_bulk`'s. NVIDIA sm_90+ only.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from replicas.kernels.cuda_source import CUDA_PRELUDE, CudaKernel
from replicas.kernels.moe.hopper_bulk import _c_string, _device_limits, grid_size
from replicas.kernels.moe.mma_format import X_SHIFT, decode_asm, mxfp4_activations
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

__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(FULL, v, 1);
  return v + __shfl_xor_sync(FULL, v, 2);
}

__device__ __forceinline__ float block_scale(u32 s) {  // 2**(s - 127) * 2**(126 - 64): E8M0 and encodings
  return __uint_as_float((s + (126 - X_SHIFT)) << 23);
}

// The A registers of one step's 8 MMAs (4 each) from this lane's 16-byte block of rows a and b.
__device__ __forceinline__ void decode_step(u32 (&d)[32], const U4& a, const U4& b) {
  const u32 wa[4] = {a.x, a.y, a.z, a.w}, wb[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    asm(DECODE_LO : "=r"(d[8 * w]), "=r"(d[8 * w + 1]), "=r"(d[8 * w + 2]), "=r"(d[8 * w + 3]) : "r"(wa[w]), "r"(wb[w]));
    asm(DECODE_HI : "=r"(d[8 * w + 4]), "=r"(d[8 * w + 5]), "=r"(d[8 * w + 6]), "=r"(d[8 * w + 7])
        : "r"(wa[w]), "r"(wb[w]));
  }
}

__device__ __forceinline__ void mma(float (&c)[4], const u32* a, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One step as mma_asm(chains=2): MMA i on chain i % 2 (both from zero), then the chains added.
// r[0], r[2]: column 2q of rows a and b; r[1], r[3]: column 2q + 1.
__device__ __forceinline__ void mma_step(float (&r)[4], const u32 (&d)[32], const u32 (&x)[16]) {
  float c[4] = {0.f, 0.f, 0.f, 0.f}, e[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int w = i / 2, p0 = 2 * (i % 2);
    if (i % 2 == 0) mma(c, &d[4 * i], x[4 * w + p0], x[4 * w + p0 + 1]);
    else mma(e, &d[4 * i], x[4 * w + p0], x[4 * w + p0 + 1]);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) r[i] = c[i] + e[i];
}

// This lane's 32 activations of block g of `row` (16 bf16 pairs) if it supplies the B operand, else zeros.
__device__ __forceinline__ void load_x(u32 (&x)[16], const u8* row, int g, bool supply) {
#pragma unroll
  for (int i = 0; i < 16; ++i) x[i] = 0u;
  if (supply) {
    const uint4* p = reinterpret_cast<const uint4*>(row + (i64)g * 64);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint4 v = __ldg(p + i);
      x[4 * i] = v.x; x[4 * i + 1] = v.y; x[4 * i + 2] = v.z; x[4 * i + 3] = v.w;
    }
  }
}

// Tile r0 of expert e (rows [r0, r0 + ROWS) of its packed matrix): scales, then the packed rows, into stage
// `stage`, completing on that stage's barrier.
__device__ __forceinline__ void issue_tile(u32 base, int stage, int e, int r0, const u8* blocks, const u8* scales,
                                           i64 stride_be, i64 stride_se) {
  const u32 bar = base + 8 * stage, dst = base + SMEM_STAGES + stage * STAGE_BYTES;
  bar_expect(bar, ROWS * G * 17);
  bulk_load(dst, scales + e * stride_se + (i64)r0 * G, ROWS * G, bar);
  bulk_load(dst + SCALE_BYTES, blocks + e * stride_be + (i64)r0 * ROW_BYTES, ROWS * ROW_BYTES, bar);
}

#define X_ROW(pair) (xa + (i64)(GATE_UP ? (pair) / top_k : (pair)) * stride_x_bytes)

// Persistent blocks over the tiles of the experts that have pairs: block b takes tiles b, b + gridDim.x, ...
// GATE_UP: rows interleave gate (2j) and up (2j + 1); writes h[pair, mma_position(j)] = swiglu(...) * 2**64
// (bf16). Else (down): writes out[pair, r] = w_pair * (y + bias). Every token's arithmetic is hopper_bulk's.
extern "C" __global__ void __launch_bounds__(NT) KERNEL_NAME(
    const u8* __restrict__ xa, const i64* __restrict__ ids, const void* __restrict__ route_w,
    const u8* __restrict__ blocks, const u8* __restrict__ scales, const u16* __restrict__ bias,
    void* __restrict__ out, i64 stride_be, i64 stride_se, i64 stride_bias, i64 stride_x_bytes,
    i64 stride_out, int nrows_total, int n_experts, int top_k, int n_pairs, float alpha, float limit) {
  extern __shared__ __align__(128) u8 smem[];
  const int tid = threadIdx.x, lane = tid & 31, kw = tid >> 5, q = lane & 3, r8 = lane >> 2;
  const int tiles_per_expert = nrows_total / ROWS;
  const u32 base = smem_u32(smem);
  int* s_meta = reinterpret_cast<int*>(smem + SMEM_META);     // [0]: experts with pairs
  int* s_cnt = reinterpret_cast<int*>(smem + SMEM_CNT);       // [MAX_EXPERTS] pairs per expert
  int* s_end = reinterpret_cast<int*>(smem + SMEM_END);       // [MAX_EXPERTS] segment starts, then ends
  u16* s_act = reinterpret_cast<u16*>(smem + SMEM_ACT);       // [MAX_EXPERTS] the experts with pairs, ascending
  u16* s_list = reinterpret_cast<u16*>(smem + SMEM_LIST);     // [MAX_PAIRS] pair indices by expert segment
  float* red = reinterpret_cast<float*>(smem + SMEM_R);       // [2][NJ][W][ROWS] per-warp row sums
  if (tid == 0) bars_init(base, S);
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
  if (tid == 0) {
    for (int i = 0; i < S; ++i) {
      const int t = blockIdx.x + i * gridDim.x;
      if (t < n_tiles) issue_tile(base, i, s_act[t / tiles_per_expert], (t % tiles_per_expert) * ROWS, blocks, scales,
                                  stride_be, stride_se);
    }
  }
#if !GATE_UP
  pdl_wait();  // h comes from the launch just before; ids and weights from two launches back
#endif
#if TWO
  const bool supply0 = r8 == 2 * q, supply1 = r8 == 2 * q + 1;  // columns 2q and 2q + 1: two tokens per MMA
#else
  const bool supply0 = r8 == 2 * q;  // this lane feeds the MMA's B operand (column 2q)
#endif
  int it = 0, chunk = 0;
  for (int t = blockIdx.x; t < n_tiles; t += gridDim.x, ++it) {
    const int stage = it % S;
    const int e = s_act[t / tiles_per_expert], r0 = (t % tiles_per_expert) * ROWS;
    const int end = s_end[e], begin = end - s_cnt[e];
    const u8* st = smem + SMEM_STAGES + stage * STAGE_BYTES;
    const u16* bias_e = bias + (i64)e * stride_bias;
    bar_wait(base + 8 * stage, (it / S) & 1);
    for (int c0 = begin; c0 < end; c0 += NJ, ++chunk) {
      const int nj = min(NJ, end - c0);
      float* red_c = red + (chunk & 1) * NJ * W * ROWS;
      float acc[NJ][2 * P];
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int i = 0; i < 2 * P; ++i) acc[j][i] = 0.f;
      for (int s = kw; s < NS; s += W) {
        const int g = 4 * s + q;
        const int gc = g < G ? g : G - 1;  // past the row's end: a valid block times zero activations
#pragma unroll
        for (int p = 0; p < P; ++p) {
          const int ra = 16 * p + r8, rb = ra + 8;
          u32 d[32];
          decode_step(d, *reinterpret_cast<const U4*>(st + SCALE_BYTES + ra * ROW_BYTES + gc * 16),
                      *reinterpret_cast<const U4*>(st + SCALE_BYTES + rb * ROW_BYTES + gc * 16));
          const float sa = block_scale(st[ra * G + gc]), sb = block_scale(st[rb * G + gc]);
#if TWO
#pragma unroll
          for (int j = 0; j < NJ; j += 2) {
            if (j < nj) {
              u32 x[16];
              const bool one = j + 1 < nj;
              load_x(x, X_ROW(s_list[c0 + (supply1 && one ? j + 1 : j)]), g,
                     g < G && (supply0 || (supply1 && one)));
              float r[4];
              mma_step(r, d, x);
              acc[j][2 * p] += r[0] * sa;
              acc[j][2 * p + 1] += r[2] * sb;
              if (j + 1 < NJ) {
                acc[j + 1][2 * p] += r[1] * sa;
                acc[j + 1][2 * p + 1] += r[3] * sb;
              }
            }
          }
#else
#pragma unroll
          for (int j = 0; j < NJ; ++j) {
            if (j < nj) {
              u32 x[16];
              load_x(x, X_ROW(s_list[c0 + j]), g, g < G && supply0);
              float r[4];
              mma_step(r, d, x);
              acc[j][2 * p] += r[0] * sa;
              acc[j][2 * p + 1] += r[2] * sb;
            }
          }
#endif
        }
      }
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        if (j < nj) {
#pragma unroll
          for (int p = 0; p < P; ++p) {
            const float ya = quad_sum(acc[j][2 * p]), yb = quad_sum(acc[j][2 * p + 1]);
            if (q == 0) {
              red_c[(j * W + kw) * ROWS + 16 * p + r8] = ya;
              red_c[(j * W + kw) * ROWS + 16 * p + r8 + 8] = yb;
            }
          }
        }
      }
      // every warp is done with this chunk (and, after the last chunk, with this stage); red is
      // double-buffered, so the next chunk's sums may be written while this one's are being read
      __syncthreads();
      if (tid == 0 && c0 + NJ >= end) {
        const int tn = t + S * gridDim.x;
        if (tn < n_tiles) issue_tile(base, stage, s_act[tn / tiles_per_expert], (tn % tiles_per_expert) * ROWS,
                                     blocks, scales, stride_be, stride_se);
      }
#if GATE_UP
      for (int u = tid; u < nj * (ROWS / 2); u += NT) {
        const int j = u / (ROWS / 2), i = u % (ROWS / 2), pair = s_list[c0 + j];
        const int jr = r0 / 2 + i;
        float gate = bf16_to_f32(bias_e[r0 + 2 * i]), up = bf16_to_f32(bias_e[r0 + 2 * i + 1]);
#pragma unroll
        for (int w = 0; w < W; ++w) {
          gate += red_c[(j * W + w) * ROWS + 2 * i];
          up += red_c[(j * W + w) * ROWS + 2 * i + 1];
        }
        gate = fminf(gate, limit);
        up = fminf(fmaxf(up, -limit), limit);
        const float h = (up + 1.f) * gate / (1.f + __expf(-gate * alpha)) * X_SCALE;
        const int pos = 8 * (jr / 8) + 2 * (jr % 4) + (jr % 8) / 4;  // the MMA activation format
        reinterpret_cast<u16*>(out)[pair * stride_out + pos] = f32_to_bf16(h);
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


def shared_layout(g: int, warps: int, pairs: int, stages: int, tokens_per_chunk: int) -> dict[str, int]:
    """Byte offsets of one block's dynamic shared memory (its ``#define`` values), in order: the stages'
    barriers from 0, the number of experts with pairs (``SMEM_META``), the per-expert counts (``SMEM_CNT``),
    segment ends (``SMEM_END``) and the experts with pairs (``SMEM_ACT``), the pair list (``SMEM_LIST``),
    ``stages`` tiles of ``16 * pairs`` rows of ``g`` blocks (``SMEM_STAGES``, ``STAGE_BYTES`` each: scales,
    128-byte aligned, then the packed rows at ``SCALE_BYTES``), the per-warp row sums of two chunks of
    ``tokens_per_chunk`` tokens (``SMEM_R``); ``SMEM_BYTES`` in all."""
    rows = 16 * pairs
    row_bytes = g * 16
    scale_bytes = -(-rows * g // 128) * 128
    stage_bytes = -(-(scale_bytes + rows * row_bytes) // 128) * 128
    smem_cnt = 144
    smem_end = smem_cnt + 4 * MAX_EXPERTS
    smem_act = smem_end + 4 * MAX_EXPERTS
    smem_list = smem_act + 2 * MAX_EXPERTS
    smem_stages = -(-(smem_list + 2 * MAX_PAIRS) // 128) * 128
    smem_r = smem_stages + stages * stage_bytes
    return {"ROW_BYTES": row_bytes, "SCALE_BYTES": scale_bytes, "STAGE_BYTES": stage_bytes, "SMEM_META": 128,
            "SMEM_CNT": smem_cnt, "SMEM_END": smem_end, "SMEM_ACT": smem_act, "SMEM_LIST": smem_list,
            "SMEM_STAGES": smem_stages, "SMEM_R": smem_r,
            "SMEM_BYTES": smem_r + 2 * tokens_per_chunk * warps * rows * 4}


def kernel_source(g: int, warps: int, pairs: int, stages: int, tokens_per_chunk: int, two: bool, gate_up: bool,
                  route_f32: bool, repacked: bool = False) -> str:
    """The CUDA C++ of one launch: ``g`` blocks of 32 values per row, ``warps`` per block, ``16 * pairs``
    rows per tile, ``stages`` tiles in flight per block, ``tokens_per_chunk`` tokens per pass over a tile
    (``two``: two tokens per MMA, in its columns ``2q`` and ``2q + 1``), the gate_up or the down launch, fp32
    (else bf16) routing weights, packed words in the checkpoint's or the decode layout (``repacked``)."""
    defines = {"G": g, "W": warps, "P": pairs, "S": stages, "NJ": tokens_per_chunk, "TWO": int(two),
               "GATE_UP": int(gate_up), "ROUTE_F32": int(route_f32), "KERNEL_NAME": _name(gate_up),
               "X_SHIFT": X_SHIFT.value, "X_SCALE": f"{float(2 ** X_SHIFT.value)!r}f"}
    defines |= shared_layout(g, warps, pairs, stages, tokens_per_chunk)
    head = "".join(f"#define {k} {v}\n" for k, v in defines.items())
    for name, high in (("DECODE_LO", False), ("DECODE_HI", True)):
        head += f"#define {name} " + _c_string(decode_asm(high, repacked)).replace("\n", " \\\n") + "\n"
    return head + CUDA_PRELUDE + _SOURCE


def _name(gate_up: bool) -> str:
    """The launches' names (what profilers show): ``moe_grouped_gate_up``, ``moe_grouped_down_proj``."""
    return "moe_grouped_gate_up" if gate_up else "moe_grouped_down_proj"


@functools.cache
def _kernel(g: int, warps: int, pairs: int, stages: int, tokens_per_chunk: int, two: bool, gate_up: bool,
            route_f32: bool, repacked: bool) -> CudaKernel:
    return CudaKernel(kernel_source(g, warps, pairs, stages, tokens_per_chunk, two, gate_up, route_f32, repacked),
                      _name(gate_up), shared_layout(g, warps, pairs, stages, tokens_per_chunk)["SMEM_BYTES"])


def cuda_moe_grouped(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    gate_up_blocks: torch.Tensor, gate_up_scales: torch.Tensor, gate_up_bias: torch.Tensor,
    down_blocks: torch.Tensor, down_scales: torch.Tensor, down_bias: torch.Tensor,
    alpha: float, limit: float, x_mxfp4: torch.Tensor | None = None, num_warps: int = 4,
    down_num_warps: int = 4, pairs: int = 1, down_pairs: int | None = None, stages: int = 1, blocks_per_sm: int = 8,
    tokens_per_chunk: int = 8, two_per_mma: bool = False, repacked: bool = False, pdl: bool = True,
) -> torch.Tensor:
    """Per routed expert, its weighted output: ``[T, K, hidden]`` fp32 (two launches), each (token, expert)
    pair's row bitwise equal to :func:`~replicas.kernels.moe.hopper_bulk.cuda_moe_bulk`'s for the same
    ``num_warps`` and ``down_num_warps``.

    Args:
        x, weights, ids, the packed experts, alpha, limit, x_mxfp4, num_warps, down_num_warps, pairs,
            down_pairs, stages, blocks_per_sm, repacked, pdl: as
            :func:`~replicas.kernels.moe.hopper_bulk.cuda_moe_bulk` (``pairs``: 16-row pairs per tile).
        tokens_per_chunk: tokens of one expert multiplied per pass over its tile (a block makes
            ``ceil(tokens / tokens_per_chunk)`` passes); changes speed, never bits.
        two_per_mma: put two tokens in one MMA (columns ``2q`` and ``2q + 1``; the other columns' values
            do not enter a column's sums); changes speed, never bits.

    Returns:
        ``[T, K, hidden]`` fp32; ``x + out.sum(1)`` (in order) is the MoE layer with its residual.

    Raises:
        ValueError: as :func:`~replicas.kernels.moe.hopper_bulk.cuda_moe_bulk`, more than :data:`MAX_PAIRS`
            pairs or :data:`MAX_EXPERTS` experts, or ``tokens_per_chunk`` not a positive (with
            ``two_per_mma``: even) number.
    """
    t, hidden, k, inter = check_packed_moe(x, ids, gate_up_blocks, down_blocks)
    n_experts = gate_up_blocks.shape[0]
    if down_pairs is None:
        down_pairs = 2 if hidden % 32 == 0 else 1
    for name, tensor in (("gate_up_scales", gate_up_scales), ("down_scales", down_scales),
                         ("gate_up_bias", gate_up_bias), ("down_bias", down_bias)):
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if gate_up_bias.dtype != torch.bfloat16 or down_bias.dtype != torch.bfloat16:
        raise ValueError(f"biases must be bf16, got {gate_up_bias.dtype} and {down_bias.dtype}")
    if (2 * inter) % (16 * pairs) or hidden % (16 * down_pairs):
        raise ValueError(f"16 * pairs must divide 2I ({2 * inter}) and 16 * down_pairs hidden ({hidden})")
    if t * k > MAX_PAIRS or n_experts > MAX_EXPERTS:
        raise ValueError(f"{t} tokens x {k} experts of {n_experts}: at most {MAX_PAIRS} (token, expert) pairs "
                         f"and {MAX_EXPERTS} experts per call")
    if tokens_per_chunk < 1 or (two_per_mma and tokens_per_chunk % 2):
        raise ValueError(f"tokens_per_chunk must be positive (even with two_per_mma), got {tokens_per_chunk}")
    sms, limit_bytes, smem_per_sm = _device_limits(x.device)
    layouts = {}
    for gate_up, g, w, p in ((True, hidden // BLOCK_SIZE, num_warps, pairs),
                             (False, inter // BLOCK_SIZE, down_num_warps, down_pairs)):
        layouts[gate_up] = shared_layout(g, w, p, stages, tokens_per_chunk)["SMEM_BYTES"]
        if layouts[gate_up] > limit_bytes:
            raise ValueError(f"{stages} stages of {16 * p} rows x {g} blocks need {layouts[gate_up]} bytes of "
                             f"shared memory; a block may have {limit_bytes}")
    if x_mxfp4 is None:
        x_mxfp4 = mxfp4_activations(x)
    if ids.dtype != torch.int64:
        ids = ids.to(torch.int64)
    if weights.dtype not in (torch.bfloat16, torch.float32):
        weights = weights.float()
    ids, weights = ids.contiguous(), weights.contiguous()
    launch_pdl = "launch_pdl" in pdl_args(x, pdl)
    n_pairs = t * k
    most_experts = min(n_experts, n_pairs)
    i64, i32, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_float
    h = torch.empty(n_pairs, inter, dtype=torch.bfloat16, device=x.device)
    tiles = most_experts * 2 * inter // (16 * pairs)
    _kernel(hidden // BLOCK_SIZE, num_warps, pairs, stages, tokens_per_chunk, two_per_mma, True, False, repacked)(
        (grid_size(tiles, sms, blocks_per_sm, layouts[True], smem_per_sm, 32 * num_warps), 1, 1), 32 * num_warps,
        [x_mxfp4, ids, weights, gate_up_blocks, gate_up_scales, gate_up_bias, h,
         i64(gate_up_blocks.stride(0)), i64(gate_up_scales.stride(0)), i64(gate_up_bias.stride(0)),
         i64(x_mxfp4.stride(0) * 2), i64(h.stride(0)), i32(2 * inter), i32(n_experts), i32(k), i32(n_pairs),
         f32(alpha), f32(limit)],
        pdl=launch_pdl)
    out = torch.empty(t, k, hidden, dtype=torch.float32, device=x.device)
    tiles = most_experts * hidden // (16 * down_pairs)
    _kernel(inter // BLOCK_SIZE, down_num_warps, down_pairs, stages, tokens_per_chunk, two_per_mma, False,
            weights.dtype == torch.float32, repacked)(
        (grid_size(tiles, sms, blocks_per_sm, layouts[False], smem_per_sm, 32 * down_num_warps), 1, 1),
        32 * down_num_warps,
        [h, ids, weights, down_blocks, down_scales, down_bias, out,
         i64(down_blocks.stride(0)), i64(down_scales.stride(0)), i64(down_bias.stride(0)),
         i64(h.stride(0) * 2), i64(hidden), i32(hidden), i32(n_experts), i32(k), i32(n_pairs), f32(alpha),
         f32(limit)],
        pdl=launch_pdl)
    return out

"""MXFP4 MoE GEMV for decode whose expert weights arrive in shared memory by bulk copy (CUDA C++, Hopper).

The math is :mod:`replicas.kernels.moe.triton_tc`'s (E2M1 decoded to bf16
pairs, ``mma.sync`` on the tensor cores); what differs is how the weights
arrive. A kernel that loads its weights into registers leaves ptxas free to
place each step's loads next to that step's MMAs, so a warp has one step of
loads in flight. Here each block asks for *all* of its weights at once: one
thread issues ``cp.async.bulk`` copies (the Hopper bulk-copy engine, no
registers held) of the block's rows, which are contiguous in the packed layout
``[E, rows, G, 16]``, and of their scales and the activation row, into shared
memory, completing on ``mbarrier`` transaction counts; then every lane runs
:mod:`~replicas.kernels.moe.triton_tc`'s MMA step (the same PTX,
:func:`~replicas.kernels.moe.mma_format.mma_asm`) on shared-memory operands.
Blocks are persistent: each takes every so-many tile of 16 rows (23 KB at
gpt-oss-120b's width) and keeps ``stages`` tiles' copies in flight. With the
loads out of the way the launches are bound by the E2M1 decoding (issue slots
and the integer pipe), which is what the repacked layout
(:mod:`~replicas.kernels.moe.decode_layout`) shortens; ``docs/decisions/0015-moe-decode-backends.md``
and ``0017-decode-layout-repack.md`` have the measurements.

Same inputs, outputs and numerics as :func:`~replicas.kernels.moe.triton_tc.triton_moe_tc`
(activations in its MMA format, times 2**64; fp32 sums; ``h`` rounded to bf16). With ``fold_scales`` the
same kernel runs the *folded* family instead (:data:`STEP_ARITHMETIC`: each block scale multiplied into the
decoded weights before the MMA, exactly), whose rows :mod:`.hopper_grouped` reproduces at any token count.
The down launch issues its weight copies before waiting on the gate_up launch
(programmatic dependent launch: expert ids come from two launches back), so its
weights stream in while gate_up finishes.

NVIDIA sm_90+ only (bulk copies, ``griddepcontrol``); compiled at first use by
:class:`~replicas.kernels.cuda_source.CudaKernel`. The CPU tests cannot run
it; ``tests/gpu`` checks it against the tensor-core Triton kernels and the fp32
reference.
"""

from __future__ import annotations

import ctypes
import functools
import warnings

import torch

from replicas.kernels.cuda_source import CUDA_PRELUDE, CudaKernel
from replicas.kernels.moe.mma_format import X_SHIFT, decode_asm, mma_asm, mxfp4_activations
from replicas.kernels.moe.mxfp4 import BLOCK_SIZE, BYTES_PER_BLOCK, check_packed_moe
from replicas.kernels.pdl import pdl_args

MAX_PAIRS = 128
"""Most (token, expert) pairs per call (the kernel keeps their ids and routing weights in shared memory)."""


def _c_string(text: str) -> str:
    return "\n".join('"' + line + '\\n"' for line in text.splitlines())


ROW_ARITHMETIC = r"""
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

__device__ __forceinline__ float block_scale(u32 s) {  // 2**(s - 127) * 2**(126 - 64): E8M0 and encodings
  return __uint_as_float((s + (126 - X_SHIFT)) << 23);
}

// GPT-OSS's clamped SwiGLU of a row's gate and up sums, times 2**64 (the MMA activation format's scale)
__device__ __forceinline__ float swiglu_h(float gate, float up, float alpha, float limit) {
  gate = fminf(gate, limit);
  up = fminf(fmaxf(up, -limit), limit);
  return (up + 1.f) * gate / (1.f + __expf(-gate * alpha)) * X_SCALE;
}

__device__ __forceinline__ int mma_position(int j) {  // where value j of a row sits in the MMA activation format
  return 8 * (j / 8) + 2 * (j % 4) + (j % 8) / 4;
}
"""
"""The per-row arithmetic that the one-pair kernel and :mod:`.hopper_grouped`'s grouped kernel share, so that
a row's sums and epilogue are the same code in both (the lane-quad sum, the E8M0 block scale, the SwiGLU
epilogue, the activation format's order)."""

STEP_ARITHMETIC = r"""
// The A registers of one step's 8 MMAs (4 each) from this lane's 16-byte block of rows a and b: MMA i's are
// d[4i..4i+3] = row a's pair, row b's pair, row a's next pair, row b's next pair (mma_asm's order).
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

// The folded family: each decoded code pair times its row's block factor 2**(s - 65) (one bf16x2 multiply,
// exact: see fold_factor), so that an MMA's 16 k-columns, which span the four blocks of the lane quad, sum
// scaled weights and each MMA column can carry its own token.
__device__ __forceinline__ u32 fold_factor(u32 s) {  // 2**(s - 65) as bf16, twice: normal for s <= 192
  const u32 h = (s + 62u) << 7;
  return h | (h << 16);
}

__device__ __forceinline__ u32 mul_bf16x2(u32 a, u32 b) {
  u32 r;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

__device__ __forceinline__ void fold_scales(u32 (&d)[32], u32 sa, u32 sb) {
  const u32 fa = fold_factor(sa), fb = fold_factor(sb);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    d[4 * i] = mul_bf16x2(d[4 * i], fa);
    d[4 * i + 1] = mul_bf16x2(d[4 * i + 1], fb);
    d[4 * i + 2] = mul_bf16x2(d[4 * i + 2], fa);
    d[4 * i + 3] = mul_bf16x2(d[4 * i + 3], fb);
  }
}
"""
"""The folded family's per-step arithmetic, which :mod:`.hopper_grouped`'s grouped kernel and the one-pair kernel
with ``FOLD`` share: decoding a step's A registers once (``DECODE_LO`` / ``DECODE_HI``:
:func:`~.mma_format.decode_asm`), the step's 8 MMAs on two chains (:func:`~.mma_format.mma_asm`'s order), and
the folded family's scaling of the decoded weights.

Folding is exact: a decoded code is its E2M1 value times ``2**-126`` (bf16, subnormal for 0.5), and times
``2**(s - 65)`` it is the value times ``2**(s - 191)``, a normal bf16 for every scale code ``s >= 66`` (the
grouped GEMMs' bound, :mod:`.grouped_gemm`); the activations carry ``2**64``, so each product is
``w * 2**(s - 127) * x`` exactly, and the sums need no block scale."""

_SOURCE = r"""
#define NT (32 * W)
#define ROWS (16 * P)
#define NS ((G + 3) / 4)

__device__ __forceinline__ void fused_step(float& ca, float& cb, const U4& a, const U4& b, const u32* x) {
  asm(MMA_ASM
      : "=f"(ca), "=f"(cb)
      : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b.x), "r"(b.y), "r"(b.z), "r"(b.w),
        "r"(x[0]), "r"(x[1]), "r"(x[2]), "r"(x[3]), "r"(x[4]), "r"(x[5]), "r"(x[6]), "r"(x[7]),
        "r"(x[8]), "r"(x[9]), "r"(x[10]), "r"(x[11]), "r"(x[12]), "r"(x[13]), "r"(x[14]), "r"(x[15]));
}

// Tile t: rows [r0, r0 + ROWS) of expert e's packed matrix [nrows_total, G, 16] (pair = t / tiles per pair).
// Its scales and packed bytes go to stage `stage`, completing on that stage's barrier, which also expects
// the activation row's bytes (copied here when `with_x`, else by issue_x once they may be read).
__device__ __forceinline__ void issue_tile(u32 base, int stage, int t, i64 e, const u8* blocks, const u8* scales,
                                           i64 stride_be, i64 stride_se, int tiles_per_pair, bool with_x,
                                           const u8* x_row) {
  const int r0 = (t % tiles_per_pair) * ROWS;
  const u32 bar = base + 8 * stage, dst = base + SMEM_STAGES + stage * STAGE_BYTES;
  bar_expect(bar, ROWS * G * 17 + G * 64);
  bulk_load(dst, scales + e * stride_se + (i64)r0 * G, ROWS * G, bar);
  bulk_load(dst + SCALE_BYTES, blocks + e * stride_be + (i64)r0 * ROW_BYTES, ROWS * ROW_BYTES, bar);
  if (with_x) bulk_load(dst + X_OFFSET, x_row, G * 64, bar);
}

__device__ __forceinline__ void issue_x(u32 base, int stage, const u8* x_row) {
  bulk_load(base + SMEM_STAGES + stage * STAGE_BYTES + X_OFFSET, x_row, G * 64, base + 8 * stage);
}

// Persistent blocks: block b takes tiles b, b + gridDim.x, ...; thread 0 keeps S tiles' copies in flight.
// GATE_UP: rows interleave gate (2j) and up (2j + 1); writes h[pair, mma_position(j)] = swiglu(...) * 2**64
// (bf16). Else (down): writes out[pair, r] = w_pair * (y + bias).
extern "C" __global__ void __launch_bounds__(NT) KERNEL_NAME(
    const u8* __restrict__ xa, const i64* __restrict__ ids, const void* __restrict__ route_w,
    const u8* __restrict__ blocks, const u8* __restrict__ scales, const u16* __restrict__ bias,
    void* __restrict__ out, i64 stride_be, i64 stride_se, i64 stride_bias, i64 stride_x_bytes,
    i64 stride_out, int nrows_total, int n_out, int top_k, int n_pairs, float alpha, float limit) {
  extern __shared__ __align__(128) u8 smem[];
  const int tid = threadIdx.x, lane = tid & 31, kw = tid >> 5, q = lane & 3, r8 = lane >> 2;
  const int tiles_per_pair = nrows_total / ROWS, n_tiles = n_pairs * tiles_per_pair;
  const u32 base = smem_u32(smem);
  i64* s_ids = reinterpret_cast<i64*>(smem + SMEM_PAIRS);                  // [MAX_PAIRS] expert ids
  float* s_rw = reinterpret_cast<float*>(smem + SMEM_PAIRS + MAX_PAIRS * 8);  // [MAX_PAIRS] routing weights
  float* red = reinterpret_cast<float*>(smem + SMEM_R);                     // [2][W][ROWS] per-warp row sums
  (void)s_rw;
  if (tid == 0) bars_init(base, S);
  if (tid < 16) reinterpret_cast<u32*>(smem + SMEM_ZERO)[tid] = 0u;  // a block of zero activations
#if GATE_UP
  pdl_wait();  // the expert ids come from the launch just before
#endif
  for (int i = tid; i < n_pairs; i += NT) {
    s_ids[i] = ids[i];
#if !GATE_UP
    s_rw[i] = ROUTE_F32 ? reinterpret_cast<const float*>(route_w)[i]
                        : bf16_to_f32(reinterpret_cast<const u16*>(route_w)[i]);
#endif
  }
  __syncthreads();
#define X_ROW(pair) (xa + (i64)(GATE_UP ? (pair) / top_k : (pair)) * stride_x_bytes)
  if (tid == 0) {
    for (int i = 0; i < S; ++i) {
      const int t = blockIdx.x + i * gridDim.x;
      if (t < n_tiles)
        issue_tile(base, i, t, s_ids[t / tiles_per_pair], blocks, scales, stride_be, stride_se, tiles_per_pair,
                   GATE_UP, X_ROW(t / tiles_per_pair));
    }
  }
#if !GATE_UP
  pdl_wait();  // h comes from the launch just before; ids and weights from two launches back
  if (tid == 0) {
    for (int i = 0; i < S; ++i) {
      const int t = blockIdx.x + i * gridDim.x;
      if (t < n_tiles) issue_x(base, i, X_ROW(t / tiles_per_pair));
    }
  }
#endif
#if FOLD
  const bool supplier = r8 == 0;  // column 0: the lanes of every quad position feed their blocks
#else
  const bool supplier = r8 == 2 * q;  // this lane feeds the MMA's B operand (column 2q)
#endif
  int it = 0;
  for (int t = blockIdx.x; t < n_tiles; t += gridDim.x, ++it) {
    const int stage = it % S;
    const int pair = t / tiles_per_pair, r0 = (t % tiles_per_pair) * ROWS;
    const u8* st = smem + SMEM_STAGES + stage * STAGE_BYTES;
    float* red_t = red + (it & 1) * W * ROWS;
    // the epilogue's bias, loaded now so that its latency hides behind the MMAs
    const u16* bias_e = bias + s_ids[pair] * stride_bias;
    float b0 = 0.f;
#if GATE_UP
    float b1 = 0.f;
    if (tid < ROWS / 2) { b0 = bf16_to_f32(bias_e[r0 + 2 * tid]); b1 = bf16_to_f32(bias_e[r0 + 2 * tid + 1]); }
#else
    if (tid < ROWS) b0 = bf16_to_f32(bias_e[r0 + tid]);
#endif
    float acc[2 * P];
#pragma unroll
    for (int i = 0; i < 2 * P; ++i) acc[i] = 0.f;
    bar_wait(base + 8 * stage, (it / S) & 1);
#pragma unroll 2
    for (int s = kw; s < NS; s += W) {
      const int g = 4 * s + q;
      const int gc = g < G ? g : G - 1;  // past the row's end: a valid block times zero activations
      // every lane loads 32 activations: its block's if it supplies the B operand, else the zero block
      // (loads instead of 16 register zeroings a step)
      const U4* xp = reinterpret_cast<const U4*>(supplier && g < G ? st + X_OFFSET + g * 64 : smem + SMEM_ZERO);
      u32 x[16];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const U4 v = xp[i];
        x[4 * i] = v.x; x[4 * i + 1] = v.y; x[4 * i + 2] = v.z; x[4 * i + 3] = v.w;
      }
#pragma unroll
      for (int p = 0; p < P; ++p) {
        const int ra = 16 * p + r8, rb = ra + 8;
        const U4 a = *reinterpret_cast<const U4*>(st + SCALE_BYTES + ra * ROW_BYTES + gc * 16);
        const U4 b = *reinterpret_cast<const U4*>(st + SCALE_BYTES + rb * ROW_BYTES + gc * 16);
#if FOLD
        u32 d[32];
        decode_step(d, a, b);
        fold_scales(d, st[ra * G + gc], st[rb * G + gc]);
        float r[4];
        mma_step(r, d, x);
        acc[2 * p] += r[0];
        acc[2 * p + 1] += r[2];
#else
        float ca, cb;
        fused_step(ca, cb, a, b, x);
        acc[2 * p] += ca * block_scale(st[ra * G + gc]);
        acc[2 * p + 1] += cb * block_scale(st[rb * G + gc]);
#endif
      }
    }
#pragma unroll
    for (int p = 0; p < P; ++p) {
#if FOLD
      const float ya = acc[2 * p], yb = acc[2 * p + 1];  // column 0's sums are whole in lanes q = 0
#else
      const float ya = quad_sum(acc[2 * p]), yb = quad_sum(acc[2 * p + 1]);
#endif
      if (q == 0) {
        red_t[kw * ROWS + 16 * p + r8] = ya;
        red_t[kw * ROWS + 16 * p + r8 + 8] = yb;
      }
    }
    // the row sums are in and every warp is done with this stage; red is double-buffered, so the next
    // tile's sums may be written while this tile's are still being read
    __syncthreads();
    if (tid == 0) {
      const int tn = t + S * gridDim.x;
      if (tn < n_tiles)
        issue_tile(base, stage, tn, s_ids[tn / tiles_per_pair], blocks, scales, stride_be, stride_se,
                   tiles_per_pair, true, X_ROW(tn / tiles_per_pair));
    }
#if GATE_UP
    if (tid < ROWS / 2) {
      const int j = r0 / 2 + tid;
      float gate = b0, up = b1;
#pragma unroll
      for (int w = 0; w < W; ++w) {
        gate += red_t[w * ROWS + 2 * tid];
        up += red_t[w * ROWS + 2 * tid + 1];
      }
      reinterpret_cast<u16*>(out)[pair * stride_out + mma_position(j)] = f32_to_bf16(swiglu_h(gate, up, alpha, limit));
    }
#else
    if (tid < ROWS) {
      float y = b0;
#pragma unroll
      for (int w = 0; w < W; ++w) y += red_t[w * ROWS + tid];
      reinterpret_cast<float*>(out)[pair * stride_out + r0 + tid] = s_rw[pair] * y;
    }
#endif
  }
}
"""


def shared_layout(g: int, warps: int, pairs: int, stages: int) -> dict[str, int]:
    """Byte offsets of one block's dynamic shared memory (its ``#define`` values), in order: the stages'
    barriers from 0, the pairs' expert ids and routing weights (``SMEM_PAIRS``), ``stages`` tiles of ``16 *
    pairs`` rows of ``g`` blocks (``SMEM_STAGES``, ``STAGE_BYTES`` each: scales, 128-byte aligned, then the
    packed rows at ``SCALE_BYTES``, then the activation row at ``X_OFFSET``), the per-warp row sums, two
    buffers (``SMEM_R``), one block of zero activations (``SMEM_ZERO``); ``SMEM_BYTES`` in all."""
    rows = 16 * pairs
    row_bytes = g * BYTES_PER_BLOCK
    scale_bytes = -(-rows * g // 128) * 128
    x_offset = scale_bytes + rows * row_bytes
    stage_bytes = x_offset + g * 64
    smem_stages = 128 + MAX_PAIRS * 12
    smem_r = smem_stages + stages * stage_bytes
    smem_zero = smem_r + 2 * warps * rows * 4
    return {"ROW_BYTES": row_bytes, "SCALE_BYTES": scale_bytes, "X_OFFSET": x_offset, "STAGE_BYTES": stage_bytes,
            "SMEM_PAIRS": 128, "SMEM_STAGES": smem_stages, "SMEM_R": smem_r, "SMEM_ZERO": smem_zero,
            "SMEM_BYTES": smem_zero + 64}


def shared_bytes(g: int, warps: int, pairs: int, stages: int) -> int:
    """Dynamic shared memory of one block (bytes): :func:`shared_layout`'s ``SMEM_BYTES``."""
    return shared_layout(g, warps, pairs, stages)["SMEM_BYTES"]


def step_defines(repacked: bool) -> str:
    """``#define DECODE_LO`` / ``DECODE_HI``: :func:`~.mma_format.decode_asm` for :data:`STEP_ARITHMETIC`."""
    head = ""
    for name, high in (("DECODE_LO", False), ("DECODE_HI", True)):
        head += f"#define {name} " + _c_string(decode_asm(high, repacked)).replace("\n", " \\\n") + "\n"
    return head


def kernel_source(g: int, warps: int, pairs: int, stages: int, gate_up: bool, route_f32: bool,
                  repacked: bool = False, fold: bool = False) -> str:
    """The CUDA C++ of one launch: ``g`` blocks of 32 values per row, ``warps`` per block, ``16 * pairs``
    rows per tile, ``stages`` tiles in flight per block, the gate_up or the down launch, fp32 (else bf16)
    routing weights, packed words in the checkpoint's or :mod:`~replicas.kernels.moe.decode_layout`'s
    bit layout (``repacked``), the block-scaled or the folded family (``fold``: :data:`STEP_ARITHMETIC`)."""
    defines = {"G": g, "W": warps, "P": pairs, "S": stages, "GATE_UP": int(gate_up), "ROUTE_F32": int(route_f32),
               "MAX_PAIRS": MAX_PAIRS, "KERNEL_NAME": _name(gate_up), "FOLD": int(fold),
               "X_SHIFT": X_SHIFT.value, "X_SCALE": f"{float(2 ** X_SHIFT.value)!r}f"}
    defines |= shared_layout(g, warps, pairs, stages)
    head = "".join(f"#define {k} {v}\n" for k, v in defines.items())
    head += "#define MMA_ASM " + _c_string(mma_asm("%", chains=2, repacked=repacked)).replace("\n", " \\\n") + "\n"
    return head + step_defines(repacked) + CUDA_PRELUDE + ROW_ARITHMETIC + STEP_ARITHMETIC + _SOURCE


@functools.cache
def _kernel(g: int, warps: int, pairs: int, stages: int, gate_up: bool, route_f32: bool,
            repacked: bool = False, fold: bool = False) -> CudaKernel:
    return CudaKernel(kernel_source(g, warps, pairs, stages, gate_up, route_f32, repacked, fold), _name(gate_up),
                      shared_bytes(g, warps, pairs, stages))


def _name(gate_up: bool) -> str:
    """The launches' names (what profilers show): ``moe_bulk_gate_up``, ``moe_bulk_down_proj``."""
    return "moe_bulk_gate_up" if gate_up else "moe_bulk_down_proj"


@functools.cache
def available(device_index: int) -> bool:
    """Whether these kernels run on CUDA device ``device_index``: compute capability 9.0+ and torch's NVRTC
    compiles (one small kernel, once; a failure is reported as a warning and the caller falls back)."""
    if torch.cuda.get_device_capability(device_index)[0] < 9:
        return False
    try:
        with torch.cuda.device(device_index):
            _kernel(1, 1, 1, 1, True, False)
    except RuntimeError as exc:
        warnings.warn(f"the hopper_bulk MoE kernels do not compile here ({exc}); moe_backend=auto takes the next "
                      "backend, a named hopper_bulk fails the load", stacklevel=2)
        return False
    return True


@functools.cache
def _device_limits(device: torch.device) -> tuple[int, int, int]:
    """(SMs, shared-memory bytes a block may opt in to, shared-memory bytes per SM) of ``device``."""
    props = torch.cuda.get_device_properties(device)
    per_sm = getattr(props, "shared_memory_per_multiprocessor", 0) or props.shared_memory_per_block_optin
    return props.multi_processor_count, props.shared_memory_per_block_optin, per_sm


RESERVED_SMEM = 1024
"""Shared memory the driver reserves per resident block (sm_80 and newer, CUDA's occupancy calculator)."""

def grid_size(tiles: int, sms: int, blocks_per_sm: int, block_smem: int, smem_per_sm: int, threads: int) -> int:
    """Blocks of one launch: at most ``blocks_per_sm`` per SM, and no more than fit at once (shared memory
    with :data:`RESERVED_SMEM` per block, 2,048 threads per SM), balanced: the fewest that keep every
    block's tile count the same, ``cdiv(tiles, cdiv(tiles, resident blocks))``, so no block takes one more
    tile than the others and no partial second wave runs."""
    if tiles <= 0:
        return 0
    resident = max(1, min(blocks_per_sm, smem_per_sm // (block_smem + RESERVED_SMEM), 2048 // threads))
    blocks = min(tiles, resident * sms)
    return -(-tiles // -(-tiles // blocks))


def check_tiles_and_buffers(hidden: int, inter: int, pairs: int, down_pairs: int, gate_up_scales: torch.Tensor,
                            down_scales: torch.Tensor, gate_up_bias: torch.Tensor, down_bias: torch.Tensor) -> None:
    """The operand checks both ``hopper_bulk`` kernels make before any launch (besides
    :func:`~replicas.kernels.moe.mxfp4.check_packed_moe`'s).

    Raises:
        ValueError: scales or biases not contiguous, biases not bf16, or ``16 * pairs`` not dividing ``2I``
            (``16 * down_pairs`` not dividing ``hidden``)."""
    for name, tensor in (("gate_up_scales", gate_up_scales), ("down_scales", down_scales),
                         ("gate_up_bias", gate_up_bias), ("down_bias", down_bias)):
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if gate_up_bias.dtype != torch.bfloat16 or down_bias.dtype != torch.bfloat16:
        raise ValueError(f"biases must be bf16, got {gate_up_bias.dtype} and {down_bias.dtype}")
    if (2 * inter) % (16 * pairs) or hidden % (16 * down_pairs):
        raise ValueError(f"16 * pairs must divide 2I ({2 * inter}) and 16 * down_pairs hidden ({hidden})")


def launch_operands(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, x_mxfp4: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_mxfp4, weights, ids)`` as the kernels read them: the activations in the MMA format (computed
    when None), the routing weights contiguous bf16 or fp32 (others converted to fp32), the ids contiguous
    int64."""
    if x_mxfp4 is None:
        x_mxfp4 = mxfp4_activations(x)
    if weights.dtype not in (torch.bfloat16, torch.float32):
        weights = weights.float()
    return x_mxfp4, weights.contiguous(), ids.to(torch.int64).contiguous()


def cuda_moe_bulk(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    gate_up_blocks: torch.Tensor, gate_up_scales: torch.Tensor, gate_up_bias: torch.Tensor,
    down_blocks: torch.Tensor, down_scales: torch.Tensor, down_bias: torch.Tensor,
    alpha: float, limit: float, x_mxfp4: torch.Tensor | None = None, num_warps: int = 4,
    down_num_warps: int = 4, pairs: int = 1, down_pairs: int | None = None, stages: int = 1, blocks_per_sm: int = 8,
    repacked: bool = False, pdl: bool = True, fold_scales: bool = False,
) -> torch.Tensor:
    """Per routed expert, its weighted output: ``[T, K, hidden]`` fp32 (two launches), as
    :func:`~replicas.kernels.moe.triton_tc.triton_moe_tc`.

    Each launch runs up to ``blocks_per_sm`` persistent blocks per SM (:func:`grid_size`); a block takes every
    so-many tile of ``16 * pairs`` rows of one (token, expert) pair and keeps ``stages`` tiles' bulk copies in
    flight.

    Args:
        x: ``[T, hidden]`` activations (rounded to bf16); weights: ``[T, K]`` routing weights (bf16 or fp32;
            others are converted); ids: ``[T, K]`` expert ids (int64; others are converted).
        gate_up_blocks: uint8 ``[E, 2I, hidden/32, 16]``, gate_up_scales: uint8 ``[E, 2I, hidden/32]``,
            gate_up_bias bf16 ``[E, 2I]`` (rows interleaved: ``2j`` gate, ``2j+1`` up).
        down_blocks: uint8 ``[E, hidden, I/32, 16]``, down_scales: uint8 ``[E, hidden, I/32]``,
            down_bias bf16 ``[E, hidden]``.
        alpha, limit: the clamped SwiGLU's constants (GPT-OSS: 1.702, 7.0).
        x_mxfp4: ``x`` already in the MMA format (:func:`~replicas.kernels.moe.mma_format.mxfp4_activations`);
            computed here when None.
        num_warps, pairs: the gate_up launch's warps per block and row pairs per lane (16 rows per pair);
            down_num_warps, down_pairs: the down launch's (``down_pairs`` None: 2 when 32 divides ``hidden``,
            else 1). stages: tiles in flight per block.
        repacked: the packed blocks are in :mod:`~replicas.kernels.moe.decode_layout`'s bit layout
            (:func:`~replicas.kernels.moe.decode_layout.repack_`), which decodes in fewer instructions.
        fold_scales: the folded family (:data:`STEP_ARITHMETIC`: block scales multiplied into the decoded
            weights, the token in MMA column 0): a row's bits are then those of
            :func:`~.hopper_grouped.cuda_moe_grouped` at the same warps (the row-exact family). Else the
            block-scaled family (each lane quad's block in its own MMA column, scaled after the MMA; about
            1 µs per layer faster at one token, ``docs/decisions/0030-folded-decode-moe.md``).
        The tile defaults are the best that ``python -m benchmarks.kernels --kernels hopper_bulk`` found on an H200
        at gpt-oss-120b's shape (``docs/decisions/0018-bulk-moe-grid-and-tiles.md``).

    Returns:
        ``[T, K, hidden]`` fp32; ``x + out.sum(1)`` (in order) is the MoE layer with its residual.

    Raises:
        ValueError: packed tensors not contiguous uint8 ``[..., G, 16]``, widths not multiples of 32, scales
            or biases not contiguous, biases not bf16, ``16 * pairs`` not dividing the row counts, the
            stages not fitting in shared memory, or more than :data:`MAX_PAIRS` (token, expert) pairs.
    """
    t, hidden, k, inter = check_packed_moe(x, ids, gate_up_blocks, down_blocks)
    if down_pairs is None:  # 32-row down tiles where they divide hidden (docs/decisions/0018)
        down_pairs = 2 if hidden % 32 == 0 else 1
    check_tiles_and_buffers(hidden, inter, pairs, down_pairs, gate_up_scales, down_scales, gate_up_bias, down_bias)
    if t * k > MAX_PAIRS:
        raise ValueError(f"{t} tokens x {k} experts: at most {MAX_PAIRS} (token, expert) pairs per call")
    sms, limit_bytes, smem_per_sm = _device_limits(x.device)
    for g, w, p in ((hidden // BLOCK_SIZE, num_warps, pairs), (inter // BLOCK_SIZE, down_num_warps, down_pairs)):
        if shared_bytes(g, w, p, stages) > limit_bytes:
            raise ValueError(f"{stages} stages of {16 * p} rows x {g} blocks need {shared_bytes(g, w, p, stages)} "
                             f"bytes of shared memory; a block may have {limit_bytes}")
    x_mxfp4, weights, ids = launch_operands(x, weights, ids, x_mxfp4)
    launch_pdl = "launch_pdl" in pdl_args(x, pdl)
    pairs_n = t * k
    i64, i32, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_float
    h = torch.empty(pairs_n, inter, dtype=torch.bfloat16, device=x.device)
    tiles = pairs_n * 2 * inter // (16 * pairs)
    _kernel(hidden // BLOCK_SIZE, num_warps, pairs, stages, True, False, repacked, fold_scales)(
        (grid_size(tiles, sms, blocks_per_sm, shared_bytes(hidden // BLOCK_SIZE, num_warps, pairs, stages),
                   smem_per_sm, 32 * num_warps), 1, 1), 32 * num_warps,
        [x_mxfp4, ids, weights, gate_up_blocks, gate_up_scales, gate_up_bias, h,
         i64(gate_up_blocks.stride(0)), i64(gate_up_scales.stride(0)), i64(gate_up_bias.stride(0)),
         i64(x_mxfp4.stride(0) * 2), i64(h.stride(0)), i32(2 * inter), i32(inter), i32(k), i32(pairs_n), f32(alpha),
         f32(limit)],
        pdl=launch_pdl)
    out = torch.empty(t, k, hidden, dtype=torch.float32, device=x.device)
    tiles = pairs_n * hidden // (16 * down_pairs)
    _kernel(inter // BLOCK_SIZE, down_num_warps, down_pairs, stages, False, weights.dtype == torch.float32,
            repacked, fold_scales)(
        (grid_size(tiles, sms, blocks_per_sm, shared_bytes(inter // BLOCK_SIZE, down_num_warps, down_pairs, stages),
                   smem_per_sm, 32 * down_num_warps), 1, 1), 32 * down_num_warps,
        [h, ids, weights, down_blocks, down_scales, down_bias, out,
         i64(down_blocks.stride(0)), i64(down_scales.stride(0)), i64(down_bias.stride(0)),
         i64(h.stride(0) * 2), i64(hidden), i32(hidden), i32(hidden), i32(k), i32(pairs_n), f32(alpha), f32(limit)],
        pdl=launch_pdl)
    return out

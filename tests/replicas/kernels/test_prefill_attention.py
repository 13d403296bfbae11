"""The Triton prefill attention kernel against the torch reference, on fresh random inputs.

On CPU it runs under Triton's interpreter (``TRITON_INTERPRET=1``, set by this folder's conftest), in fp32
(the interpreter's bf16 dot products are wrong: numpy has no bf16); ``tests/gpu`` runs the same checks
compiled, in bf16. Shapes are tiny: ragged batches mixing a whole prompt, a chunk after cached context and
single decode tokens; shuffled page tables; GQA groups of 1, 3 (padded to 4) and 4; sinks; windows whose
edge falls inside, at and outside a key tile; small tiles so that the unmasked middle loop runs too.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from replicas.kernels import prefill_attention as pa  # noqa: E402
from replicas.kernels.paged_attention import AttentionMetadata, paged_attention_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_batch(q_lens, ctx_lens, heads, kv_heads, head_dim=16, blocks=40, dtype=torch.float32, seed=0):
    """Random query/cache and a batch whose sequence ``i`` has ``q_lens[i]`` new tokens ending at context
    ``ctx_lens[i]``; pages shuffled across sequences (no page shared). Returns ``(q, kp, vp, meta)``."""
    g = torch.Generator().manual_seed(seed)
    t = sum(q_lens)
    q = torch.randn(t, heads, head_dim, generator=g).to(DEVICE, dtype)
    kp = torch.randn(blocks, 16, kv_heads, head_dim, generator=g).to(DEVICE, dtype)
    vp = torch.randn(blocks, 16, kv_heads, head_dim, generator=g).to(DEVICE, dtype)
    perm = torch.randperm(blocks, generator=g).tolist()
    tables, used = [], 0
    for c in ctx_lens:
        n = -(-c // 16)
        tables.append(torch.tensor(perm[used:used + n], dtype=torch.long, device=DEVICE))
        used += n
    assert used <= blocks
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    positions = torch.cat([torch.arange(c - n, c) for n, c in zip(q_lens, ctx_lens, strict=True)]).to(DEVICE)
    meta = AttentionMetadata(positions=positions, slot_mapping=positions, query_start=starts,
                             context_lens=list(ctx_lens), block_tables=tables)
    return q, kp, vp, meta


def run_kernel(q, kp, vp, meta, scale, config=None, **kw):
    dev = meta.device_view(q.device)
    block_t = pa.tokens_per_tile(q.shape[1], kp.shape[2], (config or {}).get("BLOCK_M"))
    n = pa.num_tiles_for(meta.query_lens, block_t)
    return pa.triton_prefill_attention(q, kp, vp, dev.query_start, dev.context_lens, dev.block_table, scale, n,
                                       config=config, **kw)


@pytest.fixture
def small_tiles():
    """Tiles of 32 rows x 16 keys: several programs per chunk and unmasked key tiles even on tiny inputs."""
    return {"BLOCK_M": 32, "BLOCK_N": 16}


RAGGED = ([7, 1, 20, 1], [7, 40, 33, 5])
"""A whole 7-token prompt, a decode token at 40, a 20-token chunk after 13 cached tokens, a decode token at 5."""


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 2)])
def test_ragged_causal_matches_reference(heads, kv_heads, small_tiles):
    q, kp, vp, meta = make_batch(*RAGGED, heads, kv_heads, seed=heads)
    want = paged_attention_reference(q, kp, vp, meta, 0.25)
    got = run_kernel(q, kp, vp, meta, 0.25, small_tiles)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [3, 16, 24, 100])
def test_sinks_and_window_match_reference(window, small_tiles):
    """Windows smaller than a tile's positions, equal to a key tile, inside one, and wider than every context."""
    q, kp, vp, meta = make_batch([9, 1, 30], [9, 50, 47], 8, 2, seed=window)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    want = paged_attention_reference(q, kp, vp, meta, 0.25, sinks=sinks, sliding_window=window)
    got = run_kernel(q, kp, vp, meta, 0.25, small_tiles, sinks=sinks, sliding_window=window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if window < 40:  # the window matters on these inputs
        full = paged_attention_reference(q, kp, vp, meta, 0.25, sinks=sinks)
        assert not torch.allclose(full, want, atol=1e-3)


def test_default_tiles_long_chunk_after_cached_context():
    """The serving tile sizes (128 rows = 16 tokens x 8 heads, 64 keys) on a 70-token chunk after 60 cached
    tokens, GPT-OSS's group of 8, sinks and a window of 40 (unmasked middle tiles in the full layers)."""
    q, kp, vp, meta = make_batch([70, 1], [130, 77], 8, 1, blocks=20, seed=3)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    for window in (None, 40):
        want = paged_attention_reference(q, kp, vp, meta, 0.25, sinks=sinks, sliding_window=window)
        got = run_kernel(q, kp, vp, meta, 0.25, sinks=sinks, sliding_window=window)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_prefix_cached_repeat_chunk_is_one_tile_per_kv_head():
    """The persistent lane's repeat of a 2,000-token prompt prefills the 16 tokens past 1,984 cached ones: at
    GPT-OSS's heads (64 query, 8 KV) that is one program per KV head, whatever the cached length (no work per
    cached page on the host), and the kernel gives the reference's output over the 2,000 keys."""
    block_t = pa.tokens_per_tile(64, 8)
    assert block_t == 16 and pa.num_tiles_for([16], block_t) == 1 and pa.num_tiles_for([2000], block_t) == 125
    q, kp, vp, meta = make_batch([16], [2000], 64, 8, head_dim=16, blocks=126, seed=4)
    seq, first = pa.tile_map(meta.device_view(q.device).query_start, block_t, 1)
    assert seq.tolist() == [0] and first.tolist() == [0]
    sinks = torch.randn(64, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    for window in (None, 128):
        want = paged_attention_reference(q, kp, vp, meta, 0.25, sinks=sinks, sliding_window=window)
        torch.testing.assert_close(run_kernel(q, kp, vp, meta, 0.25, sinks=sinks, sliding_window=window), want,
                                   rtol=1e-5, atol=1e-5)


def test_tile_map_and_flops():
    starts = torch.tensor([0, 5, 6, 40], device=DEVICE)
    seq, first = pa.tile_map(starts, 16, pa.num_tiles_for([5, 1, 34], 16))
    assert seq.tolist() == [0, 1, 2, 2, 2] and first.tolist() == [0, 0, 0, 16, 32]
    assert pa.attention_flops([3], [3], 1, 1) == 4 * 6  # 1 + 2 + 3 visible pairs
    assert pa.attention_flops([4], [10], 1, 1, window=8) == 4 * (7 + 8 + 8 + 8)


def test_dispatch_uses_reference_on_cpu_and_when_kernels_are_off():
    """:func:`paged_attention` takes the Triton kernel only on CUDA with ``meta.kernels`` on."""
    from replicas.kernels.paged_attention import paged_attention

    q, kp, vp, meta = make_batch([5, 1], [5, 20], 4, 2, seed=9)
    meta.kernels = False
    torch.testing.assert_close(paged_attention(q, kp, vp, meta, 0.5), paged_attention_reference(q, kp, vp, meta, 0.5))


_HOPPER_PTX = """
import json, re, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from replicas.kernels import prefill_attention as pa

k = pa._prefill_attention_kernel
config = {"BLOCK_M": pa.BLOCK_M, "BLOCK_N": pa.BLOCK_N, "num_warps": pa.NUM_WARPS}
meta = {**pa.launch_meta(64, 8, 64, torch.bfloat16, True, True, config), **json.loads(sys.argv[1])}  # gpt-oss
const = {n: v for n, v in meta.items() if n in k.arg_names}
options = {n: v for n, v in meta.items() if n not in const}
ptrs = ("q_ptr", "k_ptr", "v_ptr", "o_ptr", "sinks_ptr")
sig = {n: "constexpr" if n in const else "*bf16" if n in ptrs else "*i32" if n.endswith("_ptr")
       else "fp32" if n == "scale_log2" else "i32" for n in k.arg_names}
src = ASTSource(fn=k, signature=sig, constexprs={(k.arg_names.index(n),): v for n, v in const.items()})
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={**options, "num_stages": pa.NUM_STAGES})
print(len(re.findall(r"\\bfma\\.rn\\.f32", ptx.asm["ptx"])))
"""


def _hopper_fp32_fmas(**overrides) -> int:
    """Compile the kernel with the launch's own arguments (:func:`launch_meta`, GPT-OSS's heads; ``overrides``
    replace some) for sm_90 with Triton's CUDA backend (no GPU needed: ``ptxas`` ships with the wheel), in a
    fresh interpreter without ``TRITON_INTERPRET``; the number of fp32 FMAs in its PTX."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _HOPPER_PTX, json.dumps(overrides)], env=env, check=True,
                         capture_output=True, text=True, timeout=600)
    return int(out.stdout.strip().splitlines()[-1])


def test_compiled_kernel_rounds_every_multiply_and_add():
    """As launched, the kernel has no fp32 fused multiply-add, so the masked and unmasked key loops compute the
    same probabilities (docs/exactness.md, "Chunked prefill"). With Triton's default contraction the same
    kernel has them (the unmasked loop fuses ``s * scale - m``): the check can fail."""
    assert _hopper_fp32_fmas() == 0
    assert _hopper_fp32_fmas(enable_fp_fusion=True) > 0

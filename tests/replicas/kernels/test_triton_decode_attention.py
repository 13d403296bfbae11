"""The Triton decode-attention kernel against its torch reference, on fresh random inputs.

On CPU it runs under Triton's interpreter (``TRITON_INTERPRET=1``, set by this
folder's conftest); on an NVIDIA GPU (``tests/gpu``) the same checks
run compiled. Inputs are random normal (never zeros), page tables shuffled,
contexts that end mid-page, GQA groups of 3 (SmolLM2) and 8 (GPT-OSS), sinks
and sliding windows.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from replicas.kernels.decode_ops import static_decode_attention  # noqa: E402
from replicas.kernels.triton_decode_attention import triton_decode_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(heads, kv_heads, head_dim, ctx, blocks=48, max_blocks=40, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, head_dim, generator=g).to(DEVICE, dtype)
    kp = torch.randn(blocks, 16, kv_heads, head_dim, generator=g).to(DEVICE, dtype)
    vp = torch.randn(blocks, 16, kv_heads, head_dim, generator=g).to(DEVICE, dtype)
    table = torch.randperm(blocks, generator=g)[:max_blocks].to(DEVICE)
    return q, kp, vp, table, torch.tensor([ctx], device=DEVICE)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (64, 8, 64), (4, 4, 16)])
@pytest.mark.parametrize("ctx", [1, 17, 130, 600])
@pytest.mark.parametrize("splits", [1, 4])
def test_matches_reference(heads, kv_heads, head_dim, ctx, splits):
    q, kp, vp, table, c = _case(heads, kv_heads, head_dim, ctx)
    want = static_decode_attention(q, kp, vp, table, c, head_dim**-0.5)
    got = triton_decode_attention(q, kp, vp, table, c, head_dim**-0.5, num_splits=splits)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("heads,kv_heads,ctx", [(9, 3, 600), (64, 8, 130)])
def test_default_split_count(heads, kv_heads, ctx):
    """Without ``num_splits``: 32 splits at batch one (SmolLM2's 3 KV heads, GPT-OSS's 8), 16 once more than 8
    (sequence, KV head) pairs share the launch."""
    from replicas.kernels.triton_decode_attention import default_splits

    assert default_splits(kv_heads, 1) == 32 and default_splits(3, 4) == 16 and default_splits(8, 2) == 16
    assert default_splits(8, 1, 128) == 1 and default_splits(8, 4, 5) == 1 and default_splits(8, 1, 129) == 32
    q, kp, vp, table, c = _case(heads, kv_heads, 64, ctx, seed=5)
    ws: dict = {}
    got = triton_decode_attention(q, kp, vp, table, c, 0.125, workspace=ws)
    gp = max(16, triton.next_power_of_2(heads // kv_heads))
    (rows, _, _), = ws["partials"]  # the partial buffers were sized for the default split count
    assert rows == kv_heads * default_splits(kv_heads, 1) * gp
    torch.testing.assert_close(got, static_decode_attention(q, kp, vp, table, c, 0.125), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window", [None, 128, 5])
@pytest.mark.parametrize("splits", [4, 1, None])
def test_sinks_and_window_match_reference(window, splits):
    """Split-K with a merge (4), and one program per KV head that normalizes itself (1; the default for
    windows up to 128 tokens)."""
    q, kp, vp, table, c = _case(64, 8, 64, 300, seed=3)
    sinks = torch.randn(64, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    want = static_decode_attention(q, kp, vp, table, c, 0.125, sinks=sinks, sliding_window=window)
    got = triton_decode_attention(q, kp, vp, table, c, 0.125, sinks=sinks, sliding_window=window, num_splits=splits)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    if window is not None:  # the window matters on these inputs
        full = static_decode_attention(q, kp, vp, table, c, 0.125, sinks=sinks)
        assert not torch.allclose(full, want, atol=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="Triton's CPU interpreter computes bf16 dot products wrongly (numpy has no bf16); "
                    "this runs on the GPU (tests/gpu)")
def test_bf16_within_bf16_expectations():
    q, kp, vp, table, c = _case(9, 3, 64, 333, dtype=torch.bfloat16, seed=5)
    want = static_decode_attention(q.float(), kp.float(), vp.float(), table, c, 0.125)
    got = triton_decode_attention(q, kp, vp, table, c, 0.125, num_splits=8).float()
    assert (got - want).abs().max() / want.abs().max() < 2e-2


def _staged_batch(contexts: list[int], heads: int, seed: int, kvh: int = 2, d: int = 16, blocks: int = 12,
                  width: int = 4):
    """A batch of ``len(contexts)`` queries whose context lengths and block tables are strided views (a
    CUDA-graph staging buffer's columns); returns ``(q, kp, vp, table, ctx, generator)``."""
    from tests.replicas.conftest import staged_columns

    g = torch.Generator().manual_seed(seed)
    tables = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in contexts])
    ctx, table = staged_columns(contexts, tables, DEVICE)
    kp = torch.randn(blocks, 16, kvh, d, generator=g).to(DEVICE)
    vp = torch.randn(blocks, 16, kvh, d, generator=g).to(DEVICE)
    q = torch.randn(len(contexts), heads, d, generator=g).to(DEVICE)
    return q, kp, vp, table, ctx, g


def test_strided_context_lengths_and_tables():
    """Context lengths and block tables that are strided views (a CUDA-graph staging buffer's columns):
    each row reads its own."""
    q, kp, vp, table, ctx, _ = _staged_batch([22, 4, 41], heads=4, seed=5)
    ours = triton_decode_attention(q, kp, vp, table, ctx, 0.25, num_splits=2)
    ref = static_decode_attention(q, kp, vp, table.contiguous(), ctx.contiguous(), 0.25)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_one_pass_window_for_a_batch_with_a_padding_row():
    """The one-program-per-KV-head path (window ≤ 128) on a batch whose middle row is CUDA-graph padding
    (context 0: output 0), with sinks and strided staging columns."""
    q, kp, vp, table, ctx, g = _staged_batch([37, 0, 60], heads=8, seed=7)
    sinks = torch.randn(8, generator=g).to(DEVICE)
    ours = triton_decode_attention(q, kp, vp, table, ctx, 0.25, sinks=sinks, sliding_window=20)
    for row in (0, 2):
        ref = static_decode_attention(q[row:row + 1], kp, vp, table[row].contiguous(), ctx[row:row + 1].contiguous(),
                                      0.25, sinks=sinks, sliding_window=20)
        torch.testing.assert_close(ours[row:row + 1], ref, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(ours[1]) == 0


def _tensors(obj):
    """Every tensor inside ``obj`` (dicts, lists and tuples searched)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def test_workspace_buffers_outlive_every_batch_size():
    """One workspace serves every batch size (the standard lane's decode graphs and the persistent lane's quanta
    share the model's): a buffer it once handed to a launch must stay allocated, since a CUDA graph captured
    with it replays its raw address, and a freed buffer is returned to the driver by the ``empty_cache`` each
    later capture starts with (an illegal memory access seen on the H200: ``docs/decisions/0009-standard-lane-decode-graphs.md``).
    Batch sizes 1, 3, 2, 1: every tensor the workspace held stays alive, batch one reuses its first buffers,
    and the results stay the reference's."""
    import weakref

    ws: dict = {}
    seen: list[weakref.ref] = []
    first_ptrs = None
    for i, contexts in enumerate(([60], [40, 60, 17], [30, 5], [60])):
        q, kp, vp, table, ctx, _ = _staged_batch(contexts, heads=8, seed=11 + i)
        got = triton_decode_attention(q, kp, vp, table, ctx, 0.25, num_splits=4, workspace=ws)
        want = static_decode_attention(q, kp, vp, table.contiguous(), ctx.contiguous(), 0.25)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        ptrs = sorted(t.data_ptr() for t in _tensors(ws))
        if i == 0:
            first_ptrs = ptrs
        seen += [weakref.ref(t) for t in _tensors(ws)]
    assert all(r() is not None for r in seen), "a buffer a launch wrote was freed"
    assert set(first_ptrs) <= set(t.data_ptr() for t in _tensors(ws))

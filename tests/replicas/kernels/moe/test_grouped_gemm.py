"""The grouped MXFP4 MoE GEMMs against the dequantize-then-GEMM torch reference, on fresh random inputs.

Triton's CPU interpreter in fp32 here (``TRITON_INTERPRET=1``); ``tests/gpu`` runs them compiled in bf16.
Tiny shapes: ragged expert loads with empty experts, an expert with more pairs than one M-block, padded last
K chunks (96 and 64 inputs with 128-wide steps), a masked last N tile, both weight layouts (the checkpoint's
and the decode layout the experts are repacked into at load on Hopper).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from replicas.kernels.moe import grouped_gemm as mg  # noqa: E402
from replicas.kernels.moe import moe_reference  # noqa: E402
from replicas.kernels.moe.decode_layout import repack_  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class RandomExperts:
    """``E`` random packed MXFP4 experts under GPT-OSS's buffer names (scales near 2**0 keep values O(1))."""

    def __init__(self, e: int, hidden: int, inter: int, seed: int):
        g = torch.Generator().manual_seed(seed)

        def packed(rows, cols):
            blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
            scales = torch.randint(121, 128, (e, rows, cols // 32), generator=g, dtype=torch.uint8)
            return blocks.to(DEVICE), scales.to(DEVICE)

        self.gate_up_proj_blocks, self.gate_up_proj_scales = packed(2 * inter, hidden)
        self.down_proj_blocks, self.down_proj_scales = packed(hidden, inter)
        self.gate_up_proj_bias = torch.randn(e, 2 * inter, generator=g).to(DEVICE)
        self.down_proj_bias = torch.randn(e, hidden, generator=g).to(DEVICE)
        self.alpha, self.limit = 1.702, 7.0
        self.decode_layout = False

    def packed(self):
        return (self.gate_up_proj_blocks, self.gate_up_proj_scales, self.gate_up_proj_bias, self.down_proj_blocks,
                self.down_proj_scales, self.down_proj_bias, self.alpha, self.limit)


def close(got: torch.Tensor, want: torch.Tensor, tol: float = 2e-5) -> None:
    """Equal up to fp32 summation order: max error relative to the largest value (values reach ~10)."""
    assert got.shape == want.shape
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert err < tol, err


@pytest.fixture
def small_tiles():
    """32 weight rows per program with 128-wide K steps: several N tiles on tiny shapes, and widths 96 and 64
    end inside a K step (the masked tail of the words, scales and activations)."""
    return lambda pairs, experts: mg.TileConfig(mg.pick_block_m(pairs, experts), 32, 128, 4, 1)


def routing(tokens: int, k: int, e: int, seed: int, skew: bool = False):
    """Random distinct expert ids per token (``skew``: most tokens share expert 0) and softmax weights."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
    if skew:
        ids[:, 0] = 0
        ids[:, 1:] = torch.where(ids[:, 1:] == 0, e - 1, ids[:, 1:])
    weights = torch.softmax(torch.randn(tokens, k, generator=g), -1)
    return weights.to(DEVICE), ids.to(DEVICE)


@pytest.mark.parametrize("tokens,k,skew,repacked", [(3, 2, False, False), (21, 4, True, False), (5, 4, False, True),
                                                    (21, 2, True, True)])
def test_grouped_moe_matches_reference(tokens, k, skew, repacked, small_tiles):
    """3 tokens x 2 of 8 experts leave most experts empty; 21 tokens with expert 0 in every token give it 21
    pairs (two 16-row M-blocks)."""
    hidden, inter, e = 96, 64, 8
    experts = RandomExperts(e, hidden, inter, seed=tokens + k)
    weights, ids = routing(tokens, k, e, seed=tokens * k, skew=skew)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    want = moe_reference(x, weights, ids, experts)
    if repacked:
        repack_(experts.gate_up_proj_blocks)
        repack_(experts.down_proj_blocks)
        experts.decode_layout = True
        torch.testing.assert_close(moe_reference(x, weights, ids, experts), want)  # the reference reads it too
    got = mg.grouped_moe(x, weights, ids, *experts.packed(), repacked=repacked, tile=small_tiles(tokens * k, e))
    assert want.abs().max() > 1.0  # a real signal
    close(got, want)


def test_partials_are_per_pair_and_residual_adds(small_tiles):
    hidden, inter, e = 64, 32, 4
    experts = RandomExperts(e, hidden, inter, seed=11)
    weights, ids = routing(6, 2, e, seed=5)
    x = torch.randn(6, hidden, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    tile = small_tiles(12, e)
    parts = mg.grouped_moe_partials(x, weights, ids, *experts.packed(), tile=tile)
    assert parts.shape == (6, 2, hidden) and parts.dtype == torch.float32
    for slot in range(2):  # each slot alone is the reference with that slot's routing only
        one = moe_reference(x, weights[:, slot:slot + 1], ids[:, slot:slot + 1], experts)
        close(parts[:, slot], one)
    residual = torch.randn(6, hidden).to(DEVICE)
    torch.testing.assert_close(mg.grouped_moe(x, weights, ids, *experts.packed(), residual=residual, tile=tile),
                               parts.sum(1) + residual, rtol=1e-6, atol=1e-5)


def test_default_tiles_one_token():
    """The serving tiles (16-row M-blocks, 64-wide K steps: a half step at width 96) for a single decode
    token."""
    hidden, inter, e = 96, 64, 8
    experts = RandomExperts(e, hidden, inter, seed=2)
    weights, ids = routing(1, 4, e, seed=2)
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    close(mg.grouped_moe(x, weights, ids, *experts.packed()), moe_reference(x, weights, ids, experts))


def test_grouping_on_device():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]], device=DEVICE)
    g = mg.group_by_expert(ids, 5, block_m=2)
    assert g.expert_start.tolist() == [0, 2, 2, 5, 6, 6]
    assert g.order.tolist() == [1, 4, 0, 2, 5, 3]  # expert 0: pairs 1, 4; expert 2: 0, 2, 5; expert 3: 3
    used = g.block_expert < 5
    assert g.max_blocks == 3 + 5 and g.block_expert[used].tolist() == [0, 2, 2, 3]
    assert g.block_row[used].tolist() == [0, 2, 4, 5]
    # decode batches: 16 rows; 1,024 tokens x 4 of 128 experts (mean 32): 64; long prompts: 128
    assert mg.pick_block_m(4, 128) == 16 and mg.pick_block_m(1024, 128) == 16
    assert mg.pick_block_m(4096, 128) == 64 and mg.pick_block_m(32768, 32) == 128


@pytest.mark.parametrize("tokens,top_k,experts,block_m", [(3, 2, 5, 2), (1, 4, 128, 16), (75, 4, 32, 16),
                                                          (40, 4, 6, 64), (333, 2, 128, 128),
                                                          (1100, 2, 32, 16)])
def test_triton_grouping_equals_torch_grouping(tokens, top_k, experts, block_m):
    """The three-launch Triton grouping gives :func:`group_by_expert`'s tensors exactly: several 64-pair chunks
    (333 x 2), more than the 32 chunks its offsets program reads at a time (1,100 x 2), experts that are not a
    power of two, empty experts (1 token of 128), experts longer than one
    block; the block map's unused tail included."""
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(DEVICE)
    if tokens == 75:  # skewed: half the pairs on expert 3
        ids[::2, 0] = 3
    want = mg.group_by_expert(ids, experts, block_m)
    got = mg.triton_group_by_expert(ids, experts, block_m)
    assert got.max_blocks == want.max_blocks and got.block_m == want.block_m
    for name in ("order", "expert_start", "block_expert", "block_row"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype == torch.int32 and a.tolist() == b.tolist(), name

"""The MoE backend registry: one choice per model, resolved once at load from the config and the device."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from replicas.config import EngineConfig
from replicas.kernels.decode_ops import DecodeOps
from replicas.kernels.moe import (
    MOE_BACKENDS,
    TILE_KEYS,
    MoE,
    MoEBackendError,
    MoEChoice,
    resolve_moe,
)
from replicas.kernels.moe.decode_layout import repack_
from replicas.kernels.moe.reference import moe_reference


def _experts(seed: int = 2, e: int = 4, hidden: int = 64, inter: int = 64) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    return SimpleNamespace(
        gate_up_proj_blocks=torch.randint(0, 256, (e, 2 * inter, hidden // 32, 16), generator=g, dtype=torch.uint8),
        gate_up_proj_scales=torch.randint(118, 124, (e, 2 * inter, hidden // 32), generator=g, dtype=torch.uint8),
        gate_up_proj_bias=0.1 * torch.randn(e, 2 * inter, generator=g),
        down_proj_blocks=torch.randint(0, 256, (e, hidden, inter // 32, 16), generator=g, dtype=torch.uint8),
        down_proj_scales=torch.randint(118, 124, (e, hidden, inter // 32), generator=g, dtype=torch.uint8),
        down_proj_bias=0.1 * torch.randn(e, hidden, generator=g), alpha=1.702, limit=7.0)


def test_auto_on_the_cpu_is_the_reference_and_named_gpu_backends_are_refused():
    choice = resolve_moe("auto", torch.device("cpu"), torch.float32)
    assert (choice.backend, choice.prefill, choice.repack, choice.reason) == ("reference", "reference", False, "auto")
    for name in MOE_BACKENDS[:-1]:
        with pytest.raises(MoEBackendError, match=f"moe_backend={name} needs a GPU"):
            resolve_moe(name, torch.device("cpu"), torch.bfloat16)
    with pytest.raises(MoEBackendError, match="unknown moe_backend 'mma'"):
        resolve_moe("mma", torch.device("cpu"), torch.float32)


def test_tiles_must_be_the_backends_own():
    assert resolve_moe("reference", torch.device("cpu"), torch.float32, tiles={}).tiles == {}
    with pytest.raises(MoEBackendError, match=r"moe_tiles \['pairs'\] are not tiles of reference"):
        resolve_moe("reference", torch.device("cpu"), torch.float32, tiles={"pairs": 2})
    assert set(TILE_KEYS) == set(MOE_BACKENDS)


def test_the_engine_config_refuses_unknown_backends_and_the_load_refuses_unrunnable_ones(tmp_path):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="moe_backend"):
        EngineConfig(moe_backend="scaled")
    with pytest.raises(MoEBackendError, match="hopper_bulk needs a GPU"):
        DecodeOps.build("cpu", torch.float32, moe_backend="hopper_bulk")
    ops = DecodeOps.build("cpu", torch.float32, moe_backend="auto")
    assert ops.describe() == {"decode_kernels": "torch", "pdl": False, "prefill_kernels": False,
                              "batch_invariant": False, "moe_backend": "reference",
                              "moe_prefill": "reference", "moe_repack": False, "moe_tiles": {},
                              "moe_reason": "auto"}
    assert DecodeOps.build("cpu", torch.float32).moe is None  # dense models: no MoE


def test_repack_runs_only_when_the_choice_says_so_and_the_reference_reads_both_layouts():
    experts = _experts()
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    ids = torch.tensor([[0, 2], [3, 1], [2, 3]])
    w = torch.softmax(torch.randn(3, 2, generator=torch.Generator().manual_seed(4)), -1)
    before = moe_reference(x, w, ids, experts)
    assert not MoE(MoEChoice("reference", "reference", False)).prepare(experts)
    assert not getattr(experts, "decode_layout", False)
    # a choice with repack (what hopper_bulk resolves to on a Hopper GPU) repacks once, in place
    repacking = MoE.__new__(MoE)
    repacking.choice = MoEChoice("hopper_bulk", "reference", True)
    original = experts.gate_up_proj_blocks.clone()
    assert repacking.prepare(experts) and experts.decode_layout
    assert not repacking.prepare(experts)  # once
    assert not torch.equal(experts.gate_up_proj_blocks, original)
    assert torch.equal(moe_reference(x, w, ids, experts), before)  # the reference unpacks the decode layout
    ref = MoE(MoEChoice("reference", "reference", False))
    assert torch.equal(ref(x, w, ids, experts, residual=x), x + before)
    with pytest.raises(ValueError, match="contiguous uint8"):
        repack_(experts.gate_up_proj_blocks.float())


def test_hopper_bulk_binds_the_same_warps_to_its_row_exact_kernels():
    """The warps fix the order of a row's sums: the row-exact (folded) one-pair kernel and the grouped kernel
    get the same ones from ``moe_tiles``; the fastest one-pair kernel (block-scaled) gets the same tiles
    without the grouped kernel's."""
    from replicas.kernels.moe.backends import HopperBulk

    for tiles in ({}, {"num_warps": 8, "down_num_warps": 2, "pairs": 2, "tokens_per_chunk": 16}):
        fast = HopperBulk.load(tiles, repack=True, pdl=False)
        exact = HopperBulk.load_row_exact(tiles, repack=True, pdl=False)
        grouped = HopperBulk.load_grouped(tiles, repack=True, pdl=False)
        assert "fold_scales" not in fast.keywords and exact.keywords["fold_scales"] is True
        for key in ("num_warps", "down_num_warps"):
            assert fast.keywords.get(key) == exact.keywords.get(key) == grouped.keywords.get(key) == tiles.get(key)
        assert fast.keywords.get("pairs") == exact.keywords.get("pairs") == tiles.get("pairs")
        assert "tokens_per_chunk" not in fast.keywords
        assert grouped.keywords.get("tokens_per_chunk") == tiles.get("tokens_per_chunk")


def test_where_hopper_bulk_kernels_serve_and_read_the_activation_format():
    """With ``hopper_bulk`` (its kernels bound, not launched: they need an NVIDIA GPU), calls of up to 256 tokens,
    decode rows or prompt tokens, run its own kernels and so read the tensor-core activation format; the
    row-exact path gives them every decode row and no prompt token. A backend without a grouped kernel
    stops at 16 tokens."""
    from replicas.kernels.moe import DECODE_MAX_TOKENS, GROUPED_DECODE_MAX_TOKENS

    moe = MoE(MoEChoice("hopper_bulk", "grouped_gemm", True))
    assert moe.row_exact_decode and moe.kernel_max_tokens == GROUPED_DECODE_MAX_TOKENS == 256
    for prefill in (False, True):
        assert all(moe.reads_mxfp4(t, prefill, row_exact=False) for t in (1, 16, 17, 256))
        assert not moe.reads_mxfp4(257, prefill, row_exact=False)
    assert moe.reads_mxfp4(1, False, row_exact=True) and moe.reads_mxfp4(1000, False, row_exact=True)
    assert not moe.reads_mxfp4(1, True, row_exact=True)  # prompt tokens: the grouped GEMMs at height 64
    tc = MoE(MoEChoice("triton_tc", "grouped_gemm", False))
    assert not tc.row_exact_decode and tc.kernel_max_tokens == DECODE_MAX_TOKENS
    assert tc.reads_mxfp4(16, True, row_exact=False) and not tc.reads_mxfp4(17, False, row_exact=False)

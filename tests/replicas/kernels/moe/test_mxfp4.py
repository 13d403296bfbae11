"""MXFP4 pack/unpack: exact on representable values, bounded error otherwise, clear errors for bad tensors.

transformers' ``convert_moe_packed_tensors`` (the loader it uses for GPT-OSS
checkpoints on CPU) is the reference for the byte layout.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replicas.kernels.moe.mxfp4 import (
    BLOCK_SIZE,
    E2M1_MAGNITUDES,
    MXFP4Error,
    check_mxfp4,
    dequantize_mxfp4,
    e2m1_values,
    packed_nbytes,
    quantize_mxfp4,
)


def _codes_to_blocks(codes: torch.Tensor) -> torch.Tensor:
    """Pack int codes ``[..., G, 32]`` into bytes ``[..., G, 16]``, low nibble first."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def test_e2m1_table_is_ocp_mx():
    assert E2M1_MAGNITUDES == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    v = e2m1_values()
    assert v.shape == (16,) and torch.equal(v[8:], -v[:8])
    assert torch.signbit(v[8]) and not torch.signbit(v[0])


def test_low_nibble_is_the_first_element():
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x72  # low nibble 2 (+1.0) is element 0, high nibble 7 (+6.0) element 1
    out = dequantize_mxfp4(blocks, torch.full((1, 1), 127, dtype=torch.uint8), torch.float32)
    assert out[0, :2].tolist() == [1.0, 6.0] and not out[0, 2:].any()


@pytest.mark.parametrize("exponent", [-127, -20, -3, 0, 1, 7, 30, 125])
def test_all_codes_times_scale_round_trip_exactly(exponent):
    """Every E2M1 code at scale 2**exponent: dequantize is exact, and quantize gives the same bytes back."""
    codes = torch.arange(32) % 16  # each code twice per block, including +-6 so the scale is recovered
    codes = torch.stack((codes, codes.flip(0)))  # [rows=2, 32]
    blocks = _codes_to_blocks(codes.view(2, 1, 32))
    scales = torch.full((2, 1), exponent + 127, dtype=torch.uint8)
    dense = dequantize_mxfp4(blocks, scales, torch.float32)
    expected = e2m1_values()[codes] * 2.0**exponent
    assert torch.equal(dense, expected) and torch.equal(torch.signbit(dense), torch.signbit(expected))
    qb, qs = quantize_mxfp4(dense)
    assert torch.equal(qb, blocks) and torch.equal(qs, scales)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16).float(), dense)  # exact in bf16 too


def test_representable_values_round_trip_whatever_the_block_maximum():
    """A block whose largest value is not 4 or 6 gets another scale but the same values back."""
    gen = torch.Generator().manual_seed(0)
    exps = torch.randint(-10, 10, (64, 1), generator=gen).float()
    values = e2m1_values()[torch.randint(0, 16, (64, BLOCK_SIZE), generator=gen)] * torch.exp2(exps)
    back = dequantize_mxfp4(*quantize_mxfp4(values), torch.float32)
    assert torch.equal(back, values)


def test_matches_transformers_dequantization():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (3, 10, 2, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(100, 150, (3, 10, 2), dtype=torch.uint8, generator=gen)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # HF parameter layout [E, in, out]
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), ref.transpose(1, 2))


def test_ties_round_to_even_and_saturate():
    """Midpoints go to the even code (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4); 7.9->6."""
    row = torch.zeros(BLOCK_SIZE)
    row[:9] = torch.tensor([4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75])  # max 4: scale 2**0
    got = dequantize_mxfp4(*quantize_mxfp4(row), torch.float32)
    assert got[:9].tolist() == [4.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0]
    sat = torch.zeros(BLOCK_SIZE)
    sat[0] = 7.9  # scale 2**0 (floor(log2 7.9) - 2 = 0); 7.9 saturates to 6
    assert dequantize_mxfp4(*quantize_mxfp4(sat), torch.float32)[0].item() == 6.0


def _error_bound(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Half the E2M1 spacing at |x| (in units of the block scale X), or the saturation excess."""
    unit = torch.exp2(scales.float() - 127).repeat_interleave(BLOCK_SIZE, dim=-1)  # X per element
    r = x.abs() / unit
    half_gap = torch.where(r < 2, 0.25, torch.where(r < 4, 0.5, 1.0))
    return torch.maximum(half_gap, r - 6) * unit


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), log_scale=st.floats(-20, 20), rows=st.integers(1, 4), groups=st.integers(1, 3))
def test_quantize_error_is_bounded(seed, log_scale, rows, groups):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, groups * BLOCK_SIZE, generator=gen) * 2.0**log_scale
    blocks, scales = quantize_mxfp4(x)
    assert blocks.shape == (rows, groups, 16) and scales.shape == (rows, groups)
    q = dequantize_mxfp4(blocks, scales, torch.float32)
    err = (q - x).abs()
    assert bool((err <= _error_bound(x, scales) * (1 + 1e-6)).all())
    amax = x.view(rows, groups, BLOCK_SIZE).abs().amax(-1).repeat_interleave(BLOCK_SIZE, -1)
    assert bool((err <= amax / 3).all())


def test_quantize_relative_error_on_gaussian_data():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    q = dequantize_mxfp4(*quantize_mxfp4(x), torch.float32)
    rel = ((q - x).norm() / x.norm()).item()
    assert 0.05 < rel < 0.15, rel  # ~3 significant bits per value (about 0.1 for Gaussian blocks of 32)


def test_zero_block_and_signed_zero():
    x = torch.zeros(2, BLOCK_SIZE)
    x[1, 3] = -0.0
    blocks, scales = quantize_mxfp4(x)
    assert scales.tolist() == [[0], [0]]
    back = dequantize_mxfp4(blocks, scales, torch.float32)
    assert not back.any() and bool(torch.signbit(back[1, 3]))


def test_packed_nbytes_is_4_25_bits_per_value():
    assert packed_nbytes(2880, 2880) * 8 / (2880 * 2880) == 4.25


@pytest.mark.parametrize(
    ("blocks", "scales", "match"),
    [
        (torch.zeros(4, 2, 16, dtype=torch.int8), torch.zeros(4, 2, dtype=torch.uint8), "w_blocks: dtype torch.int8"),
        (torch.zeros(4, 2, 16, dtype=torch.uint8), torch.zeros(4, 2), "w_scales: dtype torch.float32"),
        (torch.zeros(4, 2, 8, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8), r"w_blocks: shape \(4, 2, 8\)"),
        (torch.zeros(4, 2, 16, dtype=torch.uint8), torch.zeros(4, 3, dtype=torch.uint8), "w_scales: shape"),
        (torch.zeros(4, 2, 16, dtype=torch.uint8), torch.full((4, 2), 255, dtype=torch.uint8), "NaN code 255"),
    ],
)
def test_malformed_pairs_name_the_tensor(blocks, scales, match):
    with pytest.raises(MXFP4Error, match=match):
        check_mxfp4(blocks, scales, name="w")
    with pytest.raises(MXFP4Error):
        dequantize_mxfp4(blocks, scales)


def test_logical_shape_mismatch_is_named():
    blocks, scales = torch.zeros(4, 2, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8)
    check_mxfp4(blocks, scales, name="w", shape=(4, 64))
    with pytest.raises(MXFP4Error, match=r"w_blocks: .* encodes a \(4, 64\) matrix, expected \(4, 96\)"):
        check_mxfp4(blocks, scales, name="w", shape=(4, 96))


@pytest.mark.parametrize("bad", [torch.zeros(3, 33), torch.zeros(()), torch.zeros(2, 32, dtype=torch.int32)])
def test_quantize_rejects_bad_shapes(bad):
    with pytest.raises(MXFP4Error, match="cols % 32 == 0"):
        quantize_mxfp4(bad)


def test_quantize_rejects_non_finite():
    x = torch.zeros(BLOCK_SIZE)
    x[5] = float("inf")
    with pytest.raises(MXFP4Error, match="NaN or infinite"):
        quantize_mxfp4(x)

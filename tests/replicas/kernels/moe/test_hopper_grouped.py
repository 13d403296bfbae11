"""CPU checks of the grouped decode MoE kernel's host side (:mod:`replicas.kernels.moe.hopper_grouped`): its
decoding PTX gives the one-pair kernel's MMA operands, its source and shared-memory layout agree, and bad
operands are refused before any launch. The kernel itself runs only on an NVIDIA GPU; the bitwise equality
with the one-pair kernel is ``tests/gpu/test_moe_kernels_gpu.py``'s."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from replicas.kernels.moe import hopper_bulk as bulk  # noqa: E402
from replicas.kernels.moe import hopper_grouped as grouped  # noqa: E402
from replicas.kernels.moe.mma_format import decode_asm, mma_asm  # noqa: E402
from tests.replicas.kernels.moe.test_hopper_bulk import (  # noqa: E402
    _bf16_code,
    _operands,
    _repacked,
    _run_decode,
)


def _run_split_decode(high: bool, repacked: bool, word_a: int, word_b: int) -> dict[str, int]:
    """:func:`decode_asm` interpreted (``%4``, ``%5`` in; ``%0..%3`` out) by the one-pair test's interpreter."""
    asm = decode_asm(high, repacked)
    for i, reg in enumerate(("a0", "a1", "a2", "a3")):
        asm = asm.replace(f"%{i},", f"{reg},")
    asm = asm.replace("%4", "$2").replace("%5", "$3") + "\nmma.sync"
    return _run_decode(asm, [word_a, word_b])[0]


@pytest.mark.parametrize("repacked", [False, True])
def test_split_decoding_gives_the_one_pair_kernels_operands(repacked):
    """Decoding a step once (:func:`decode_asm`, low and high pairs of each word) gives every one of the 8
    MMAs the A registers that :func:`mma_asm`'s fused decode gives it, for every code and random words."""
    g = torch.Generator().manual_seed(2)
    fused = mma_asm(chains=2, repacked=repacked)
    for trial in range(48):
        words = [int(v) for v in torch.randint(0, 2 ** 32, (8,), generator=g, dtype=torch.int64)]
        if trial < 16:
            words = [int("".join([f"{trial:x}"] * 8), 16)] * 8
        words = _repacked(words) if repacked else words
        for i, regs in enumerate(_run_decode(fused, words)):
            assert _run_split_decode(i % 2 == 1, repacked, words[i // 2], words[4 + i // 2]) == regs, (trial, i)


def test_source_and_shared_layout_agree():
    layout = grouped.shared_layout(90, 4, 2, 16)
    src = grouped.kernel_source(90, 4, 2, 16, False, True, repacked=True)
    assert all(f"#define {name} {value}\n" in src for name, value in layout.items())
    assert "#define GATE_UP 0" in src and "#define NJ 16" in src
    # a row's sums, epilogue and step code are the one-pair kernel's own code, not a copy of it
    one_pair = bulk.kernel_source(90, 4, 1, 1, True, False, repacked=True, fold=True)
    assert "#define FOLD 1" in one_pair
    for shared in (bulk.ROW_ARITHMETIC, bulk.STEP_ARITHMETIC, bulk.step_defines(True)):
        assert shared in src and shared in one_pair
    assert "swiglu_h(" in src.split(bulk.STEP_ARITHMETIC, 1)[1] and "fold_scales(" in src.split(bulk.STEP_ARITHMETIC, 1)[1]
    assert "$" not in src.split("#define DECODE_LO", 1)[1].split("typedef", 1)[0]  # CUDA operands are %N
    # regions in order, none overlapping: the pair list, the tile (128-byte aligned), two chunks of sums,
    # the zero block
    assert layout["SMEM_LIST"] + 2 * grouped.MAX_PAIRS <= layout["SMEM_STAGE"]
    assert layout["SMEM_STAGE"] % 128 == 0 and layout["SMEM_R"] % 128 == 0
    assert layout["SMEM_R"] - layout["SMEM_STAGE"] >= 32 * 90 * 17
    assert layout["SMEM_ZERO"] == layout["SMEM_R"] + 2 * 16 * 4 * 32 * 4 == layout["SMEM_BYTES"] - 64


@pytest.mark.parametrize("kwargs,operands,match", [
    ({}, {"bias_dtype": torch.float32}, "biases must be bf16"),
    ({"pairs": 3}, {}, "16 \\* pairs must divide"),
    ({}, {"t": 257}, "at most 1024"),
    ({}, {"experts": 257}, "of 257: at most"),
    ({"tokens_per_chunk": 4}, {}, "a positive multiple of 8"),
    ({"tokens_per_chunk": 0}, {}, "a positive multiple of 8"),
])
def test_bad_operands_are_refused_before_any_launch(kwargs, operands, match):
    with pytest.raises(ValueError, match=match):
        grouped.cuda_moe_grouped(*_operands(**operands), **kwargs)


def _bf16_bits(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF


def test_folding_the_block_scale_into_a_decoded_code_is_exact():
    """The folded family's scaling (:data:`~.hopper_bulk.STEP_ARITHMETIC`'s ``fold_factor``): a decoded code
    (its E2M1 value times ``2**-126`` in bf16, subnormal for 0.5) times the bf16 factor ``2**(s - 65)`` is
    exactly the value times ``2**(s - 191)`` for every code and every scale code from 66 to 192."""
    assert "const u32 h = (s + 62u) << 7;" in bulk.STEP_ARITHMETIC and "mul.rn.bf16x2" in bulk.STEP_ARITHMETIC
    codes = torch.tensor([_bf16_code(c) for c in range(16)], dtype=torch.float64)
    decoded = codes.to(torch.bfloat16)
    assert torch.equal(decoded.double(), codes)  # the decoder's output is exact in bf16
    for s in range(66, 193):
        factor = torch.tensor([(s + 62) << 7], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        assert factor.double().item() == 2.0 ** (s - 65)
        folded = decoded * factor  # bf16 x bf16, rounded to bf16
        assert torch.equal(folded.double(), codes * 2.0 ** (s - 65)), s
        assert torch.equal(_bf16_bits(folded.double()), _bf16_bits(codes * 2.0 ** (s - 65)))

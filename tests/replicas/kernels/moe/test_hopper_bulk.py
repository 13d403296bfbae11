"""CPU checks of the CUDA-source MoE kernel's host side and of the E2M1 decoding PTX both tensor-core MoE
kernels share (the kernels themselves run only on an NVIDIA GPU: ``tests/gpu/test_moe_kernels_gpu.py``)."""

from __future__ import annotations

import ctypes
import re

import pytest
import torch

pytest.importorskip("triton")

from replicas.kernels.cuda_source import _LaunchAttribute, _LaunchConfig  # noqa: E402
from replicas.kernels.moe import hopper_bulk as bulk  # noqa: E402
from replicas.kernels.moe.decode_layout import repack_, unpacked  # noqa: E402
from replicas.kernels.moe.mma_format import mma_asm  # noqa: E402
from replicas.kernels.moe.mxfp4 import E2M1_MAGNITUDES  # noqa: E402


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    """PTX ``lop3.b32``: bit i of the result is bit ``4 a_i + 2 b_i + c_i`` of ``lut``."""
    return sum(((lut >> (4 * (a >> i & 1) + 2 * (b >> i & 1) + (c >> i & 1))) & 1) << i for i in range(32))


def _run_decode(asm: str, words: list[int]) -> list[dict[str, int]]:
    """Interpret the integer part of ``mma_asm`` (``and``, ``shl``, ``mul.lo``, ``mul.hi``, ``lop3`` on u32)
    for input words ``$2..$9``; the A-operand registers ``a0..a3`` as they stand at each ``mma``."""
    regs = {f"${2 + i}": w for i, w in enumerate(words)}
    seen = []
    for line in asm.splitlines():
        m = re.match(r"(and\.b32|shl\.b32|mul\.lo\.u32|mul\.hi\.u32) (\w+), (\$?\w+), (0x[0-9a-fA-F]+|\d+);", line)
        lop = re.match(r"lop3\.b32 (\w+), (\w+), (\w+), (0x[0-9a-fA-F]+), (0x[0-9a-fA-F]+);", line)
        if m:
            op, dst, src, imm = m.group(1), m.group(2), regs[m.group(3)], int(m.group(4), 0)
            if op == "and.b32":
                regs[dst] = src & imm
            elif op == "shl.b32":
                regs[dst] = (src << imm) & 0xFFFFFFFF
            else:
                regs[dst] = (src * imm) & 0xFFFFFFFF if op == "mul.lo.u32" else (src * imm) >> 32
        elif lop:
            regs[lop.group(1)] = _lop3(regs[lop.group(2)], regs[lop.group(3)], int(lop.group(4), 16),
                                       int(lop.group(5), 16))
        elif line.startswith("mma.sync"):
            seen.append({r: regs[r] for r in ("a0", "a1", "a2", "a3")})
        else:
            assert line.startswith(("{", "}", ".reg", "mov.b32", "add.f32")), line
    return seen


def _bf16_code(code: int) -> float:
    """What the decoder must produce for E2M1 ``code``: the bf16 bit pattern of value * 2**-126."""
    return (-1.0 if code & 8 else 1.0) * E2M1_MAGNITUDES[code & 7] * 2.0 ** -126


def _as_bf16(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float().item()


def _repacked(words: list[int]) -> list[int]:
    """``words`` moved into the decode layout by :func:`repack_` (the code under test for the layout)."""
    t = torch.tensor(words, dtype=torch.int64)
    t = torch.where(t >= 2 ** 31, t - 2 ** 32, t).to(torch.int32).view(torch.uint8).view(2, 16)
    repack_(t)
    return [w & 0xFFFFFFFF for w in t.view(-1).view(torch.int32).tolist()]


@pytest.mark.parametrize("chains,repacked", [(1, False), (2, False), (2, True)])
def test_decode_ptx_gives_every_code_its_value_in_the_mma_k_order(chains, repacked):
    """Each MMA ``i`` gets, in ``a0``/``a2`` (row a) and ``a1``/``a3`` (row b), the bf16 pairs of codes
    ``(p, p + 4)`` for pairs ``p0 = 2 (i % 2)`` and ``p0 + 1`` of word ``i // 2``: every one of the 16 codes,
    in every nibble position, decoded to its E2M1 value times 2**-126; from the checkpoint's words, or from
    the same words repacked into :mod:`~replicas.kernels.moe.decode_layout`'s layout."""
    g = torch.Generator().manual_seed(0)
    asm = mma_asm(chains=chains, repacked=repacked)
    for trial in range(64):
        words = [int(v) for v in torch.randint(0, 2 ** 32, (8,), generator=g, dtype=torch.int64)]
        if trial < 16:  # every code in every nibble of every word
            words = [int("".join([f"{trial:x}"] * 8), 16)] * 8
        for i, regs in enumerate(_run_decode(asm, _repacked(words) if repacked else words)):
            w, p0 = i // 2, 2 * (i % 2)
            for reg, word, p in (("a0", words[w], p0), ("a2", words[w], p0 + 1), ("a1", words[4 + w], p0),
                                 ("a3", words[4 + w], p0 + 1)):
                lo, hi = (word >> (4 * p)) & 15, (word >> (4 * p + 16)) & 15
                assert _as_bf16(regs[reg] & 0xFFFF) == _bf16_code(lo), (trial, i, reg)
                assert _as_bf16(regs[reg] >> 16) == _bf16_code(hi), (trial, i, reg)


def test_cuda_source_uses_the_same_mma_step_and_fits_shared_memory():
    src = bulk.kernel_source(90, 4, 1, 1, True, False)
    assert "#define G 90" in src and "#define GATE_UP 1" in src and "#define S 1" in src
    assert "$" not in src.split("#define MMA_ASM", 1)[1]  # CUDA operands are %N
    # the block-scaled step's 8 MMAs (MMA_ASM), and the one MMA of the shared step code (the folded family's)
    assert src.split("#define DECODE_LO", 1)[0].count("mma.sync.aligned.m16n8k16") == 8
    assert src.count("mma.sync.aligned.m16n8k16") == 9
    # gpt-oss-120b: hidden = expert width = 2880 (90 blocks): the default tiles (4 warps, one 16-row stage)
    # need no shared-memory opt-in; a stage is the scales (128-byte aligned), the packed rows and the x row
    assert bulk.shared_bytes(90, 4, 1, 1) < 48 * 1024
    stage = 1536 + 16 * 90 * 16 + 90 * 64
    assert bulk.shared_bytes(90, 4, 1, 3) - bulk.shared_bytes(90, 4, 1, 1) == 2 * stage
    # the kernel's offsets are the layout's; every region ends where the next begins, the zero block last
    layout = bulk.shared_layout(90, 4, 1, 3)
    src = bulk.kernel_source(90, 4, 1, 3, True, False)
    assert all(f"#define {name} {value}\n" in src for name, value in layout.items())
    assert layout["STAGE_BYTES"] == stage and layout["SMEM_STAGES"] == 128 + bulk.MAX_PAIRS * 12
    assert layout["SMEM_ZERO"] == layout["SMEM_R"] + 2 * 4 * 16 * 4 == layout["SMEM_BYTES"] - 64


def test_launch_structures_match_cuda_h():
    """``CUlaunchConfig`` / ``CUlaunchAttribute`` as cuda.h lays them out on 64-bit Linux."""
    assert ctypes.sizeof(_LaunchAttribute) == 72
    assert _LaunchAttribute.value.offset == 8
    assert (_LaunchConfig.shared.offset, _LaunchConfig.stream.offset, _LaunchConfig.attrs.offset,
            _LaunchConfig.num_attrs.offset) == (24, 32, 40, 48)


def _operands(t=1, k=4, hidden=64, inter=64, experts=4, bias_dtype=torch.bfloat16):
    x = torch.randn(t, hidden).bfloat16()
    ids = torch.zeros(t, k, dtype=torch.int64)
    w = torch.ones(t, k).bfloat16()
    gu = (torch.zeros(experts, 2 * inter, hidden // 32, 16, dtype=torch.uint8),
          torch.zeros(experts, 2 * inter, hidden // 32, dtype=torch.uint8),
          torch.zeros(experts, 2 * inter, dtype=bias_dtype))
    dn = (torch.zeros(experts, hidden, inter // 32, 16, dtype=torch.uint8),
          torch.zeros(experts, hidden, inter // 32, dtype=torch.uint8), torch.zeros(experts, hidden, dtype=bias_dtype))
    return (x, w, ids, *gu, *dn, 1.702, 7.0)


@pytest.mark.parametrize("kwargs,operands,match", [
    ({}, {"bias_dtype": torch.float32}, "biases must be bf16"),
    ({"pairs": 3}, {}, "16 \\* pairs must divide"),
    ({}, {"t": 33}, "at most 128"),
    ({}, {"hidden": 48}, "multiples of 32"),
])
def test_bad_operands_are_refused_before_any_launch(kwargs, operands, match):
    with pytest.raises(ValueError, match=match):
        bulk.cuda_moe_bulk(*_operands(**operands), **kwargs)


def test_repacking_moves_bits_within_words_and_unpacks_exactly():
    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (3, 7, 5, 16), generator=g, dtype=torch.uint8)
    original = blocks.clone()
    assert repack_(blocks, chunk_rows=4) is blocks
    assert not torch.equal(blocks, original)
    words = lambda b: b.view(-1, 4).view(torch.int32).view(-1)  # noqa: E731
    pop = lambda w: sum(((w.to(torch.int64) & 0xFFFFFFFF) >> i & 1).sum() for i in range(32))  # noqa: E731
    assert pop(words(blocks)) == pop(words(original))  # a permutation of bits: as many ones
    assert torch.equal(unpacked(blocks), original)
    with pytest.raises(ValueError, match="contiguous uint8"):
        repack_(blocks.float())


def test_grid_size_balances_tiles_over_the_blocks_that_fit():
    """gpt-oss-120b's gate_up on an H200: 1,440 tiles, 132 SMs, 31.8 KiB per block (6 fit per SM): 720
    blocks of two tiles each, not 792 of which some take two and some one (or 1,056 in two waves)."""
    smem = bulk.shared_bytes(90, 4, 1, 1)
    assert bulk.grid_size(1440, 132, 8, smem, 233472, 128) == 720
    assert bulk.grid_size(720, 132, 8, smem, 233472, 128) == 720
    assert bulk.grid_size(10, 132, 8, smem, 233472, 128) == 10
    assert bulk.grid_size(1440, 132, 1, smem, 233472, 1024) == 131  # 11 tiles each (132 would leave some 10)
    assert bulk.grid_size(1440, 132, 8, smem, 233472, 1024) == 240  # 2,048 threads per SM: 264 fit, 6 tiles each

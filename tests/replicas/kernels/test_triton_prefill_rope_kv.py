"""The prefill RoPE + KV-write kernel against its torch reference and the models' own rotation.

On CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set by this folder's conftest), fp32; on a GPU
the same checks run compiled. Tokens of several sequences in one call (positions restart per sequence,
slots shuffled across pages), head counts whose sum is not a power of two (masked rows), both table layouts
(GPT-OSS's ``D/2`` columns, Llama's ``D`` with the halves repeated).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from replicas.kernels.paged_attention import write_kv  # noqa: E402
from replicas.kernels.reference import apply_rope_half  # noqa: E402
from replicas.kernels.triton_prefill_rope_kv import (  # noqa: E402
    prefill_rope_kv_reference,
    triton_prefill_rope_kv,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(heads, kv_heads, d, seq_lens, table_cols, seed=0, blocks=12):
    g = torch.Generator().manual_seed(seed)
    t = sum(seq_lens)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g)
    positions = torch.cat([torch.arange(7 * i, 7 * i + n) for i, n in enumerate(seq_lens)])
    slots = torch.randperm(blocks * 16, generator=g)[:t]
    angles = torch.rand(64, d // 2, generator=g) * 6
    cos, sin = angles.cos(), angles.sin()
    if table_cols == d:
        cos, sin = torch.cat((cos, cos), 1), torch.cat((sin, sin), 1)
    planes = [torch.randn(blocks, 16, kv_heads, d, generator=g) for _ in range(2)]
    return [x.to(DEVICE) for x in (qkv, cos, sin, positions, slots, *planes)]


@pytest.mark.parametrize("heads,kv_heads,d,table_d", [(6, 2, 16, 8), (8, 8, 32, 32), (4, 1, 16, 16)])
def test_matches_reference(heads, kv_heads, d, table_d):
    qkv, cos, sin, pos, slots, kp, vp = _case(heads, kv_heads, d, [9, 1, 20], table_d, seed=heads)
    kp2, vp2 = kp.clone(), vp.clone()
    got = triton_prefill_rope_kv(qkv, cos, sin, pos, slots, kp, vp, heads, kv_heads)
    want = prefill_rope_kv_reference(qkv, cos, sin, pos, slots, kp2, vp2, heads, kv_heads)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kp, kp2, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(vp, vp2, rtol=1e-6, atol=1e-6)
    untouched = torch.ones(kp.shape[0] * 16, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False  # every other slot keeps its old content
    assert torch.equal(kp.flatten(0, 1)[untouched], kp2.flatten(0, 1)[untouched])


def test_equals_the_models_rotation_and_kv_write():
    """What the eager forward did in torch (``apply_rope_half`` on q and k, ``write_kv``), in fp32."""
    heads, kv_heads, d = 6, 2, 16
    qkv, cos, sin, pos, slots, kp, vp = _case(heads, kv_heads, d, [5, 12], d // 2, seed=3)
    kp2, vp2 = kp.clone(), vp.clone()
    q = triton_prefill_rope_kv(qkv, cos, sin, pos, slots, kp, vp, heads, kv_heads)
    t = qkv.shape[0]
    q_, k_, v_ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    c, s = cos[pos], sin[pos]
    want_q = apply_rope_half(q_.reshape(t, heads, d), c, s)
    write_kv(apply_rope_half(k_.reshape(t, kv_heads, d), c, s), v_.reshape(t, kv_heads, d), kp2, vp2, slots)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kp, kp2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(vp, vp2, rtol=0, atol=0)


def test_rejects_a_mismatched_projection():
    qkv, cos, sin, pos, slots, kp, vp = _case(6, 2, 16, [3], 8)
    with pytest.raises(ValueError, match="qkv must be"):
        triton_prefill_rope_kv(qkv[:, :-16], cos, sin, pos, slots, kp, vp, 6, 2)

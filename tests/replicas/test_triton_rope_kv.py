"""The fused RoPE + KV-write Triton kernel against its torch reference (CPU interpreter here, GPU in tests/gpu)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from replicas.kernels.triton_rope_kv import rope_kv_reference, triton_rope_kv  # noqa: E402
from replicas.models.llama import rope_tables  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (64, 8, 64), (4, 2, 16)])
@pytest.mark.parametrize("position", [0, 15, 16, 333])
def test_matches_reference_and_writes_only_its_slot(heads, kv_heads, head_dim, position):
    g = torch.Generator().manual_seed(position + heads)
    qkv = torch.randn(1, (heads + 2 * kv_heads) * head_dim, generator=g).to(DEVICE)
    cos, sin = (t.to(DEVICE) for t in rope_tables(head_dim, 1024, 10000.0))
    table = torch.randperm(40, generator=g)[:30].to(DEVICE)
    pos = torch.tensor([position], device=DEVICE)
    planes = [torch.randn(40, 16, kv_heads, head_dim, generator=g).to(DEVICE) for _ in range(2)]
    before = [p.clone() for p in planes]
    ref_planes = [p.clone() for p in planes]
    q = triton_rope_kv(qkv, cos, sin, pos, table, planes[0], planes[1], heads, kv_heads)
    q_ref = rope_kv_reference(qkv, cos, sin, pos, table, ref_planes[0], ref_planes[1], heads, kv_heads)
    torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(planes[0], ref_planes[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(planes[1], ref_planes[1], rtol=1e-5, atol=1e-5)
    page, off = int(table[position // 16]), position % 16
    for new, old in zip(planes, before, strict=True):
        changed = (new != old).any(-1).any(-1).nonzero().tolist()
        assert changed == [[page, off]]  # exactly its slot was written, nothing else

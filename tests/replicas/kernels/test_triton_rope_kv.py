"""The fused RoPE + KV-write Triton kernel against its torch reference (CPU interpreter here, GPU in tests/gpu)."""

from __future__ import annotations

import pytest
import torch

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


def test_strided_positions_of_a_cuda_graph_staging_buffer():
    """Batched rows whose positions and block tables are columns of one staging buffer (as
    :mod:`replicas.decode_graphs` passes them): every row must read its own position. Reading positions
    as if contiguous sent rows 1.. to wrong positions and made the graphed GPT-OSS standard lane diverge."""
    from tests.replicas.conftest import staged_columns

    g = torch.Generator().manual_seed(4)
    b, heads, kvh, d, blocks, width = 3, 4, 2, 16, 12, 4
    tables = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in range(b)])
    position, table = staged_columns([21, 3, 40], tables, DEVICE)
    qkv = torch.randn(b, (heads + 2 * kvh) * d, generator=g).to(DEVICE)
    cos, sin = torch.randn(64, d // 2, generator=g).to(DEVICE), torch.randn(64, d // 2, generator=g).to(DEVICE)
    planes = [torch.zeros(blocks, 16, kvh, d, device=DEVICE) for _ in range(4)]
    q = triton_rope_kv(qkv, cos, sin, position, table, planes[0], planes[1], heads, kvh)
    q_ref = rope_kv_reference(qkv, cos, sin, position.contiguous(), table.contiguous(), planes[2], planes[3],
                              heads, kvh)
    torch.testing.assert_close(q, q_ref)
    torch.testing.assert_close(planes[0], planes[2])
    torch.testing.assert_close(planes[1], planes[3])

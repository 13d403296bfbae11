"""Paged KV cache: page allocator accounting and cache geometry (docs/design.md "KV cache geometry")."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from replicas.kernels.paged_attention import PAGE_SIZE
from replicas.kv_cache import KVCache, OutOfPagesError, PageAllocator, pages_for
from replicas.models.config import ModelConfig

# GPT-OSS-120B attention geometry (docs/design.md "Models"), built by hand.
GPT_OSS = ModelConfig(
    model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_layers=36,
    num_heads=64, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=150000.0,
    max_position_embeddings=131072, attention_bias=True,
)


def test_page_size_is_16():
    assert PAGE_SIZE == 16


@pytest.mark.parametrize(("tokens", "pages"), [(0, 0), (1, 1), (15, 1), (16, 1), (17, 2), (32, 2), (33, 3)])
def test_pages_for(tokens, pages):
    assert pages_for(tokens) == pages


def test_check_then_allocate_and_release():
    a = PageAllocator(4)
    assert (a.num_free, a.num_used) == (4, 0)
    assert a.can_allocate(4) and not a.can_allocate(5)
    pages = a.allocate(3)
    assert len(set(pages)) == 3 and all(0 <= p < 4 for p in pages)
    assert (a.num_free, a.num_used) == (1, 3)
    assert a.can_allocate(1) and not a.can_allocate(2)
    a.free(pages)
    assert a.num_free == 4
    assert sorted(a.allocate(4)) == [0, 1, 2, 3]


def test_allocate_zero_pages_is_a_no_op():
    a = PageAllocator(2)
    assert a.allocate(0) == [] and a.num_free == 2


def test_out_of_pages_raises_and_changes_nothing():
    a = PageAllocator(3)
    held = a.allocate(2)
    with pytest.raises(OutOfPagesError, match="need 2 pages, 1 free"):
        a.allocate(2)
    assert a.num_free == 1
    assert isinstance(OutOfPagesError("x"), RuntimeError)
    a.free(held)
    assert a.num_free == 3


def test_double_free_raises_value_error():
    a = PageAllocator(4)
    pages = a.allocate(2)
    a.free(pages[:1])
    with pytest.raises(ValueError, match="not allocated"):
        a.free(pages[:1])
    assert a.num_free == 3  # the failed free did not add the page twice
    with pytest.raises(ValueError):
        a.free([pages[1], pages[1]])  # the same page twice in one call


@pytest.mark.parametrize("page", [-1, 4, 100])
def test_free_of_a_bad_page_id_raises(page):
    a = PageAllocator(4)
    with pytest.raises(ValueError):
        a.free([page])
    assert a.num_free == 4


def test_can_grow_and_grow_extend_a_block_table_in_place():
    a = PageAllocator(4)
    table: list[int] = []
    assert a.can_grow(table, 16)
    a.grow(table, 16)
    assert len(table) == 1
    a.grow(table, 16)  # already covered: nothing taken
    assert len(table) == 1 and a.num_free == 3
    a.grow(table, 17)
    assert len(table) == 2 and a.num_free == 2
    assert a.can_grow(table, 64) and not a.can_grow(table, 65)
    assert a.can_grow(table, 1)  # shrinking never needs pages
    a.grow(table, 64)
    assert len(table) == 4 and a.num_free == 0 and len(set(table)) == 4
    with pytest.raises(OutOfPagesError):
        a.grow(table, 65)
    assert len(table) == 4
    a.release(table)
    assert table == [] and a.num_free == 4


def test_release_twice_is_harmless_because_the_table_is_emptied():
    a = PageAllocator(2)
    table = a.allocate(2)
    a.release(table)
    a.release(table)  # empty now
    assert a.num_free == 2


NUM_BLOCKS = 12


class PageAllocatorMachine(RuleBasedStateMachine):
    """Random allocate / grow / release / bad-free sequences over one allocator.

    Invariants: no page is held by two tables, no page id is out of range,
    and ``num_free + pages held == num_blocks`` (nothing leaks).
    """

    def __init__(self):
        super().__init__()
        self.alloc = PageAllocator(NUM_BLOCKS)
        self.tables: list[list[int]] = []
        self.tokens: list[int] = []  # tokens each table must hold

    @rule(num_tokens=st.integers(0, 5 * PAGE_SIZE))
    def new_table(self, num_tokens):
        table: list[int] = []
        free_before = self.alloc.num_free
        if self.alloc.can_grow(table, num_tokens):
            self.alloc.grow(table, num_tokens)
            assert len(table) == pages_for(num_tokens)
            assert self.alloc.num_free == free_before - len(table)
            self.tables.append(table)
            self.tokens.append(num_tokens)
        else:
            with pytest.raises(OutOfPagesError):
                self.alloc.grow(table, num_tokens)
            assert table == [] and self.alloc.num_free == free_before

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), extra=st.integers(0, 3 * PAGE_SIZE))
    def grow(self, data, extra):
        i = data.draw(st.integers(0, len(self.tables) - 1))
        table, want = self.tables[i], self.tokens[i] + extra
        before = list(table)
        if self.alloc.can_grow(table, want):
            self.alloc.grow(table, want)
            assert table[: len(before)] == before  # existing pages keep their places
            assert len(table) == max(len(before), pages_for(want))
            self.tokens[i] = want
        else:
            with pytest.raises(OutOfPagesError):
                self.alloc.grow(table, want)
            assert table == before

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def release(self, data):
        i = data.draw(st.integers(0, len(self.tables) - 1))
        table = self.tables.pop(i)
        self.tokens.pop(i)
        n = len(table)
        free_before = self.alloc.num_free
        self.alloc.release(table)
        assert table == [] and self.alloc.num_free == free_before + n

    @precondition(lambda self: any(self.tables))
    @rule(data=st.data())
    def free_a_held_page_twice(self, data):
        """Free one held page, then free it again: the second free raises; accounting stays exact."""
        i = data.draw(st.sampled_from([k for k, t in enumerate(self.tables) if t]))
        page = self.tables[i].pop()
        self.tokens[i] = min(self.tokens[i], len(self.tables[i]) * PAGE_SIZE)
        self.alloc.free([page])
        with pytest.raises(ValueError):
            self.alloc.free([page])

    @invariant()
    def accounting(self):
        held = [p for t in self.tables for p in t]
        assert len(held) == len(set(held)), "a page is held by two tables"
        assert all(0 <= p < NUM_BLOCKS for p in held)
        assert self.alloc.num_free + len(held) == NUM_BLOCKS
        assert self.alloc.num_used == len(held)

    def teardown(self):
        for t in self.tables:
            self.alloc.release(t)
        assert self.alloc.num_free == NUM_BLOCKS
        # every page comes back exactly once: a fresh allocation of the whole pool is a permutation
        assert sorted(self.alloc.allocate(NUM_BLOCKS)) == list(range(NUM_BLOCKS))


TestPageAllocatorProperties = PageAllocatorMachine.TestCase
TestPageAllocatorProperties.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_kv_cache_geometry_gpt_oss_bf16():
    kv = KVCache(GPT_OSS, num_blocks=3, dtype=torch.bfloat16, device="cpu")
    assert tuple(kv.tensor.shape) == (2, 36, 3, 16, 8, 64)
    assert kv.tensor.dtype == torch.bfloat16 and kv.tensor.is_contiguous()
    assert kv.bytes_per_page == 16 * 8 * 64 * 2 == 16384
    assert KVCache.bytes_per_block_all_layers(GPT_OSS, torch.bfloat16) == 2 * 36 * 16384
    # a page of one layer-plane is exactly bytes_per_page apart from the next one
    assert kv.tensor.stride(2) * kv.tensor.element_size() == kv.bytes_per_page


def test_kv_cache_planes_are_views_of_the_one_tensor():
    kv = KVCache(GPT_OSS, num_blocks=2, dtype=torch.bfloat16, device="cpu")
    planes = kv.planes()
    assert len(planes) == 36
    k5, v5 = planes[5]
    assert tuple(k5.shape) == (2, 16, 8, 64) and tuple(v5.shape) == (2, 16, 8, 64)
    k5[1, 3, 2, 7] = 1.5
    v5[0, 15, 7, 63] = -2.0
    assert kv.tensor[0, 5, 1, 3, 2, 7].item() == 1.5
    assert kv.tensor[1, 5, 0, 15, 7, 63].item() == -2.0
    assert kv.tensor.count_nonzero().item() == 2


def test_kv_cache_rejects_zero_blocks():
    with pytest.raises(ValueError):
        KVCache(GPT_OSS, num_blocks=0, dtype=torch.bfloat16, device="cpu")


def test_engine_core_cache_matches_the_model(core):
    cfg = core.model.config
    kv = core.kv_cache
    assert tuple(kv.tensor.shape) == (2, cfg.num_layers, core.allocator.num_blocks, 16, cfg.num_kv_heads, cfg.head_dim)
    assert kv.num_blocks == core.config.resolved_num_kv_blocks() == core.allocator.num_blocks
    assert kv.bytes_per_page == 16 * cfg.num_kv_heads * cfg.head_dim * kv.tensor.element_size()
    # the model runner writes into this very tensor
    assert core.runner.kv_planes[0][0].data_ptr() == kv.tensor[0, 0].data_ptr()
    assert core.runner.kv_planes[-1][1].data_ptr() == kv.tensor[1, cfg.num_layers - 1].data_ptr()

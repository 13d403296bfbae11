"""Property test of the page pool with prefix sharing (hypothesis state machine).

Tables are built the way the scheduler builds them: look up the prefix cache,
share the hits, allocate the rest, register pages as they fill, release on
finish. Each page's *content* is tracked symbolically (the hash of the prefix
it was written for), so the test also catches the cache handing out a page
whose content is not the prefix asked for.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from replicas.kernels.paged_attention import PAGE_SIZE
from replicas.kv_cache import PageAllocator, page_hashes, pages_for

NUM_BLOCKS = 12
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=5 * PAGE_SIZE)  # tiny alphabet: many shared prefixes


class PrefixPool(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = PageAllocator(NUM_BLOCKS, enable_prefix_caching=True)
        self.tables: dict[int, tuple[list[int], list[int]]] = {}  # id -> (tokens, block table)
        self.content: dict[int, bytes] = {}  # page -> hash of the full page written into it
        self.next_id = 0

    @rule(seq=tokens)
    def admit(self, seq):
        hashes = page_hashes(seq)
        hits = self.pool.match_prefix(hashes[: (len(seq) - 1) // PAGE_SIZE])
        for i, page in enumerate(hits):  # a hit must hold exactly that prefix
            assert self.content.get(page) == hashes[i]
        need = pages_for(len(seq)) - len(hits)
        if not self.pool.can_share_and_allocate(hits, need):
            return
        in_use = {p for _, t in self.tables.values() for p in t}
        self.pool.share(hits)
        fresh = self.pool.allocate(need)
        assert not set(fresh) & in_use, "handed out a page that is in use"
        table = list(hits) + fresh
        for i in range(len(hits), len(hashes)):  # "compute" the new full pages, then register them
            self.content[table[i]] = hashes[i]
            self.pool.register(table[i], hashes[i])
        for p in fresh[len(hashes) - len(hits):]:
            self.content.pop(p, None)  # partial page: no full content
        self.tables[self.next_id] = (list(seq), table)
        self.next_id += 1

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), extra=st.integers(1, 2 * PAGE_SIZE))
    def append(self, data, extra):
        tid = data.draw(st.sampled_from(sorted(self.tables)))
        seq, table = self.tables[tid]
        new = seq + [1] * extra
        if not self.pool.can_grow(table, len(new)):
            return
        in_use = {p for _, t in self.tables.values() for p in t}
        before = len(table)
        self.pool.grow(table, len(new))
        assert not set(table[before:]) & in_use
        hashes = page_hashes(new)
        for i in range(len(page_hashes(seq)), len(hashes)):
            if self.pool.ref_count(table[i]) == 1:  # only an unshared page is written
                self.content[table[i]] = hashes[i]
                self.pool.register(table[i], hashes[i])
        self.tables[tid] = (new, table)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def release(self, data):
        tid = data.draw(st.sampled_from(sorted(self.tables)))
        _, table = self.tables.pop(tid)
        self.pool.release(table)
        assert table == []

    @invariant()
    def accounting(self):
        held = Counter(p for _, t in self.tables.values() for p in t)
        for page in range(NUM_BLOCKS):
            assert self.pool.ref_count(page) == held.get(page, 0)
        assert self.pool.num_free + len(held) == NUM_BLOCKS


PrefixPool.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestPrefixPool = PrefixPool.TestCase

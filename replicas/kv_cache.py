"""Paged KV cache: the tensor a replica owns and the page allocator over it.

Geometry (docs/design.md "KV cache geometry"): one tensor ``[2, num_layers, num_blocks, PAGE_SIZE,
num_kv_heads, head_dim]``; index 0 holds keys, 1 values. A page (block) holds
``PAGE_SIZE`` = 16 tokens of one layer-plane. Page accounting splits checking
from doing (``can_allocate``/``allocate``, ``can_grow``/``grow``) in the manner
of nano-vllm's block manager.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import Counter, OrderedDict

import torch

from replicas.kernels.paged_attention import PAGE_SIZE
from replicas.models.config import ModelConfig


class OutOfPagesError(RuntimeError):
    """An allocation was attempted without enough free pages (a scheduler bug: check first)."""


class KVCache:
    """The replica's KV cache tensor.

    Attributes:
        tensor: ``[2, num_layers, num_blocks, PAGE_SIZE, num_kv_heads, head_dim]``.
    """

    def __init__(self, cfg: ModelConfig, num_blocks: int, dtype: torch.dtype, device: torch.device | str):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.tensor = torch.zeros(
            2, cfg.num_layers, num_blocks, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device
        )

    def planes(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer ``(key_plane, value_plane)`` views, each ``[num_blocks, PAGE_SIZE, KVH, D]``."""
        return [(self.tensor[0, i], self.tensor[1, i]) for i in range(self.tensor.shape[1])]

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page of one layer-plane (GPT-OSS bf16: 16*8*64*2 = 16,384)."""
        return PAGE_SIZE * self.tensor.shape[4] * self.tensor.shape[5] * self.tensor.element_size()

    @staticmethod
    def bytes_per_block_all_layers(cfg: ModelConfig, dtype: torch.dtype) -> int:
        """Bytes one block index costs across K and V of every layer."""
        elt = torch.empty(0, dtype=dtype).element_size()
        return 2 * cfg.num_layers * PAGE_SIZE * cfg.num_kv_heads * cfg.head_dim * elt


def pages_for(num_tokens: int) -> int:
    """Pages needed to hold ``num_tokens`` tokens (``ceil(n / PAGE_SIZE)``)."""
    return math.ceil(num_tokens / PAGE_SIZE)


PageHash = bytes
"""Identity of a full page's content: a digest chained over every token before it."""


def page_hashes(token_ids: list[int], start: int = 0, parent: PageHash | None = None) -> list[PageHash]:
    """Chained digests of the full pages of ``token_ids`` from page index ``start`` on.

    ``hash_i = blake2b(hash_{i-1} || tokens of page i)``, so equal hashes mean
    equal whole prefixes (the scheme of vLLM's automatic prefix caching).

    Args:
        token_ids: the sequence.
        start: first page index to hash; ``parent`` must be page ``start - 1``'s hash.
        parent: the previous page's hash (None for page 0).
    """
    out: list[PageHash] = []
    prev = parent or b""
    for page in range(start, len(token_ids) // PAGE_SIZE):
        chunk = token_ids[page * PAGE_SIZE:(page + 1) * PAGE_SIZE]
        prev = hashlib.blake2b(prev + array("q", chunk).tobytes(), digest_size=16).digest()
        out.append(prev)
    return out


class PageAllocator:
    """Reference-counted page pool with an optional prefix cache.

    Every page is either *free* (reference count 0, in an LRU free list; it may
    still hold a cached full page that a later request can revive) or *in use*
    (count >= 1: one per block table holding it). Allocation takes the least
    recently freed page and forgets its cached content. ``free`` of a page whose
    count is already 0 raises. Checking is split from doing (``can_*``/``*``).

    Args:
        num_blocks: pages in the pool.
        enable_prefix_caching: keep hashes of full pages so equal prefixes share pages.
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = False):
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(num_blocks))
        self._ref = [0] * num_blocks
        self._hash_of: list[PageHash | None] = [None] * num_blocks
        self._page_of: dict[PageHash, int] = {}

    @property
    def num_free(self) -> int:
        """Pages with no holder (cached-but-free pages included: they are reusable)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Full pages whose content is registered in the prefix cache (in use or free)."""
        return len(self._page_of)

    def ref_count(self, page: int) -> int:
        return self._ref[page]

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` fresh pages (count 1 each). Raises :class:`OutOfPagesError` if fewer are free."""
        if n > len(self._free):
            raise OutOfPagesError(f"need {n} pages, {len(self._free)} free")
        pages = []
        for _ in range(n):
            page, _ = self._free.popitem(last=False)
            old = self._hash_of[page]
            if old is not None:  # evict its cached content
                self._hash_of[page] = None
                if self._page_of.get(old) == page:
                    del self._page_of[old]
            self._ref[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page. Raises ``ValueError`` on a double free or a bad id.

        Pages reaching count 0 join the free list's tail (evicted last), keeping their cached content.
        """
        for p, times in Counter(pages).items():
            if not 0 <= p < self.num_blocks or self._ref[p] < times:
                raise ValueError(f"page {p} is not allocated (double free?)")
        for p in pages:
            self._ref[p] -= 1
            if self._ref[p] == 0:
                self._free[p] = None

    # ---- prefix cache ------------------------------------------------------------------
    def match_prefix(self, hashes: list[PageHash]) -> list[int]:
        """Pages holding the longest cached prefix of ``hashes`` (no state change)."""
        if not self.enable_prefix_caching:
            return []
        pages = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def can_share_and_allocate(self, shared: list[int], n_new: int) -> bool:
        """Whether taking ``shared`` cached pages plus ``n_new`` fresh ones fits."""
        revived = sum(1 for p in shared if self._ref[p] == 0)
        return revived + n_new <= len(self._free)

    def share(self, pages: list[int]) -> None:
        """Add a reference to each cached page (reviving free ones)."""
        for p in pages:
            if self._ref[p] == 0:
                del self._free[p]
            self._ref[p] += 1

    def register(self, page: int, h: PageHash) -> None:
        """Record that in-use ``page`` now holds the full page with hash ``h``."""
        if not self.enable_prefix_caching or self._hash_of[page] is not None:
            return
        if h not in self._page_of:
            self._page_of[h] = page
            self._hash_of[page] = h

    # ---- block tables ------------------------------------------------------------------
    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        """Whether ``block_table`` can be extended to hold ``num_tokens`` tokens."""
        return self.can_allocate(max(0, pages_for(num_tokens) - len(block_table)))

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Extend ``block_table`` in place to hold ``num_tokens`` tokens."""
        need = pages_for(num_tokens) - len(block_table)
        if need > 0:
            block_table.extend(self.allocate(need))

    def release(self, block_table: list[int]) -> None:
        """Drop this table's reference to each page (last page first, so tails are evicted first) and empty it."""
        self.free(block_table[::-1])
        block_table.clear()

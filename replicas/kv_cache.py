"""Paged KV cache: the tensor a replica owns and the page allocator over it.

Geometry (DESIGN.md): one tensor ``[2, num_layers, num_blocks, PAGE_SIZE,
num_kv_heads, head_dim]``; index 0 holds keys, 1 values. A page (block) holds
``PAGE_SIZE`` = 16 tokens of one layer-plane. Page accounting splits checking
from doing (``can_allocate``/``allocate``, ``can_grow``/``grow``) in the manner
of nano-vllm's block manager.
"""

from __future__ import annotations

import math

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


class PageAllocator:
    """Free-list allocator of physical page ids ``0 .. num_blocks-1``.

    Invariant: every page is either free or owned by exactly one block table;
    ``free`` of a page that is already free raises.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._is_free = [True] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` pages. Raises :class:`OutOfPagesError` if fewer are free."""
        if n > len(self._free):
            raise OutOfPagesError(f"need {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages to the pool. Raises ``ValueError`` on a double free or a bad id."""
        for p in pages:
            if not 0 <= p < self.num_blocks or self._is_free[p]:
                raise ValueError(f"page {p} is not allocated (double free?)")
            self._is_free[p] = True
            self._free.append(p)

    # Sequence-level helpers: a block table is a list of page ids owned by one request.
    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        """Whether ``block_table`` can be extended to hold ``num_tokens`` tokens."""
        return self.can_allocate(max(0, pages_for(num_tokens) - len(block_table)))

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Extend ``block_table`` in place to hold ``num_tokens`` tokens."""
        need = pages_for(num_tokens) - len(block_table)
        if need > 0:
            block_table.extend(self.allocate(need))

    def release(self, block_table: list[int]) -> None:
        """Free every page of ``block_table`` and empty it."""
        self.free(block_table)
        block_table.clear()

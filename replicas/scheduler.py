"""Continuous-batching scheduler for the standard lane.

Each step builds one mixed batch under a token budget
(``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``):

1. running requests first, in admission order: one token each when decoding,
   or the next chunk of their prompt (chunked prefill);
2. then waiting requests, first come first served: a prefix-cache lookup
   revives pages of an equal prefix (not for a request that still needs prompt
   logprobs: a cached page has no logits; as vLLM), and the rest of the prompt
   is scheduled (whole, or a chunk that fits the budget).

When pages run out for a running request, the most recently admitted request
is preempted by recompute: its pages are released (full ones stay in the
prefix cache) and it returns to the front of the waiting queue; re-admitted,
it prefills prompt + output so far and continues with identical greedy output.

For ``n > 1`` the siblings wait until their leader's prompt is computed, then
share its full prompt pages through the prefix cache.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from replicas.kernels.paged_attention import PAGE_SIZE
from replicas.kv_cache import PageAllocator, page_hashes, pages_for
from replicas.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """Step limits.

    Attributes:
        max_num_seqs: most requests in one step.
        max_num_batched_tokens: most new tokens in one step. Without chunked
            prefill a single prompt longer than this still runs, alone.
        enable_chunked_prefill: split long prompts across steps so decodes keep flowing.
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 4096
    enable_chunked_prefill: bool = True


class Scheduler:
    """Waiting and running queues over a page allocator."""

    def __init__(self, config: SchedulerConfig, allocator: PageAllocator):
        self.config = config
        self.allocator = allocator
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> list[tuple[Request, int]]:
        """Pick this step's batch: ``(request, num_new_tokens)`` pairs; their pages are reserved."""
        batch: list[tuple[Request, int]] = []
        budget = self.config.max_num_batched_tokens
        for req in list(self.running):
            if req not in self.running:  # preempted while making room for an earlier one
                continue
            n = req.num_tokens - req.num_computed_tokens
            if self.config.enable_chunked_prefill:
                n = min(n, budget)
            if n <= 0 or len(batch) >= self.config.max_num_seqs or (n > budget and batch):
                continue
            if not self._reserve_running(req, req.num_computed_tokens + n):
                continue
            batch.append((req, n))
            budget -= n
        self._admit_waiting(batch, budget)
        return batch

    def _reserve_running(self, req: Request, num_tokens: int) -> bool:
        """Grow ``req``'s pages to ``num_tokens``, preempting from the back; False if ``req`` itself was preempted."""
        while not self.allocator.can_grow(req.block_table, num_tokens):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is req:
                return False
        self.allocator.grow(req.block_table, num_tokens)
        return True

    def _admit_waiting(self, batch: list[tuple[Request, int]], budget: int) -> None:
        while self.waiting and len(batch) < self.config.max_num_seqs and budget > 0:
            req = self.waiting[0]
            if req.leader is not None and not req.leader.is_finished and not req.leader.prefill_done:
                break  # an n>1 sibling waits for its leader's prompt pages (FCFS: nothing jumps it)
            hits, hashes = self._prefix_hits(req)
            cached = len(hits) * PAGE_SIZE
            n = req.num_tokens - cached
            if self.config.enable_chunked_prefill:
                n = min(n, budget)
            elif n > budget and batch:
                break
            need = pages_for(cached + n) - len(hits)
            if not self.allocator.can_share_and_allocate(hits, need):
                break
            self.waiting.popleft()
            self.allocator.share(hits)
            req.block_table = list(hits) + self.allocator.allocate(need)
            req.num_computed_tokens = cached
            req.num_cached_tokens = cached
            req.page_hashes = hashes[: len(hits)]
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.append((req, n))
            budget -= n

    def _prefix_hits(self, req: Request) -> tuple[list[int], list[bytes]]:
        """Cached pages for ``req``'s prefix (leaving at least one token to compute: its logits are
        needed) and the hashes of the pages looked up."""
        if not self.allocator.enable_prefix_caching or req.needs_prompt_logits:  # cached pages have no logits
            return [], []
        usable = (req.num_tokens - 1) // PAGE_SIZE
        hashes = page_hashes(req.all_token_ids[: usable * PAGE_SIZE])
        return self.allocator.match_prefix(hashes), hashes

    def commit_computed(self, req: Request, num_new: int) -> None:
        """Advance ``req`` by ``num_new`` computed tokens and register its newly full pages whose token ids are
        all known: a page completed by a token still being sampled on the device (async scheduling: the engine
        computes it before it reads it) is registered by a later call, ``num_new = 0`` once the token is in."""
        req.num_computed_tokens += num_new
        if not self.allocator.enable_prefix_caching:
            return
        full = min(req.num_computed_tokens, req.num_tokens) // PAGE_SIZE
        if full > len(req.page_hashes):
            parent = req.page_hashes[-1] if req.page_hashes else None
            new = page_hashes(req.all_token_ids[: full * PAGE_SIZE], start=len(req.page_hashes), parent=parent)
            for i, h in enumerate(new, start=len(req.page_hashes)):
                self.allocator.register(req.block_table[i], h)
            req.page_hashes.extend(new)

    def preempt(self, req: Request) -> None:
        """Free ``req``'s pages and requeue it at the front (recompute on re-admission)."""
        self.running.remove(req)
        self.allocator.release(req.block_table)
        req.num_computed_tokens = 0
        req.page_hashes = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        """Remove a finished or aborted request and return its pages."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.allocator.release(req.block_table)
        req.status = RequestStatus.FINISHED

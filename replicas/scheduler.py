"""Continuous-batching scheduler for the standard lane.

Each step admits waiting requests (whole-prompt prefill, up to a token budget)
and decodes every running request by one token, in one mixed batch. When pages
run out for a decode, the most recently admitted request is preempted by
recompute: its pages are freed and it goes back to the front of the waiting
queue; when re-admitted it prefills prompt + output so far and continues.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from replicas.kv_cache import PageAllocator
from replicas.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """Step limits.

    Attributes:
        max_num_seqs: most requests in one step.
        max_num_batched_tokens: most new tokens in one step (a single prompt
            longer than this still runs, alone).
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 4096


class Scheduler:
    """Waiting and running queues over a page allocator."""

    def __init__(self, config: SchedulerConfig, allocator: PageAllocator):
        self.config = config
        self.allocator = allocator
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> list[tuple[Request, int]]:
        """Pick this step's batch: ``(request, num_new_tokens)`` pairs; pages already grown."""
        batch: list[tuple[Request, int]] = []
        # 1. decode every running request (preempting from the back when pages run out)
        i = 0
        while i < len(self.running):
            req = self.running[i]
            if self.allocator.can_grow(req.block_table, req.num_tokens):
                self.allocator.grow(req.block_table, req.num_tokens)
                batch.append((req, req.num_new_tokens))
                i += 1
                continue
            victim = self.running.pop()
            self._preempt(victim)
            if victim is req:
                continue
        budget = self.config.max_num_batched_tokens - sum(n for _, n in batch)
        # 2. admit waiting requests (FCFS) while they fit
        while self.waiting and len(batch) < self.config.max_num_seqs:
            req = self.waiting[0]
            n = req.num_new_tokens
            if n > budget and batch:
                break
            if not self.allocator.can_grow(req.block_table, req.num_tokens):
                break
            self.waiting.popleft()
            self.allocator.grow(req.block_table, req.num_tokens)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.append((req, n))
            budget -= n
        return batch

    def _preempt(self, req: Request) -> None:
        self.allocator.release(req.block_table)
        req.num_computed_tokens = 0
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

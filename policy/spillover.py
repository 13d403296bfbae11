"""Spillover: does an eligible request wait for a busy persistent pool, or go standard at once?

Pure (no torch, no ray): the router feeds it what it observes and asks it per request.
The rule (docs/architecture.md, "Spillover"):

* a persistent replica is believed free → dispatch there (the wait is only the dispatch itself,
  bounded by the router's cap);
* every persistent replica is busy → wait only if one is expected to free up and serve the first
  token sooner than the standard lane would: ``time_to_free + persistent TTFT < standard TTFT``;
  otherwise go standard at once (reason ``persistent_capacity``).

Estimates, all from what the router itself saw:

* ``time_to_free``: for each persistent request this router has in flight, ``(max_tokens − tokens
  streamed) × TPOT − time since its last chunk`` (at least 0), the smallest over them. ``max_tokens``
  bounds the output (a request may stop earlier at EOS), so this errs towards spilling. Requests of
  other routers are not seen here: a replica busy with one of them counts as never freeing.
* TPOT: an exponentially weighted moving average (EWMA) of the persistent chunks' gaps per token
  (a quantum of ``n`` tokens arriving ``dt`` after the previous chunk is one sample ``dt / n``).
* persistent TTFT and standard TTFT: EWMAs of dispatch → first chunk on each lane (the standard one
  includes the standard lane's queueing, so it grows with its load).

Until a lane has been observed its estimate is unknown, and an unknown estimate never makes a
request wait.
"""

from __future__ import annotations

from dataclasses import dataclass

EWMA_WEIGHT = 0.2
"""Weight of the newest sample in every EWMA (about the last 5-10 observations dominate)."""


class Ewma:
    """Exponentially weighted moving average; ``value`` is None until the first sample."""

    def __init__(self, weight: float = EWMA_WEIGHT):
        if not 0 < weight <= 1:
            raise ValueError(f"EWMA weight must be in (0, 1], got {weight}")
        self.weight = weight
        self.value: float | None = None

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else self.value + self.weight * (sample - self.value)


@dataclass
class InFlight:
    """One persistent request this router has in flight (times in seconds, ``time.monotonic``)."""

    max_tokens: int
    streamed: int = 0
    last_chunk_at: float | None = None
    dispatched_at: float = 0.0


class SpilloverEstimator:
    """The router's view of the persistent pool's load, and the wait rule above.

    Times are seconds on one monotonic clock, passed in (``now``) so the rule is testable.
    """

    def __init__(self, weight: float = EWMA_WEIGHT):
        self.tpot = Ewma(weight)
        self.persistent_ttft = Ewma(weight)
        self.standard_ttft = Ewma(weight)
        self.in_flight: dict[str, InFlight] = {}

    # ---- observations ------------------------------------------------------------------
    def started(self, request_id: str, max_tokens: int, now: float) -> None:
        """A persistent replica took ``request_id`` (dispatched at ``now``)."""
        self.in_flight[request_id] = InFlight(max_tokens=max_tokens, dispatched_at=now)

    def persistent_chunk(self, request_id: str, num_tokens: int, now: float) -> None:
        """``num_tokens`` tokens of ``request_id`` arrived at ``now`` (the first chunk gives TTFT, later
        ones TPOT samples)."""
        r = self.in_flight.get(request_id)
        if r is None or num_tokens <= 0:
            return
        if r.last_chunk_at is None:
            self.persistent_ttft.add(now - r.dispatched_at)
        else:
            self.tpot.add((now - r.last_chunk_at) / num_tokens)
        r.streamed += num_tokens
        r.last_chunk_at = now

    def finished(self, request_id: str) -> None:
        """``request_id`` left the persistent lane (done, failed, rejected or cancelled)."""
        self.in_flight.pop(request_id, None)

    def standard_first_chunk(self, ttft_s: float) -> None:
        """A standard-lane request got its first chunk ``ttft_s`` after dispatch."""
        self.standard_ttft.add(ttft_s)

    # ---- estimates ---------------------------------------------------------------------
    def time_to_free(self, now: float) -> float | None:
        """Seconds until the first of this router's persistent requests should end; None if none is in
        flight or no TPOT has been observed yet."""
        tpot = self.tpot.value
        if tpot is None:
            return None
        best = None
        for r in self.in_flight.values():
            if r.last_chunk_at is None:  # still in prefill: its decode has not started
                left = r.max_tokens * tpot
            else:
                left = max(0.0, (r.max_tokens - r.streamed) * tpot - (now - r.last_chunk_at))
            best = left if best is None else min(best, left)
        return best

    def wait_budget(self, free_replicas: int, cap_s: float, now: float) -> float | None:
        """How long an eligible request may wait for a persistent replica, or None: go standard now.

        Args:
            free_replicas: persistent replicas believed free (after counting this router's own
                requests, dispatches included).
            cap_s: the longest wait allowed (the router's ``spillover_wait_s``).
            now: the current time.
        """
        if free_replicas > 0:
            return cap_s
        t_free = self.time_to_free(now)
        standard = self.standard_ttft.value
        if t_free is None or standard is None:
            return None
        persistent = self.persistent_ttft.value or 0.0
        if t_free + persistent >= standard:
            return None
        return min(cap_s, standard - persistent)  # past this, waiting costs more than the standard lane

    def snapshot(self) -> dict:
        """The estimates, in milliseconds, for ``/debug/stats``."""
        def ms(v: float | None) -> float | None:
            return None if v is None else round(1000 * v, 3)

        return {"tpot_ms": ms(self.tpot.value), "persistent_ttft_ms": ms(self.persistent_ttft.value),
                "standard_ttft_ms": ms(self.standard_ttft.value), "in_flight": len(self.in_flight)}

"""Readiness: has this router reached every pool it routes to?

``/health`` answers 503 until it has (docs/architecture.md, "Readiness"). A pool is reached when one ``ping``
through the very handle requests use has answered (which also makes that handle resolve its replicas), plus
whatever the router needs before its first request to that pool (the persistent pool: one read of its load
records). Probes run in the background, all missing pools at once, each waiting at most
``READY_PROBE_TIMEOUT_S``; ``/health`` waits at most ``HEALTH_WAIT_S`` for a running probe
(:meth:`Readiness.readiness`). With several ingress replicas each router also probes once before its first
request (:meth:`Readiness.first_requests_probe`), since ``/health`` reached only one of them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

READY_PROBE_TIMEOUT_S = 2.0
"""How long one readiness probe (a ``ping`` through a pool's handle) may take; past it ``/health`` answers
503 and the next call probes again."""
HEALTH_WAIT_S = 0.02
"""How long ``/health`` waits for a running readiness probe before it answers from the last known state."""


class Readiness:
    """Which of a router's pools it has reached.

    Args:
        pools: pool name (``standard``, ``persistent``) → the Serve handle its requests use; only the pools
            readiness waits for.
        prepare: awaited before every probe (the router starts its output listener there).
        after_ping: pool name → awaited once that pool's ping answered; the pool counts as reached only if it
            returns without raising (the persistent pool: the router's first read of its load records).
        started: called after every probe (the router starts its background pool view there).
    """

    def __init__(self, pools: dict, prepare: Callable[[], Awaitable[None]] | None = None,
                 after_ping: dict[str, Callable[[], Awaitable[None]]] | None = None,
                 started: Callable[[], None] | None = None):
        self.pools = pools
        self.needed = list(pools)
        self.reached: set[str] = set()
        self._prepare = prepare
        self._after_ping = after_ping or {}
        self._started = started
        self._lock = asyncio.Lock()
        self._first_probe: asyncio.Future | None = None  # the one probe a request waits for
        self._health_probe: asyncio.Future | None = None  # the background probe /health reports on

    @property
    def ready(self) -> bool:
        return len(self.reached) == len(self.needed)

    def missing(self) -> list[str]:
        """The pools not reached yet, in order (``[]``: ready)."""
        return [name for name in self.needed if name not in self.reached]

    async def missing_pools(self) -> list[str]:
        """Probe every missing pool (one ``ping`` each, all at once, each at most ``READY_PROBE_TIMEOUT_S``,
        so this may take that long) and return those still missing (``[]``: ready)."""
        if self._prepare is not None:
            await self._prepare()
        async with self._lock:
            todo = self.missing()
            reached = await asyncio.gather(*(self._probe(name) for name in todo))
            if self._started is not None:
                self._started()
            return [name for name, ok in zip(todo, reached, strict=True) if not ok]

    async def _probe(self, name: str) -> bool:
        """One ``ping`` through pool ``name``'s handle; True (and the pool marked reached) when it answered."""
        try:
            await asyncio.wait_for(self.pools[name].ping.remote(), timeout=READY_PROBE_TIMEOUT_S)
            after = self._after_ping.get(name)
            if after is not None:
                await after()
        except Exception:  # noqa: BLE001 - not reachable yet (deploying, replaced, timed out)
            return False
        self.reached.add(name)
        return True

    async def readiness(self) -> list[str]:
        """What ``/health`` reports, within about ``HEALTH_WAIT_S``: the pools not reached yet (``[]``: ready).

        While a pool is missing, a probe (:meth:`missing_pools`) runs in the background, one at a time; this
        waits for it at most ``HEALTH_WAIT_S`` and answers from the last known state, so a readiness probe
        with a short timeout (Kubernetes' default is 1 s) gets its 503 instead of a timeout. Once every pool
        was reached the answer is ``[]`` at once, for good."""
        if self.ready:
            return []
        if self._health_probe is None or self._health_probe.done():
            self._health_probe = asyncio.ensure_future(self.missing_pools())
            self._health_probe.add_done_callback(_consume_exception)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self._health_probe), timeout=HEALTH_WAIT_S)
        return self.missing()

    async def first_requests_probe(self) -> None:
        """Before this router's first requests: reach the pools once (:meth:`missing_pools`), unless
        ``/health`` on this ingress already reached them all. With several ingress replicas, ``/health``
        answered by one of them says nothing of the others' routers, and a router whose persistent handle has
        not resolved its replicas would spill a first greedy request to the standard lane. Requests arriving
        meanwhile share that one probe (each missing pool's ping waits at most ``READY_PROBE_TIMEOUT_S``, so
        a pool that is not up costs the first requests that much once); after it, reached or not, nobody
        waits for it again."""
        if self._first_probe is None:
            if self.ready:
                return
            self._first_probe = asyncio.ensure_future(self.missing_pools())
        if not self._first_probe.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(self._first_probe)


def _consume_exception(future: asyncio.Future) -> None:
    """Done callback of a background probe: its exception (if any) is read, so asyncio does not log it."""
    if not future.cancelled():
        future.exception()

"""A router's view of the persistent pool, fed by the engines' pushed load records.

Every engine pushes a :class:`~policy.pool.LoadRecord` to its application's pool board
(:mod:`replicas.pool_board`) when a persistent request starts or ends (before that request's last item goes
out), plus a heartbeat. :class:`PoolView` keeps one long poll open on the board (:meth:`PoolBoard.watch
<replicas.pool_board.PoolBoard.watch>`), so its :class:`~policy.pool.PoolModel` changes one actor hop after
an engine's load does, in every ingress replica alike. The router asks it :meth:`PoolView.free_replicas`.

The router's own persistent requests are known here at once (:meth:`PoolView.claim` when it starts
dispatching one, :meth:`PoolView.release` when it ended): they count against the pool whether or not a
record shows them yet, and a record that still lists one that ended does not make a replica look busy.
Other routers' requests are known only from the records; when they are all that keeps every replica busy,
the router may ask the board once more (:meth:`PoolView.recheck`) before it spills a request.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time

from policy.pool import PoolModel
from replicas.pool_board import WATCH_TIMEOUT_S, board_actor, board_name

logger = logging.getLogger(__name__)

WATCH_RETRY_S = 0.5
"""After a failed watch (the board restarting, or not created yet), wait this long before looking it up again."""
RECHECK_TIMEOUT_S = 0.25
"""How long :meth:`PoolView.recheck` (one board snapshot on the request path) may take; past it the request
goes by the view it has."""
ENDED_KEPT = 1024
"""How many of this router's ended persistent request ids it remembers (records may list them a moment longer)."""


class PoolView:
    """The persistent pool as this router sees it.

    Args:
        app_name: the Serve application (its board is ``board_name(app_name)``); None: no view (every
            replica is treated as free unless this router's own requests fill it).
        lane: the engines' lane that holds the persistent lane: ``persistent``, or ``colocated``.
    """

    def __init__(self, app_name: str | None, lane: str = "persistent"):
        self.app_name = app_name
        self.lane = lane
        self.model = PoolModel()
        self.version = -1
        self.updates = 0
        """Board versions this view took (each a change in some engine's load)."""
        self.rechecks = 0
        """Board snapshots taken on the request path before a spill (:meth:`recheck`)."""
        self.read_at = 0.0
        """``time.monotonic()`` when the view last took the board's records."""
        self._board = None
        self._watcher: asyncio.Task | None = None
        self._active: dict[str, None] = {}  # this router's persistent requests being dispatched or running
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()

    # ---- this router's own requests ------------------------------------------------------------
    def claim(self, request_id: str) -> None:
        """This router starts dispatching persistent request ``request_id`` (it counts from now)."""
        self._active[request_id] = None
        self._ended.pop(request_id, None)

    def release(self, request_id: str) -> None:
        """This router's persistent request ``request_id`` ended (done, spilled, rejected or failed)."""
        if request_id in self._active:
            del self._active[request_id]
            self._ended[request_id] = None
            while len(self._ended) > ENDED_KEPT:
                self._ended.popitem(last=False)

    @property
    def own_running(self) -> int:
        return len(self._active)

    def _own(self, request_id: str) -> bool:
        return request_id in self._active or request_id in self._ended

    # ---- the view ------------------------------------------------------------------------------
    @property
    def known(self) -> bool:
        """A first set of records arrived (before: the pool is unknown, not empty)."""
        return self.model.known

    def replicas(self) -> int | None:
        """Persistent replicas with a healthy decoder, or None while unknown."""
        return self.model.persistent_replicas(self.lane) if self.known else None

    def free_replicas(self) -> int | None:
        """Persistent replicas free now (:meth:`PoolModel.free_replicas <policy.pool.PoolModel.free_replicas>`
        with this router's own requests), or None while unknown."""
        if not self.known:
            return None
        return self.model.free_replicas(self.lane, self.own_running, _Own(self))

    def busy_with_others(self) -> bool:
        """No replica free, and other routers' requests are part of why (they may have ended since)."""
        free = self.free_replicas()
        return free is not None and free <= 0 and self.model.others_running(self.lane, _Own(self)) > 0

    # ---- feeding it ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start watching the board (once; no app: never). Call from the event loop."""
        if self._watcher is None and self.app_name is not None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def refresh(self) -> None:
        """Take the board's current records once (readiness: know the pool before the first request).

        Raises:
            Exception: the board could not be reached (the caller treats the pool as not reached yet).
        """
        if self.app_name is None:
            return
        board = await self._handle()
        self._take(*(await asyncio.wait_for(board.snapshot.remote(), WATCH_TIMEOUT_S)))

    async def recheck(self) -> None:
        """One board snapshot on the request path, at most ``RECHECK_TIMEOUT_S`` (errors ignored)."""
        self.rechecks += 1
        if self._board is None:
            return
        with contextlib.suppress(Exception):
            self._take(*(await asyncio.wait_for(self._board.snapshot.remote(), RECHECK_TIMEOUT_S)))

    async def _handle(self):
        if self._board is None:
            self._board = await asyncio.to_thread(board_actor, board_name(self.app_name))
        return self._board

    def _take(self, version: int, records) -> None:
        if version != self.version or not self.known:
            self.updates += 1
        self.version = version
        self.model.replace(records)
        self.read_at = time.monotonic()

    async def _watch(self) -> None:
        while True:
            try:
                board = await self._handle()
                update = await asyncio.wait_for(board.watch.remote(self.version, WATCH_TIMEOUT_S),
                                                WATCH_TIMEOUT_S + 5)
                self._take(*update)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - board gone or slow: keep the last view, look it up again
                logger.debug("pool board watch failed", exc_info=True)
                self._board = None
                await asyncio.sleep(WATCH_RETRY_S)

    def stats(self) -> dict:
        """``/debug/stats``: the replicas and free count as seen, and the records of the persistent engines."""
        return {"persistent_replicas_seen": self.replicas(), "persistent_free": self.free_replicas(),
                "pool_updates": self.updates, "pool_rechecks": self.rechecks,
                "pool": self.model.snapshot(self.lane)}


class _Own:
    """``in`` test for this router's own request ids (running or ended), without copying them."""

    __slots__ = ("view",)

    def __init__(self, view: PoolView):
        self.view = view

    def __contains__(self, request_id: object) -> bool:
        return isinstance(request_id, str) and self.view._own(request_id)

"""The pool board: where an application's engines push their load records and its routers watch them.

One board per Serve application, a small named Ray actor (:class:`PoolBoard`, ``num_cpus=0``, detached so
that no single engine or ingress owns it, restarted by Ray if its node goes; created by whichever comes first,
:func:`board_actor`). A restarted board is empty until the engines' next heartbeats. Engines push
a :class:`~policy.pool.LoadRecord` on every change of the requests they hold, and a heartbeat every
``HEARTBEAT_S`` (:class:`LoadPublisher`); the board keeps the newest record per engine, drops an engine not
heard from for ``RECORD_TTL_S`` (dead, or its replica replaced), and answers routers' long polls
(:meth:`PoolBoard.watch`) as soon as a record changes. So a router learns that a persistent replica freed up
one actor hop after the engine saw it, instead of at its next one-second poll of every engine.

A deleted application's board stays until the cluster stops (records of its engines expire); redeploying
an application of the same name reuses it. This module imports ``ray`` only inside functions and never
``ray.serve``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from policy.pool import LoadRecord

logger = logging.getLogger(__name__)

BOARD_PREFIX = "persistent-serve-pool@"
"""The board of application ``app`` is the named actor ``<prefix><app>``."""

BOARD_NAMESPACE = "persistent-serve"
"""Ray namespace of every board (Serve's replicas and the actors they create may run in different job
namespaces; one fixed namespace makes them all find the same board)."""

HEARTBEAT_S = 2.0
"""Seconds between an engine's heartbeat records (its load unchanged)."""
RECORD_TTL_S = 10.0
"""A record not renewed for this long is dropped: the engine died, or its replica was replaced."""
WATCH_TIMEOUT_S = 5.0
"""Longest a router's long poll waits for a change before asking again (so a dead board is noticed)."""


def board_name(app: str) -> str:
    """The board actor's name for Serve application ``app``."""
    return f"{BOARD_PREFIX}{app}"


class PoolBoard:
    """The newest :class:`LoadRecord` of every engine of one application (a Ray actor: :func:`board_actor`).

    ``version`` grows by one whenever the set of records changes in anything but a heartbeat (a record's
    load, an engine added or expired); :meth:`watch` returns as soon as it passes the caller's.
    """

    def __init__(self, ttl_s: float = RECORD_TTL_S):
        self.ttl_s = ttl_s
        self.version = int(time.time() * 1000)  # a restarted board starts past any version a router holds
        self._records: dict[str, LoadRecord] = {}
        self._heard: dict[str, float] = {}  # engine id -> time.monotonic() of its last record here
        self._changed: asyncio.Event | None = None
        self._expiry: asyncio.Task | None = None

    def _start(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
            self._expiry = asyncio.get_running_loop().create_task(self._expire_loop())
        return self._changed

    def _bump(self) -> None:
        self.version += 1
        changed = self._start()
        changed.set()
        self._changed = asyncio.Event()

    async def push(self, record: LoadRecord) -> int:
        """Take ``record`` unless a newer one of its engine is held; returns the board's version."""
        self._start()
        held = self._records.get(record.engine_id)
        if held is not None and held.order > record.order:
            return self.version
        self._heard[record.engine_id] = time.monotonic()
        self._records[record.engine_id] = record
        if not record.same_load(held):
            self._bump()
        return self.version

    async def snapshot(self) -> tuple[int, list[LoadRecord]]:
        """``(version, records)`` now."""
        self._start()
        self._expire(time.monotonic())
        return self.version, list(self._records.values())

    async def watch(self, version: int, timeout_s: float = WATCH_TIMEOUT_S) -> tuple[int, list[LoadRecord]]:
        """``(version, records)`` once the board's version differs from ``version``, or after ``timeout_s``."""
        changed = self._start()
        if self.version == version:
            try:
                await asyncio.wait_for(changed.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        return self.version, list(self._records.values())

    def _expire(self, now: float) -> None:
        gone = [k for k, t in self._heard.items() if now - t > self.ttl_s]
        for k in gone:
            self._records.pop(k, None)
            self._heard.pop(k, None)
        if gone:
            self._bump()

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            self._expire(time.monotonic())


def board_actor(name: str):
    """The handle of board ``name`` (in namespace ``BOARD_NAMESPACE``), created if it does not exist (blocking
    GCS calls: off the event loop). Engines and routers all call this, whichever starts first creates it."""
    import ray

    return ray.remote(PoolBoard).options(name=name, namespace=BOARD_NAMESPACE, get_if_exists=True,
                                         lifetime="detached", num_cpus=0, max_restarts=-1,
                                         max_concurrency=10_000).remote()


class LoadPublisher:
    """An engine's side: pushes its load records to its application's board.

    ``take_record`` builds the engine's current record (called from the actor's event loop or the heartbeat
    thread). :meth:`publish` is fire-and-forget; after a failed push (the board gone) the next heartbeat
    looks the board up again (creating it if need be). :meth:`start` pushes one record and waits for it (the
    engine is then on the board before its replica reports ready) and starts the heartbeat thread.

    Args:
        name: the board's name (:func:`board_name`).
        take_record: returns the engine's current :class:`LoadRecord`.
        heartbeat_s: seconds between heartbeats.
    """

    def __init__(self, name: str, take_record: Callable[[], LoadRecord], heartbeat_s: float = HEARTBEAT_S):
        self.name = name
        self.take_record = take_record
        self.heartbeat_s = heartbeat_s
        self._board = None
        self._lock = threading.Lock()
        self.failures = 0

    def start(self, timeout_s: float = 10.0) -> None:
        """Push the first record (waiting at most ``timeout_s``; a failure is logged, not raised) and start the
        heartbeat thread."""
        import ray

        try:
            ray.get(self._handle().push.remote(self.take_record()), timeout=timeout_s)
        except Exception:  # noqa: BLE001 - routing works without the board (every replica looks free)
            logger.warning("pool board %s: first record not pushed", self.name, exc_info=True)
            self._board = None
        threading.Thread(target=self._heartbeat, name="load-heartbeat", daemon=True).start()

    def _handle(self, resolve: bool = True):
        with self._lock:
            if self._board is None and resolve:
                self._board = board_actor(self.name)
            return self._board

    def publish(self, resolve: bool = False) -> None:
        """Push the engine's current record (fire-and-forget). Without a board handle (the board was gone at
        the last push) only ``resolve`` looks it up again: a blocking GCS call, so the heartbeat thread does."""
        try:
            board = self._handle(resolve)
            if board is not None:
                board.push.remote(self.take_record()).future().add_done_callback(self._pushed)
        except Exception:  # noqa: BLE001 - the board is gone: look it up again on the next heartbeat
            self._lost()

    def _pushed(self, future) -> None:
        if future.exception() is not None:
            self._lost()

    def _lost(self) -> None:
        self.failures += 1
        with self._lock:
            self._board = None

    def _heartbeat(self) -> None:
        while True:
            time.sleep(self.heartbeat_s)
            self.publish(resolve=True)

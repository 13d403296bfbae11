"""Dispatch: send one request to one replica entry and read its items, whichever way they come back.

A replica's output reaches the router one of two ways (docs/architecture.md, "Direct output streams"):
through Ray (the Serve call's own stream: ``Started``, rejections, errors, and every chunk when the direct
stream is off or not connected yet) or over the engine's direct connection to this router's
:class:`~replicas.stream_channel.StreamListener` (frames of chunks, the last marked final, announced at the
end of the Ray stream by a :class:`~replicas.stream_channel.Relayed`). :class:`Dispatch` hides which: it
yields the items of one attempt in order and ends at the request's end; closed early, it cancels the Serve
call (the replica then cancels the engine's work) and stops reading its direct stream.

:class:`OutputStreams` is the router's side of both: it owns the listener (started once, on the node's
address) and opens one :class:`Dispatch` per attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator

from ray.exceptions import RayActorError
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
    RequestCancelledError,
)

from replicas.messages import GenerateRequest, GenerationError, Rejection, Started
from replicas.stream_channel import Relayed, StreamListener

logger = logging.getLogger(__name__)

REPLICA_DIED = "replica_died"
"""``GenerationError.reason`` when the replica serving a request died under it (Ray/Serve raised)."""

DIRECT_GRACE_S = 5.0
"""How long a dispatch whose Serve stream has ended waits for the rest of its direct-stream output before it
ends with a ``stream_lost`` error (the frames were written before the Ray call returned, so they are normally
there first)."""

_REPLICA_FAILURES = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)


class OutputStreams:
    """One router's ways back for replica output: its direct-stream listener (when on) and Ray.

    Args:
        direct_stream: engines send output straight to this router's listener; False: everything through Ray.
    """

    def __init__(self, direct_stream: bool = True):
        self.direct_stream = direct_stream
        self.listener: StreamListener | None = None
        self._lock = asyncio.Lock()
        self.direct_dispatches = 0
        """Dispatches whose output came over the direct stream (the rest came back through Ray)."""

    async def start(self) -> None:
        """Start the listener on this node's address (once; direct stream off: never). A listener that cannot
        bind turns the direct stream off for this router (output then comes back through Ray)."""
        if not self.direct_stream or self.listener is not None:
            return
        async with self._lock:
            if self.listener is not None:
                return
            listener = StreamListener(_node_address())
            try:
                await listener.start()
            except OSError as exc:
                logger.warning("direct stream: cannot listen on %s (%s); output comes back through Ray",
                               listener.host, exc)
                self.direct_stream = False
                return
            self.listener = listener

    def send(self, entry, request: GenerateRequest, lane: str) -> Dispatch:
        """Send ``request`` through ``entry`` (a streaming handle method, e.g.
        ``handle.options(stream=True).generate``) as one attempt; ``lane`` names the lane in errors."""
        return Dispatch(self, entry, request, lane)

    def stats(self) -> dict:
        """``/debug/stats`` ``router.direct_stream``: on/off, dispatches served over it, the listener's counters."""
        return {"enabled": self.direct_stream, "dispatches": self.direct_dispatches,
                **(self.listener.stats() if self.listener is not None else {})}


class Dispatch:
    """One attempt of one request to one replica entry, and its items.

    With the direct stream on, the request goes out with a fresh
    :class:`~replicas.stream_channel.ReplyTo` (:attr:`request` is the request as sent). Read it with
    :meth:`started` (persistent entries: wait for the replica to take it) and/or :meth:`items`; :meth:`close`
    (also the end of :meth:`items`) releases it and, unless it ended, cancels the Serve call.

    Per-dispatch controls go here: the dispatch holds the request's Serve call and its direct-stream key,
    which is what a later ``stop_choice(index)`` (stop one choice of an ``n > 1`` request over the listener's
    back-channel) needs.
    """

    def __init__(self, streams: OutputStreams, entry, request: GenerateRequest, lane: str):
        self._streams = streams
        self.lane = lane
        self._queue: asyncio.Queue | None = None
        if streams.listener is not None:
            reply_to, self._queue = streams.listener.open()
            request = dataclasses.replace(request, reply_to=reply_to)
        self.request = request
        self._response = entry.remote(request)
        self._ended = False
        self._closed = False

    async def started(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` seconds for the replica's first item; True when it is :class:`Started`
        (a persistent replica took the request). Otherwise (still queued, or refused by Serve's
        ``max_queued_requests``) the dispatch is closed and cancelled, and False returned.

        Raises:
            asyncio.CancelledError: the caller was cancelled while waiting (the dispatch is cancelled too).
        """
        first = asyncio.ensure_future(self._response.__anext__())
        try:
            done, _ = await asyncio.wait({first}, timeout=timeout_s)
        except asyncio.CancelledError:  # the client went away while queued
            first.cancel()
            self.close()
            raise
        if done and first.exception() is None and isinstance(first.result(), Started):
            return True
        if not done:
            first.cancel()
        self.close()
        with contextlib.suppress(BaseException):
            await first
        return False

    def close(self) -> None:
        """Stop reading this dispatch: its direct-stream key is closed, and the Serve call cancelled unless the
        request ended. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._queue is not None:
            self._streams.listener.close(self.request.reply_to.key)
        if not self._ended:
            self._response.cancel()

    async def items(self) -> AsyncIterator:
        """The attempt's items (chunks, a rejection, an error): those of its Serve stream (replica failures turned
        into a :class:`GenerationError`, as :func:`ended_by_error`) and, with the direct stream, those its engine
        sent over it.

        Ends at the engine's final frame (not waiting for the Ray call to return), or when the Serve stream ends
        and every item its :class:`Relayed` announced has arrived; one that has not within ``DIRECT_GRACE_S`` of
        the Serve stream's end ends the request with a ``stream_lost`` error. Closed early (client gone, caller
        stopped reading), it cancels the Serve call.

        Raises:
            BackPressureError: Serve refused the request (the pool's queue is full).
        """
        request, lane = self.request, self.lane
        ray_items = ended_by_error(self._response, request.request_id, lane)
        try:
            if self._queue is None:
                async with contextlib.aclosing(ray_items) as stream:
                    async for item in stream:
                        self._ended = isinstance(item, (Rejection, GenerationError))  # either ends the request
                        yield item
                self._ended = True
                return
            async for item in self._merged(ray_items):
                yield item
        finally:
            self.close()

    async def _merged(self, ray_items) -> AsyncIterator:
        queue = self._queue
        pump = asyncio.ensure_future(_pump(ray_items, queue))
        expected, got, ray_ended = None, 0, False
        try:
            while not self._ended:
                if ray_ended:
                    try:
                        entry = await asyncio.wait_for(queue.get(), DIRECT_GRACE_S)
                    except asyncio.TimeoutError:
                        self._ended = True
                        yield GenerationError(self.request.request_id, "the engine's direct stream lost output; "
                                              "retry the request", self.lane, "postlaunch", "stream_lost")
                        return
                else:
                    entry = await queue.get()
                if entry is _RAY_END:
                    ray_ended = True
                    self._ended = expected is None or got >= expected
                elif isinstance(entry, _RayItem):
                    item = entry.item
                    if isinstance(item, BaseException):
                        self._ended = True
                        raise item
                    if isinstance(item, Relayed):
                        expected = item.items
                        self._ended = got >= expected
                        continue
                    # a rejection or an error ends it; chunks through Ray (no connection yet) end with the Ray call
                    self._ended = isinstance(item, (Rejection, GenerationError))
                    yield item
                else:
                    items, final = entry
                    self._streams.direct_dispatches += not got
                    got += len(items)
                    self._ended = final
                    for item in items:
                        yield item
        finally:
            if not self._ended:  # stopped early (the client went away): stop reading the Serve stream too
                pump.cancel()


class _RayItem:
    """An item (or exception) from a dispatch's Serve stream, in the dispatch's queue."""

    __slots__ = ("item",)

    def __init__(self, item):
        self.item = item


_RAY_END = object()
"""Queue entry: the dispatch's Serve stream has ended."""


async def _pump(items, queue: asyncio.Queue) -> None:
    """Move a Serve stream's items (and an exception it raises) into a dispatch's queue, then ``_RAY_END``."""
    try:
        async for item in items:
            queue.put_nowait(_RayItem(item))
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # noqa: BLE001 - handed to the reader, which raises it
        queue.put_nowait(_RayItem(exc))
    queue.put_nowait(_RAY_END)


async def ended_by_error(stream, request_id: str, lane: str):
    """Pass ``stream``'s items through; a replica that dies under it (Ray/Serve raise) ends it with a
    :class:`GenerationError` (reason ``replica_died``, or ``internal_error`` for anything unexpected)
    instead of an exception, so the client gets an error event and the end of its stream. A stream cancelled
    by its own reader (Serve's ``RequestCancelledError``) just ends: nobody reads it any more.

    Raises:
        BackPressureError: passed on (the caller answers 503).
    """
    try:
        async for item in stream:
            yield item
    except BackPressureError:
        raise
    except RequestCancelledError:  # the reader closed the dispatch (a stop string ended it, or the client left)
        return
    except _REPLICA_FAILURES as exc:
        logger.warning("request %s: the %s replica serving it died or vanished: %s", request_id, lane,
                       type(exc).__name__)
        yield GenerationError(request_id, f"the {lane} replica serving this request died ({type(exc).__name__}); "
                              "the request was lost, retry it", lane, "postlaunch", REPLICA_DIED)
    except Exception as exc:  # noqa: BLE001 - never end a client's stream without an error event
        logger.exception("request %s failed on the %s lane", request_id, lane)
        yield GenerationError(request_id, f"internal error on the {lane} lane ({type(exc).__name__})", lane,
                              "postlaunch", "internal_error")


def _node_address() -> str:
    """This process's Ray node IP address (engines on other nodes can reach it), or 127.0.0.1 outside Ray."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"

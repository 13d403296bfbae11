"""Direct output streams: an engine actor sends a request's output straight to the process that reads
it (the ingress replica running the router), over one TCP connection per (engine actor, ingress) pair,
instead of yielding each item back through two Ray hops (engine actor → replica → ingress).

Why: on the H200 each item relayed that way cost the first token about 4-6 ms and every later chunk
2.6-4 ms (``docs/decisions/0003-direct-output-streams.md``); one frame on a socket the two processes
already hold costs a write, a read and an unpickle. The request itself still goes through Serve
(router → replica → engine actor), so Serve keeps choosing, admitting, health-checking and autoscaling
replicas; only the way back changes. How it fits together: ``docs/architecture.md``, "Direct output
streams".

Wire format (one TCP stream, sender → listener only):

* hello: ``HELLO`` followed by the listener's token (``TOKEN_BYTES`` hex digits, ASCII). The listener
  closes a connection whose hello does not match before it reads anything else, so only a process
  that was handed a :class:`ReplyTo` (by the router, inside a ``GenerateRequest``) can send frames.
* frames: a 4-byte big-endian length, then a pickle of ``(key, items, final)``: the dispatch key of
  :class:`ReplyTo`, a list of :mod:`replicas.messages` objects and whether they end the dispatch.

This module needs neither Ray nor torch (asyncio and the standard library only).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import pickle
import secrets
import struct
import time
import uuid
from dataclasses import dataclass

logger = logging.getLogger(__name__)

HELLO = b"PSDS1"
"""First bytes a sender writes on a new connection (protocol name and version)."""
TOKEN_BYTES = 32
"""Length of the listener's token in hex digits (128 random bits)."""
MAX_FRAME_BYTES = 64 << 20
"""A frame longer than this (64 MiB) closes the connection: no request's chunks come near it."""
_HEADER = struct.Struct("!I")
RECONNECT_S = 1.0
"""After a failed connect, a sender waits this long before it tries that listener again (meanwhile its
requests' output goes back through Ray)."""


@dataclass(frozen=True)
class ReplyTo:
    """Where one dispatch's output goes: the listener's address and token, and the dispatch's key.

    Attributes:
        host: the listener's IP address (its Ray node's address).
        port: its TCP port.
        token: its secret (``TOKEN_BYTES`` hex digits), sent in the hello.
        key: this dispatch (one per attempt of one request); frames carry it.
    """

    host: str
    port: int
    token: str
    key: str

    @property
    def address(self) -> tuple[str, int, str]:
        return self.host, self.port, self.token


@dataclass
class Relayed:
    """The last item an engine yields through Ray for a dispatch whose output went over the direct
    stream: ``items`` is how many items it sent there (the reader waits for all of them)."""

    key: str
    items: int


class StreamListener:
    """The reading end (one per ingress process): accepts senders' connections, hands each dispatch's
    frames to the queue opened for its key.

    Use from one event loop: :meth:`start`, then per dispatch :meth:`open` (before the request is sent),
    read the queue, :meth:`close`. Each queue entry is ``(items, final)``.
    """

    def __init__(self, host: str):
        self.host = host
        self.port: int | None = None
        self.token = secrets.token_hex(TOKEN_BYTES // 2)
        self._queues: dict[str, asyncio.Queue] = {}
        self._server: asyncio.AbstractServer | None = None
        self.connections = 0
        self.frames = 0
        self.items = 0
        self.refused = 0

    async def start(self) -> None:
        """Listen on ``host`` at a free port.

        Raises:
            OSError: the address cannot be bound.
        """
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    def open(self) -> tuple[ReplyTo, asyncio.Queue]:
        """A new dispatch: its :class:`ReplyTo` and the queue its frames go to (``(items, final)``)."""
        key = uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[key] = queue
        return ReplyTo(self.host, self.port, self.token, key), queue

    def close(self, key: str) -> None:
        """Forget a dispatch; frames for it that arrive later are dropped."""
        self._queues.pop(key, None)

    def stats(self) -> dict:
        return {"address": f"{self.host}:{self.port}", "connections": self.connections, "frames": self.frames,
                "items": self.items, "refused": self.refused, "open_dispatches": len(self._queues)}

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello = await reader.readexactly(len(HELLO) + TOKEN_BYTES)
            if not hmac.compare_digest(hello, HELLO + self.token.encode()):
                self.refused += 1
                logger.warning("direct stream: refused a connection from %s (bad hello)",
                               writer.get_extra_info("peername"))
                return
            self.connections += 1
            while True:
                (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
                if size > MAX_FRAME_BYTES:
                    logger.warning("direct stream: frame of %d bytes, closing the connection", size)
                    return
                key, items, final = pickle.loads(await reader.readexactly(size))
                self.frames += 1
                self.items += len(items)
                queue = self._queues.get(key)
                if queue is not None:
                    queue.put_nowait((items, final))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the sender went away (its engine died or was replaced)
        finally:
            writer.close()


class _Channel:
    """One connection from this engine to one listener.

    Frames sent in the same turn of the event loop go out in one socket write: the engine loop hands a
    step's items over at once (``replicas.engine_actor``), each request's reader sends its frame in that
    turn, so a step reaches each listener as one write, however many requests it served there."""

    def __init__(self, address: tuple[str, int, str]):
        self.address = address
        self.writer: asyncio.StreamWriter | None = None
        self.failed_at: float | None = None
        self._connecting: asyncio.Task | None = None
        self._pending: list[bytes] = []
        self._written: asyncio.Future | None = None
        self.frames = 0
        self.writes = 0

    @property
    def ready(self) -> bool:
        return self.writer is not None and not self.writer.is_closing()

    def connect_soon(self) -> None:
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.ensure_future(self._connect())

    async def _connect(self) -> None:
        host, port, token = self.address
        try:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(HELLO + token.encode())
            await writer.drain()
        except OSError as exc:
            self.failed_at = time.monotonic()
            logger.warning("direct stream: cannot reach %s:%s (%s); output goes back through Ray", host, port, exc)
            return
        self.writer, self.failed_at = writer, None
        asyncio.ensure_future(self._watch(reader, writer))

    async def _watch(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The listener never writes: EOF (or a reset) means it closed, so drop the connection."""
        with contextlib.suppress(Exception):
            await reader.read()
        writer.close()
        if self.writer is writer:
            self.writer = None

    async def send(self, key: str, items: list, final: bool) -> None:
        """Queue one frame for this turn's write and wait until it is written (and while the socket's
        buffer is over its high-water mark).

        Raises:
            ConnectionError: the connection is closed or broke.
        """
        if not self.ready:
            raise ConnectionError("the direct stream's connection is closed")
        payload = pickle.dumps((key, items, final), protocol=pickle.HIGHEST_PROTOCOL)
        self._pending.append(_HEADER.pack(len(payload)) + payload)
        self.frames += 1
        if self._written is None:
            loop = asyncio.get_running_loop()
            self._written = loop.create_future()
            loop.call_soon(self._write_pending)
        await asyncio.shield(self._written)

    def _write_pending(self) -> None:
        """Write every frame queued this turn in one call, then let their senders go once drained."""
        data, self._pending = b"".join(self._pending), []
        written, self._written = self._written, None
        writer = self.writer
        if writer is None or writer.is_closing():
            written.set_exception(ConnectionError("the direct stream's connection is closed"))
            written.exception()  # retrieved: a sender that was cancelled meanwhile leaves no warning
            return
        writer.write(data)
        self.writes += 1
        asyncio.ensure_future(self._drained(writer, written))

    @staticmethod
    async def _drained(writer: asyncio.StreamWriter, written: asyncio.Future) -> None:
        try:
            await writer.drain()
        except Exception as exc:  # noqa: BLE001 - every waiting sender must be let go
            written.set_exception(ConnectionError(f"the direct stream broke: {exc}"))
            written.exception()
            return
        written.set_result(None)


class StreamSenders:
    """The sending end (one per engine actor): one connection per listener, opened on first use.

    :meth:`channel` never waits: a listener not connected yet gets a connect started in the background
    and None back, so that dispatch's output goes through Ray and the next one uses the connection.
    """

    def __init__(self):
        self._channels: dict[tuple[str, int, str], _Channel] = {}

    def channel(self, reply_to: ReplyTo) -> _Channel | None:
        """The connected channel to ``reply_to``'s listener, or None (connect started, or retried after
        ``RECONNECT_S`` once a connect failed)."""
        channel = self._channels.get(reply_to.address)
        if channel is None:
            channel = self._channels[reply_to.address] = _Channel(reply_to.address)
        if channel.ready:
            return channel
        if channel.failed_at is None or time.monotonic() - channel.failed_at >= RECONNECT_S:
            channel.connect_soon()
        return None

    def stats(self) -> dict:
        return {"connected": sum(c.ready for c in self._channels.values()), "known": len(self._channels),
                "frames": sum(c.frames for c in self._channels.values()),
                "writes": sum(c.writes for c in self._channels.values())}

"""A real OTLP/HTTP trace receiver, for tests and for the latency breakdown of ``benchmarks.hops``.

:class:`OTLPReceiver` is not a mock: it is a small HTTP server that speaks the
OTLP/HTTP protobuf protocol (``POST /v1/traces`` with an
``ExportTraceServiceRequest`` body, optionally gzip-compressed, answered with an
``ExportTraceServiceResponse``), exactly what a collector such as the
OpenTelemetry Collector accepts. Point the real ``OTLPSpanExporter`` at
:attr:`OTLPReceiver.endpoint` and assert on what arrived over the wire::

    with OTLPReceiver() as receiver:
        setup_tracing(TracingConfig(exporter="otlp", endpoint=receiver.endpoint))
        ...
        force_flush()
        (route,) = receiver.wait_for(lambda span: span.name == "route")
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

TRACES_PATH = "/v1/traces"
_PROTOBUF = "application/x-protobuf"


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as it arrived at the receiver, simplified for assertions.

    Ids are lowercase hex (trace id 32 characters, span ids 16); a root span has
    ``parent_span_id == ""``. ``events`` holds ``(name, attributes)`` pairs in order.
    ``start_ns`` / ``end_ns``: the span's start and end, Unix time in nanoseconds (the
    exporting process's wall clock).
    """

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    service_name: str = ""
    start_ns: int = 0
    end_ns: int = 0


def _any_value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_any_value(item) for item in value.array_value.values]
    if kind == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    return getattr(value, kind)


def _attributes(pairs: list[KeyValue]) -> dict[str, Any]:
    return {pair.key: _any_value(pair.value) for pair in pairs}


def _spans_of(request: ExportTraceServiceRequest) -> list[ReceivedSpan]:
    received = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        service_name = str(resource.get("service.name", ""))
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                received.append(
                    ReceivedSpan(
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        attributes=_attributes(span.attributes),
                        events=[
                            (event.name, _attributes(event.attributes)) for event in span.events
                        ],
                        service_name=service_name,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                    )
                )
    return received


class _Handler(BaseHTTPRequestHandler):
    server: _ReceiverServer
    protocol_version = "HTTP/1.1"  # keep-alive, like a real collector

    def do_POST(self) -> None:  # noqa: N802 (http.server naming)
        if self.path.split("?", 1)[0] != TRACES_PATH:
            self._reply(404, b"", "text/plain")
            return
        body = self._read_body()
        content_type = self.headers.get("Content-Type", "").split(";", 1)[0].strip()
        if content_type != _PROTOBUF:
            self._reply(415, b"only application/x-protobuf is supported", "text/plain")
            return
        encoding = self.headers.get("Content-Encoding", "").strip().lower()
        try:
            if encoding == "gzip":
                body = gzip.decompress(body)
            elif encoding == "deflate":
                body = zlib.decompress(body)
            elif encoding not in ("", "identity"):
                self._reply(415, f"unsupported Content-Encoding {encoding}".encode(), "text/plain")
                return
            request = ExportTraceServiceRequest.FromString(body)
        except Exception as exc:  # malformed payload: answer like a collector would
            self._reply(400, f"cannot decode request: {exc}".encode(), "text/plain")
            return
        self.server.receiver._store(_spans_of(request), encoding or "identity")
        self._reply(200, ExportTraceServiceResponse().SerializeToString(), _PROTOBUF)

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";", 1)[0].strip(), 16)
                if size == 0:
                    self.rfile.readline()  # blank line after the last chunk
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()  # CRLF after each chunk
        return self.rfile.read(int(self.headers.get("Content-Length", "0")))

    def _reply(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # keep pytest output clean


class _ReceiverServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, receiver: OTLPReceiver) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.receiver = receiver


class OTLPReceiver:
    """An OTLP/HTTP (protobuf) trace receiver on 127.0.0.1, on a free port.

    Use as a context manager (or call :meth:`start` / :meth:`stop`). The server
    runs in a daemon thread; each request is handled on its own thread. Spans are
    kept in arrival order until :meth:`clear`. ``content_encodings`` lists the
    ``Content-Encoding`` of every accepted export request (``"identity"`` when
    uncompressed).
    """

    def __init__(self) -> None:
        self._server: _ReceiverServer | None = None
        self._thread: threading.Thread | None = None
        self._spans: list[ReceivedSpan] = []
        self._changed = threading.Condition()
        self.content_encodings: list[str] = []

    def start(self) -> OTLPReceiver:
        """Bind to a free port and start serving. Returns ``self``."""
        if self._server is not None:
            raise RuntimeError("OTLPReceiver already started")
        self._server = _ReceiverServer(self)
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="otlp-receiver",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket. Safe to call twice."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5)

    def __enter__(self) -> OTLPReceiver:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        """The TCP port the receiver listens on."""
        if self._server is None:
            raise RuntimeError("OTLPReceiver is not running")
        return self._server.server_address[1]

    @property
    def endpoint(self) -> str:
        """Full traces URL for an OTLP/HTTP exporter, ``http://127.0.0.1:PORT/v1/traces``."""
        return f"http://127.0.0.1:{self.port}{TRACES_PATH}"

    def _store(self, spans: list[ReceivedSpan], encoding: str) -> None:
        with self._changed:
            self._spans.extend(spans)
            self.content_encodings.append(encoding)
            self._changed.notify_all()

    def spans(self) -> list[ReceivedSpan]:
        """A snapshot of every span received since start (or the last :meth:`clear`)."""
        with self._changed:
            return list(self._spans)

    def clear(self) -> None:
        """Forget every span and encoding received so far."""
        with self._changed:
            self._spans.clear()
            self.content_encodings.clear()

    def wait_for(
        self, predicate: Callable[[ReceivedSpan], bool], timeout: float = 20.0
    ) -> list[ReceivedSpan]:
        """Wait until at least one received span satisfies ``predicate``.

        Args:
            predicate: called on each received span.
            timeout: seconds to wait at most.

        Returns:
            Every received span that satisfies ``predicate`` (at least one).

        Raises:
            AssertionError: nothing matched within ``timeout``; the message lists
                the names of the spans that did arrive.
        """
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                matches = [span for span in self._spans if predicate(span)]
                if matches:
                    return matches
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    seen = [span.name for span in self._spans]
                    raise AssertionError(
                        f"no matching span received within {timeout} s; seen: {seen}"
                    )
                self._changed.wait(min(remaining, 0.1))

"""OTLP over gRPC: the real gRPC exporter sends our spans to a real gRPC TraceService started here."""

from __future__ import annotations

import threading
from concurrent import futures

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc.trace_exporter")

from opentelemetry.proto.collector.trace.v1 import (  # noqa: E402
    trace_service_pb2,
    trace_service_pb2_grpc,
)

from ops.telemetry import tracing  # noqa: E402
from ops.telemetry.tracing import (  # noqa: E402
    TracingConfig,
    force_flush,
    record_fallback,
    route_span,
    setup_tracing,
)


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.spans: list[tuple[str, dict]] = []
        self.lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 (gRPC naming)
        with self.lock:
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        attrs = {kv.key: kv.value.string_value for kv in span.attributes}
                        self.spans.append((span.name, attrs))
        return trace_service_pb2.ExportTraceServiceResponse()


def test_spans_reach_a_grpc_collector(monkeypatch):
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_TRACES_SAMPLER"):
        monkeypatch.delenv(name, raising=False)
    collector = _Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    tracing.shutdown()
    try:
        setup_tracing(TracingConfig(exporter="otlp", protocol="grpc", endpoint=f"http://127.0.0.1:{port}"))
        with route_span("standard", "auto", "non_greedy", request_id="grpc-1"):
            record_fallback("non_greedy", "prelaunch", request_id="grpc-1", lane="standard")
        assert force_flush()
        names = {name for name, attrs in collector.spans if attrs.get("request.id") == "grpc-1"}
        assert names == {"route", "fallback"}
    finally:
        tracing.shutdown()
        server.stop(0)

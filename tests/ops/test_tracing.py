"""Tracing set-up and span helpers, checked end to end through a real OTLP/HTTP receiver."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ops.telemetry import tracing
from ops.telemetry.otlp_receiver import OTLPReceiver, ReceivedSpan
from ops.telemetry.tracing import (
    ATTR_FALLBACK_REASON,
    ATTR_FALLBACK_STAGE,
    ATTR_LANE,
    ATTR_MODE,
    ATTR_REASON,
    ATTR_REQUEST_ID,
    SPAN_FALLBACK,
    SPAN_ROUTE,
    TracingConfig,
    force_flush,
    record_fallback,
    route_span,
    setup_tracing,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

_OTEL_ENV = (
    "OTEL_TRACES_EXPORTER",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_SERVICE_NAME",
    "OTEL_EXPORTER_OTLP_COMPRESSION",
    "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION",
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
)


@pytest.fixture(autouse=True)
def clean_tracing(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts from a clean environment and leaves no provider behind."""
    for name in _OTEL_ENV:
        monkeypatch.delenv(name, raising=False)
    tracing.shutdown()
    yield
    tracing.shutdown()


@pytest.fixture
def receiver() -> Iterator[OTLPReceiver]:
    with OTLPReceiver() as running:
        yield running
        tracing.shutdown()  # flush while the receiver still listens


def _otlp(receiver: OTLPReceiver, **overrides: object) -> TracingConfig:
    return TracingConfig(exporter="otlp", endpoint=receiver.endpoint, **overrides)


def _named(name: str, request_id: str) -> Callable[[ReceivedSpan], bool]:
    def predicate(span: ReceivedSpan) -> bool:
        return span.name == name and span.attributes.get(ATTR_REQUEST_ID) == request_id

    return predicate


def test_route_and_fallback_spans_reach_the_collector(receiver: OTLPReceiver) -> None:
    setup_tracing(_otlp(receiver, service_name="tracing-test"))

    with route_span("standard", "auto", "queued_work", request_id="req-1", model="m") as span:
        assert span.is_recording()
        record_fallback("queued_work", "prelaunch", request_id="req-1", lane="standard")
    assert force_flush()

    (route,) = receiver.wait_for(_named(SPAN_ROUTE, "req-1"))
    (fallback,) = receiver.wait_for(_named(SPAN_FALLBACK, "req-1"))

    assert route.attributes == {
        ATTR_LANE: "standard",
        ATTR_MODE: "auto",
        ATTR_REASON: "queued_work",
        ATTR_REQUEST_ID: "req-1",
        "model": "m",
    }
    assert route.parent_span_id == ""
    assert route.service_name == "tracing-test"
    assert len(route.trace_id) == 32 and len(route.span_id) == 16

    assert fallback.trace_id == route.trace_id
    assert fallback.parent_span_id == route.span_id
    expected = {
        ATTR_FALLBACK_REASON: "queued_work",
        ATTR_FALLBACK_STAGE: "prelaunch",
        ATTR_LANE: "standard",
        ATTR_REQUEST_ID: "req-1",
    }
    assert fallback.attributes == expected
    assert route.events == [(SPAN_FALLBACK, expected)]


def test_route_span_omits_missing_reason_and_request_id(receiver: OTLPReceiver) -> None:
    setup_tracing(_otlp(receiver))
    with route_span("persistent", "required", None, tag="no-reason"):
        pass
    assert force_flush()
    (route,) = receiver.wait_for(
        lambda span: span.name == SPAN_ROUTE and span.attributes.get("tag") == "no-reason"
    )
    assert route.attributes == {ATTR_LANE: "persistent", ATTR_MODE: "required", "tag": "no-reason"}
    assert route.events == []
    assert route.service_name == "persistent-serve"


def test_route_span_records_an_exception(receiver: OTLPReceiver) -> None:
    setup_tracing(_otlp(receiver))
    with pytest.raises(RuntimeError, match="boom"):
        with route_span("persistent", "auto", None, request_id="req-err"):
            raise RuntimeError("boom")
    assert force_flush()
    (route,) = receiver.wait_for(_named(SPAN_ROUTE, "req-err"))
    assert [name for name, _ in route.events] == ["exception"]


def test_gzip_compressed_exports_are_decoded(
    receiver: OTLPReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "gzip")
    setup_tracing(_otlp(receiver))
    with route_span("standard", "off", "disabled", request_id="req-gz"):
        pass
    assert force_flush()
    receiver.wait_for(_named(SPAN_ROUTE, "req-gz"))
    assert "gzip" in receiver.content_encodings


def test_unknown_fallback_stage_raises() -> None:
    setup_tracing(TracingConfig(exporter="none"))
    with route_span("standard", "auto", None):
        with pytest.raises(ValueError, match="stage"):
            record_fallback("queued_work", "midlaunch")  # type: ignore[arg-type]


def test_exporter_none_sends_nothing(
    receiver: OTLPReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Even with the collector advertised in the environment, "none" exports nothing.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.endpoint)
    provider = setup_tracing(TracingConfig(exporter="none"))
    with route_span("standard", "auto", "non_greedy", request_id="req-none"):
        record_fallback("non_greedy", "prelaunch", request_id="req-none", lane="standard")
    assert provider.force_flush()
    with pytest.raises(AssertionError, match="no matching span"):
        receiver.wait_for(lambda span: True, timeout=0.5)
    assert receiver.spans() == []


def test_console_exporter_prints_spans(capfd: pytest.CaptureFixture[str]) -> None:
    # ConsoleSpanExporter binds sys.stdout when built, so build it under capture.
    setup_tracing(TracingConfig(exporter="console"))
    with route_span("persistent", "auto", None, request_id="req-console"):
        record_fallback("persistent_capacity", "prelaunch", lane="standard")
    sys.stdout.flush()
    out = capfd.readouterr().out
    assert '"name": "route"' in out
    assert '"name": "fallback"' in out
    assert '"request.id": "req-console"' in out
    assert '"fallback.reason": "persistent_capacity"' in out


def test_setup_is_idempotent_and_replaceable(receiver: OTLPReceiver) -> None:
    first = setup_tracing(TracingConfig(exporter="none"))
    assert setup_tracing(TracingConfig(exporter="none")) is first

    second = setup_tracing(_otlp(receiver))
    assert second is not first
    assert setup_tracing(_otlp(receiver)) is second

    # get_tracer() follows the module's provider, not the (unchangeable) global one.
    with route_span("standard", "off", "disabled", request_id="req-replaced"):
        pass
    assert force_flush()
    receiver.wait_for(_named(SPAN_ROUTE, "req-replaced"))


def test_env_driven_setup_exports_to_env_endpoint(
    receiver: OTLPReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp_proto_http")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.port}/")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    setup_tracing()
    with route_span("standard", "auto", "logprobs", request_id="req-env"):
        pass
    assert force_flush()
    (route,) = receiver.wait_for(_named(SPAN_ROUTE, "req-env"))
    assert route.service_name == "from-env"


def test_resolved_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert TracingConfig().resolved() == TracingConfig(
        exporter="none",
        endpoint="http://localhost:4318/v1/traces",
        service_name="persistent-serve",
        protocol="http/protobuf",
        schedule_delay_ms=200,
        sample_ratio=1.0,
    )

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "svc-env")
    resolved = TracingConfig().resolved()
    assert resolved.exporter == "console"
    assert resolved.endpoint == "http://collector:4318/v1/traces"
    assert resolved.service_name == "svc-env"
    assert resolved.resolved() == resolved

    # The signal-specific endpoint is used as is and wins over the base endpoint.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://other:9999/custom")
    assert TracingConfig().resolved().endpoint == "http://other:9999/custom"

    # Explicit fields win over the environment.
    explicit = TracingConfig(
        exporter="otlp", endpoint="http://x:1/v1/traces", service_name="mine"
    ).resolved()
    assert (explicit.exporter, explicit.endpoint, explicit.service_name) == (
        "otlp",
        "http://x:1/v1/traces",
        "mine",
    )


def test_resolved_grpc_endpoint_and_aliases(monkeypatch: pytest.MonkeyPatch) -> None:
    assert TracingConfig(exporter="otlp_proto_http").exporter == "otlp"  # type: ignore[arg-type]

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    assert TracingConfig().resolved().endpoint == "http://localhost:4317"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    grpc = TracingConfig().resolved()
    assert (grpc.protocol, grpc.endpoint) == ("grpc", "http://collector:4317")


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("OTEL_TRACES_EXPORTER", "zipkin"),
        ("OTEL_TRACES_EXPORTER", "otlp,console"),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
    ],
)
def test_resolved_rejects_unsupported_environment(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=re.escape(value)):
        TracingConfig().resolved()


def test_grpc_without_its_package_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes the import fail even where grpc is installed.
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc", None)
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    config = TracingConfig(exporter="otlp", protocol="grpc")
    with pytest.raises(RuntimeError, match="opentelemetry-exporter-otlp-proto-grpc"):
        setup_tracing(config)


def test_force_flush_and_shutdown_without_setup() -> None:
    assert force_flush() is True
    tracing.shutdown()


def test_importing_tracing_pulls_in_neither_torch_nor_ray() -> None:
    code = (
        "import sys, ops.telemetry.tracing; "
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'ray'}); "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)

"""Head sampling keeps every fallback trace: checked through the real OTLP/HTTP receiver."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ops.telemetry import tracing
from ops.telemetry.otlp_receiver import OTLPReceiver
from ops.telemetry.tracing import (
    TracingConfig,
    extract_context,
    force_flush,
    get_tracer,
    inject_context,
    record_fallback,
    setup_tracing,
)


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[OTLPReceiver]:
    for name in ("OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG", "OTEL_TRACES_EXPORTER"):
        monkeypatch.delenv(name, raising=False)
    tracing.shutdown()
    with OTLPReceiver() as running:
        yield running
        tracing.shutdown()


def _trace(name: str, fallback: bool) -> str:
    tracer = get_tracer()
    with tracer.start_as_current_span(name) as root:
        with tracer.start_as_current_span("route"):
            if fallback:
                record_fallback("non_greedy", "prelaunch", lane="standard")
        return format(root.get_span_context().trace_id, "032x")


def test_ratio_zero_drops_plain_traces_but_keeps_fallback_traces(receiver: OTLPReceiver) -> None:
    setup_tracing(TracingConfig(exporter="otlp", endpoint=receiver.endpoint, sample_ratio=0.0))
    plain = _trace("plain", fallback=False)
    kept = _trace("with-fallback", fallback=True)
    assert force_flush()
    receiver.wait_for(lambda s: s.name == "with-fallback")
    by_trace = {}
    for span in receiver.spans():
        by_trace.setdefault(span.trace_id, set()).add(span.name)
    assert plain not in by_trace
    assert by_trace[kept] == {"with-fallback", "route", "fallback"}  # the whole local trace, not just the fallback


def test_ratio_one_exports_everything(receiver: OTLPReceiver) -> None:
    setup_tracing(TracingConfig(exporter="otlp", endpoint=receiver.endpoint, sample_ratio=1.0))
    plain = _trace("plain", fallback=False)
    assert force_flush()
    assert {s.name for s in receiver.wait_for(lambda s: s.trace_id == plain and s.name == "plain")} == {"plain"}
    assert {s.name for s in receiver.spans() if s.trace_id == plain} == {"plain", "route"}


def test_readiness_probes_start_no_trace(receiver: OTLPReceiver) -> None:
    """A server span of ``/health`` (as FastAPI opens it, ``url.path`` set) is dropped at ratio 1 with its
    children; another path's is exported."""
    from opentelemetry.trace import SpanKind

    setup_tracing(TracingConfig(exporter="otlp", endpoint=receiver.endpoint, sample_ratio=1.0))
    tracer = get_tracer()
    ids = {}
    for path in ("/health", "/v1/models"):
        with tracer.start_as_current_span("GET", kind=SpanKind.SERVER, attributes={"url.path": path}) as root:
            with tracer.start_as_current_span("inner"):
                pass
        ids[path] = format(root.get_span_context().trace_id, "032x")
    assert force_flush()
    receiver.wait_for(lambda s: s.trace_id == ids["/v1/models"] and s.name == "GET")
    assert {s.name for s in receiver.spans() if s.trace_id == ids["/v1/models"]} == {"GET", "inner"}
    assert not [s for s in receiver.spans() if s.trace_id == ids["/health"]]


def test_carrier_round_trip_and_forced_sampling_reaches_the_next_hop(receiver: OTLPReceiver) -> None:
    setup_tracing(TracingConfig(exporter="otlp", endpoint=receiver.endpoint, sample_ratio=0.0))
    tracer = get_tracer()
    with tracer.start_as_current_span("route") as route:
        plain, forced = inject_context(), inject_context(force_sample=True)
    ids = route.get_span_context()
    assert plain["traceparent"].split("-")[1:3] == [format(ids.trace_id, "032x"), format(ids.span_id, "016x")]
    assert int(plain["traceparent"].split("-")[3], 16) & 1 == 0  # the ratio did not pick it
    assert int(forced["traceparent"].split("-")[3], 16) & 1 == 1
    # the next hop (another process in the app) parents its span on the carrier
    tracer.start_span("dropped-hop", context=extract_context(plain)).end()
    tracer.start_span("kept-hop", context=extract_context({"TraceParent": forced["traceparent"]})).end()
    assert force_flush()
    (hop,) = receiver.wait_for(lambda s: s.name == "kept-hop")
    assert hop.trace_id == format(ids.trace_id, "032x") and hop.parent_span_id == format(ids.span_id, "016x")
    assert not [s for s in receiver.spans() if s.name == "dropped-hop"]


def test_extract_ignores_missing_or_malformed_carriers() -> None:
    assert extract_context(None) is None
    assert extract_context({}) is None
    assert extract_context({"traceparent": "not-a-traceparent"}) is None


def test_sampler_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    assert TracingConfig().resolved().sample_ratio == 0.25
    assert TracingConfig(sample_ratio=0.5).resolved().sample_ratio == 0.5  # explicit wins
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    with pytest.raises(ValueError, match="OTEL_TRACES_SAMPLER"):
        TracingConfig().resolved()
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "2")
    with pytest.raises(ValueError, match="OTEL_TRACES_SAMPLER_ARG"):
        TracingConfig().resolved()

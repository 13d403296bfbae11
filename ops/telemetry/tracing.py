"""OpenTelemetry tracing set-up and the span helpers the router uses.

Two things live here:

* :func:`setup_tracing` builds one SDK :class:`TracerProvider` per process from a
  :class:`TracingConfig` (explicit fields first, then the standard ``OTEL_*``
  environment variables of the OpenTelemetry specification).
* :func:`route_span` and :func:`record_fallback` write the spans that explain every
  routing decision: a span ``route`` per request with the chosen lane, and, when a
  request that could have run on the persistent lane does not, a child span
  ``fallback`` plus an event ``fallback`` on the ``route`` span. Span names and
  attribute keys are module constants so dashboards and tests can rely on them.
* :func:`inject_context` / :func:`extract_context` carry a W3C ``traceparent``
  across Ray hops in a plain ``dict`` (the carrier travels inside the request
  object, so every hop's span is a child of the previous hop's).
* Sampling (:attr:`TracingConfig.sample_ratio`): head sampling by trace id, but a
  trace that records a ``fallback`` span is always exported (see
  :class:`KeepFallbacksSampler` and :class:`KeepFallbacksProcessor`).

The span tree of one request (names are constants below)::

    POST /v1/chat/completions      (ingress, SERVER span, continues the client's traceparent)
      route                        (router, same process)
        fallback                   (when the request does not take the persistent lane)
        replica.generate           (replica process: a Ray hop)
          generation               (engine actor process: a Ray hop; per lane)
            quantum                (persistent lane: one per quantum)

This module imports neither torch nor ray, so policy code, the router and
offline tools can all use it.

Typical use::

    setup_tracing(TracingConfig(exporter="otlp", endpoint="http://collector:4318/v1/traces"))
    with route_span(lane="persistent", mode="auto", reason=None, request_id=rid):
        ...
        record_fallback("queued_work", "prelaunch", request_id=rid, lane="standard")
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, TraceFlags, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ops.telemetry.trace_sampling import KeepFallbacksProcessor, KeepFallbacksSampler

__all__ = [
    "ATTR_FALLBACK_REASON",
    "ATTR_GEN_AI_INPUT_TOKENS",
    "ATTR_GEN_AI_MODEL",
    "ATTR_GEN_AI_OPERATION",
    "ATTR_GEN_AI_OUTPUT_TOKENS",
    "ATTR_GEN_AI_TEMPERATURE",
    "KeepFallbacksProcessor",
    "KeepFallbacksSampler",
    "SPAN_GENERATION",
    "SPAN_QUANTUM",
    "SPAN_REPLICA",
    "extract_context",
    "inject_context",
    "ATTR_FALLBACK_STAGE",
    "ATTR_LANE",
    "ATTR_MODE",
    "ATTR_REASON",
    "ATTR_REQUEST_ID",
    "DEFAULT_SERVICE_NAME",
    "FALLBACK_STAGES",
    "SPAN_FALLBACK",
    "SPAN_ROUTE",
    "TracingConfig",
    "force_flush",
    "get_tracer",
    "record_fallback",
    "route_span",
    "setup_tracing",
    "shutdown",
]

# Stable span names and attribute keys (dashboards, alerts and tests key on these).
SPAN_ROUTE = "route"
SPAN_FALLBACK = "fallback"
ATTR_LANE = "lane"
ATTR_MODE = "mode"
ATTR_REASON = "reason"
ATTR_FALLBACK_REASON = "fallback.reason"
ATTR_FALLBACK_STAGE = "fallback.stage"
ATTR_REQUEST_ID = "request.id"
SPAN_REPLICA = "replica.generate"
SPAN_GENERATION = "generation"
SPAN_QUANTUM = "quantum"
# OpenTelemetry GenAI semantic conventions (gen-ai-spans, "Inference" attributes).
ATTR_GEN_AI_OPERATION = "gen_ai.operation.name"
ATTR_GEN_AI_MODEL = "gen_ai.request.model"
ATTR_GEN_AI_TEMPERATURE = "gen_ai.request.temperature"
ATTR_GEN_AI_MAX_TOKENS = "gen_ai.request.max_tokens"
ATTR_GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
ATTR_GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
ATTR_GEN_AI_FINISH_REASONS = "gen_ai.response.finish_reasons"
# Not in the conventions yet; vLLM's request spans use the same key. Seconds, as a float.
ATTR_GEN_AI_TTFT = "gen_ai.latency.time_to_first_token"
# The ingress HTTP span's own marks (Unix time, ns): the handler entered (FastAPI read and validated the body),
# and the prompt planned (chat template, tokenization) just before routing.
ATTR_INGRESS_HANDLER_NS = "persistent_serve.ingress.handler_entered_ns"
ATTR_INGRESS_PLANNED_NS = "persistent_serve.ingress.planned_ns"

FallbackStage = Literal["prelaunch", "postlaunch"]
FALLBACK_STAGES: tuple[str, ...] = ("prelaunch", "postlaunch")

DEFAULT_SERVICE_NAME = "persistent-serve"

# Environment variables, as named by the OpenTelemetry specification.
ENV_TRACES_EXPORTER = "OTEL_TRACES_EXPORTER"
ENV_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
ENV_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
ENV_TRACES_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
ENV_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
ENV_SERVICE_NAME = "OTEL_SERVICE_NAME"
ENV_SAMPLER = "OTEL_TRACES_SAMPLER"
ENV_SAMPLER_ARG = "OTEL_TRACES_SAMPLER_ARG"
_RATIO_SAMPLERS = ("traceidratio", "parentbased_traceidratio")
_FULL_SAMPLERS = ("always_on", "parentbased_always_on")

_DEFAULT_HTTP_ENDPOINT = "http://localhost:4318/v1/traces"
_DEFAULT_GRPC_ENDPOINT = "http://localhost:4317"
_TRACES_PATH = "/v1/traces"
_EXPORTER_ALIASES = {"otlp_proto_http": "otlp"}
_GRPC_PACKAGE = "opentelemetry-exporter-otlp-proto-grpc"


def _normalize_exporter(value: Any) -> Any:
    if isinstance(value, str):
        value = value.strip().lower()
        return _EXPORTER_ALIASES.get(value, value)
    return value


class TracingConfig(BaseModel):
    """Where and how this process exports trace spans.

    A field left at ``None`` is filled from the environment by :meth:`resolved`
    (and therefore by :func:`setup_tracing`), following the OpenTelemetry
    specification's variable names. Explicit values always win over the
    environment.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    exporter: Literal["console", "otlp", "none"] | None = Field(
        default=None,
        description=(
            "Span exporter: 'console' prints each span to stdout as it ends, 'otlp' "
            "sends batches to an OTLP collector, 'none' records spans but exports "
            "nothing. 'otlp_proto_http' is accepted as an alias of 'otlp'. None reads "
            "OTEL_TRACES_EXPORTER; unset means 'none' (the specification's default is "
            "'otlp', we choose 'none' so a laptop run never waits on a missing "
            "collector)."
        ),
    )
    endpoint: str | None = Field(
        default=None,
        description=(
            "Full URL of the OTLP traces endpoint, used only when exporter is 'otlp'. "
            "None reads OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (used as is), else "
            "OTEL_EXPORTER_OTLP_ENDPOINT (for http/protobuf '/v1/traces' is appended), "
            "else http://localhost:4318/v1/traces (http/protobuf) or "
            "http://localhost:4317 (grpc)."
        ),
    )
    service_name: str = Field(
        default=DEFAULT_SERVICE_NAME,
        min_length=1,
        description=(
            "Value of the 'service.name' resource attribute on every span. When the "
            "field is not given explicitly, OTEL_SERVICE_NAME overrides the default."
        ),
    )
    protocol: Literal["http/protobuf", "grpc"] | None = Field(
        default=None,
        description=(
            "OTLP transport. None reads OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, then "
            "OTEL_EXPORTER_OTLP_PROTOCOL, else 'http/protobuf'. 'grpc' needs the "
            f"optional package {_GRPC_PACKAGE}."
        ),
    )
    schedule_delay_ms: int = Field(
        default=200,
        ge=1,
        description=(
            "Milliseconds the OTLP batch span processor waits between exports "
            "(BatchSpanProcessor schedule_delay_millis). Unused by 'console' and 'none'."
        ),
    )

    sample_ratio: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description=(
            "Fraction of traces exported (head sampling by trace id; 1.0 keeps all). A trace "
            "that records a 'fallback' span is exported whatever the ratio. None reads "
            "OTEL_TRACES_SAMPLER (always_on, parentbased_always_on, traceidratio, "
            "parentbased_traceidratio) and OTEL_TRACES_SAMPLER_ARG; unset means 1.0."
        ),
    )

    @field_validator("exporter", mode="before")
    @classmethod
    def _alias_exporter(cls, value: Any) -> Any:
        return _normalize_exporter(value)

    def resolved(self) -> TracingConfig:
        """Return a copy with every ``None`` field filled from the environment.

        Reads ``OTEL_TRACES_EXPORTER``, ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``,
        ``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``,
        ``OTEL_EXPORTER_OTLP_PROTOCOL`` and ``OTEL_SERVICE_NAME`` (see the field
        descriptions for precedence). Calling it on a resolved config returns an
        equal config.

        Raises:
            ValueError: an environment variable holds a value this module does not
                support (e.g. ``OTEL_TRACES_EXPORTER=zipkin``, a comma-separated
                list of exporters, or ``OTEL_EXPORTER_OTLP_PROTOCOL=http/json``).
        """
        exporter = self.exporter
        if exporter is None:
            exporter = _normalize_exporter(os.environ.get(ENV_TRACES_EXPORTER, "")) or "none"
            if exporter not in ("console", "otlp", "none"):
                raise ValueError(
                    f"{ENV_TRACES_EXPORTER}={os.environ.get(ENV_TRACES_EXPORTER)!r} is not "
                    "supported; use one of 'console', 'otlp' (or 'otlp_proto_http'), 'none'"
                )

        protocol = self.protocol
        if protocol is None:
            raw = os.environ.get(ENV_TRACES_PROTOCOL) or os.environ.get(ENV_PROTOCOL)
            protocol = (raw or "http/protobuf").strip().lower()
            if protocol not in ("http/protobuf", "grpc"):
                raise ValueError(
                    f"OTLP protocol {raw!r} (from {ENV_TRACES_PROTOCOL} or {ENV_PROTOCOL}) "
                    "is not supported; use 'http/protobuf' or 'grpc'"
                )

        endpoint = self.endpoint
        if endpoint is None:
            endpoint = _endpoint_from_env(protocol)

        service_name = self.service_name
        if "service_name" not in self.model_fields_set:
            service_name = os.environ.get(ENV_SERVICE_NAME) or service_name

        sample_ratio = self.sample_ratio
        if sample_ratio is None:
            sample_ratio = _ratio_from_env()

        return TracingConfig(
            exporter=exporter,
            endpoint=endpoint,
            service_name=service_name,
            protocol=protocol,
            schedule_delay_ms=self.schedule_delay_ms,
            sample_ratio=sample_ratio,
        )


def _ratio_from_env() -> float:
    sampler = (os.environ.get(ENV_SAMPLER) or "parentbased_always_on").strip().lower()
    if sampler in _FULL_SAMPLERS:
        return 1.0
    if sampler not in _RATIO_SAMPLERS:
        raise ValueError(
            f"{ENV_SAMPLER}={sampler!r} is not supported; use one of "
            f"{', '.join(_FULL_SAMPLERS + _RATIO_SAMPLERS)} (fallbacks are always kept)"
        )
    raw = os.environ.get(ENV_SAMPLER_ARG, "1.0")
    try:
        ratio = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_SAMPLER_ARG}={raw!r} is not a number in [0, 1]") from None
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"{ENV_SAMPLER_ARG}={raw!r} is not a number in [0, 1]")
    return ratio


def _endpoint_from_env(protocol: str) -> str:
    traces_endpoint = os.environ.get(ENV_TRACES_ENDPOINT)
    if traces_endpoint:
        return traces_endpoint
    base = os.environ.get(ENV_ENDPOINT)
    if base:
        if protocol == "grpc":
            return base
        return base.rstrip("/") + _TRACES_PATH
    return _DEFAULT_GRPC_ENDPOINT if protocol == "grpc" else _DEFAULT_HTTP_ENDPOINT


# Module state: the provider this module hands tracers from. Guarded by _lock.
_lock = threading.RLock()
_provider: TracerProvider | None = None
_provider_config: TracingConfig | None = None
_tracers: dict[str, Tracer] = {}


def _otlp_exporter(config: TracingConfig) -> SpanExporter:
    if config.protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcSpanExporter,
            )
        except ImportError as exc:
            raise RuntimeError(
                "TracingConfig(protocol='grpc') needs the OTLP gRPC exporter: "
                f"pip install {_GRPC_PACKAGE}"
            ) from exc
        return GrpcSpanExporter(endpoint=config.endpoint)

    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=config.endpoint)


def _keep_fallbacks(inner) -> KeepFallbacksProcessor:
    return KeepFallbacksProcessor(inner, (SPAN_FALLBACK,), (ATTR_FALLBACK_REASON,))


def _build_provider(config: TracingConfig) -> TracerProvider:
    ratio = 1.0 if config.sample_ratio is None else config.sample_ratio
    provider = TracerProvider(
        resource=Resource.create({SERVICE_NAME: config.service_name}),
        sampler=KeepFallbacksSampler(ratio),
    )
    if config.exporter == "console":
        provider.add_span_processor(
            _keep_fallbacks(
                # Bind the stdout of set-up time (the SDK's default is the one of import time).
                SimpleSpanProcessor(
                    ConsoleSpanExporter(service_name=config.service_name, out=sys.stdout)
                )
            )
        )
    elif config.exporter == "otlp":
        provider.add_span_processor(
            _keep_fallbacks(
                BatchSpanProcessor(
                    _otlp_exporter(config), schedule_delay_millis=config.schedule_delay_ms
                )
            )
        )
    return provider


def setup_tracing(config: TracingConfig | None = None) -> TracerProvider:
    """Create (or reuse) this process's tracer provider and return it.

    ``config`` defaults to ``TracingConfig()``, i.e. everything from the
    environment (see :meth:`TracingConfig.resolved`).

    * Idempotent: if the resolved config equals the one already in use, the same
      provider is returned and nothing is rebuilt.
    * A different resolved config builds a new provider that replaces the
      module's one; the old provider is flushed and shut down.
    * The first provider this process builds is also installed as the global
      OpenTelemetry provider (``opentelemetry.trace.set_tracer_provider``) unless
      something else already installed one. OpenTelemetry forbids replacing the
      global provider, so later providers are reachable only through this module:
      use :func:`get_tracer`, never ``opentelemetry.trace.get_tracer``, for our spans.

    Exporters: 'console' → ``ConsoleSpanExporter`` (stdout) through a
    ``SimpleSpanProcessor`` (synchronous, one write per span); 'otlp' →
    ``OTLPSpanExporter`` through a ``BatchSpanProcessor`` with
    ``schedule_delay_ms``; 'none' → a provider with no processors. Other standard
    variables keep their usual effect, e.g. ``OTEL_SDK_DISABLED=true`` makes every
    tracer a no-op and ``OTEL_EXPORTER_OTLP_HEADERS`` /
    ``OTEL_EXPORTER_OTLP_COMPRESSION`` are read by the OTLP exporter.

    Raises:
        ValueError: the environment holds an unsupported value (see
            :meth:`TracingConfig.resolved`).
        RuntimeError: protocol 'grpc' was asked for and
            ``opentelemetry-exporter-otlp-proto-grpc`` is not installed.
    """
    global _provider, _provider_config
    resolved = (config or TracingConfig()).resolved()
    with _lock:
        if _provider is not None and _provider_config == resolved:
            return _provider
        new_provider = _build_provider(resolved)
        old_provider = _provider
        _provider, _provider_config = new_provider, resolved
        _tracers.clear()
        if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
            trace.set_tracer_provider(new_provider)
    if old_provider is not None:
        old_provider.shutdown()  # flushes what it still holds, then stops its exporter
    return new_provider


def get_tracer(name: str = DEFAULT_SERVICE_NAME) -> Tracer:
    """Return a tracer from this module's provider (instrumentation scope ``name``).

    If :func:`setup_tracing` has not run in this process yet, it is called with
    the default (environment-driven) config first, so a replica process that only
    sets ``OTEL_*`` variables gets working tracing.
    """
    with _lock:
        provider = _provider if _provider is not None else setup_tracing()
        tracer = _tracers.get(name)
        if tracer is None:
            tracer = _tracers[name] = provider.get_tracer(name)
        return tracer


def _clean(attributes: dict[str, Any]) -> dict[str, Any]:
    """Drop ``None`` values: OpenTelemetry attribute values may not be None."""
    return {key: value for key, value in attributes.items() if value is not None}


@contextmanager
def route_span(
    lane: str,
    mode: str,
    reason: str | None,
    request_id: str | None = None,
    **attributes: Any,
) -> Iterator[Span]:
    """Open the ``route`` span for one request and make it the current span.

    Args:
        lane: the lane chosen, e.g. ``"persistent"`` or ``"standard"`` (attribute ``lane``).
        mode: the persistent mode in force, ``"off"``/``"auto"``/``"required"``
            (attribute ``mode``).
        reason: why the request did not go persistent, a stable snake_case reason
            such as ``"non_greedy"`` (attribute ``reason``); ``None`` omits it.
        request_id: the request's id (attribute ``request.id``); ``None`` omits it.
        **attributes: extra span attributes (str, bool, int, float or sequences of
            one of those); ``None`` values are skipped, and they never override
            the keys above.

    Yields:
        The recording span; call ``set_attribute`` on it to add facts learned later.
        An exception raised inside the block is recorded on the span and re-raised.
    """
    span_attributes = _clean(
        {
            **attributes,
            ATTR_LANE: lane,
            ATTR_MODE: mode,
            ATTR_REASON: reason,
            ATTR_REQUEST_ID: request_id,
        }
    )
    with get_tracer().start_as_current_span(SPAN_ROUTE, attributes=span_attributes) as span:
        yield span


def record_fallback(
    reason: str,
    stage: FallbackStage,
    request_id: str | None = None,
    *,
    lane: str | None = None,
    **attributes: Any,
) -> None:
    """Record that a request falls back from the persistent lane.

    Writes a zero-length child span ``fallback`` of the current span and, when the
    current span is recording (normally the ``route`` span), an event ``fallback``
    on it; both carry the same attributes: ``fallback.reason``,
    ``fallback.stage``, ``lane`` (the lane the request falls back to, when given),
    ``request.id`` (when given) and ``attributes``. With no current span the child
    span becomes a root span of its own trace.

    Args:
        reason: stable snake_case reason, e.g. ``"queued_work"`` or ``"persistent_capacity"``.
        stage: ``"prelaunch"`` (nothing in the KV cache changed yet) or
            ``"postlaunch"`` (after a native launch).
        request_id: the request's id.
        lane: the lane the request goes to instead, e.g. ``"standard"``.
        **attributes: extra attributes; ``None`` values are skipped, and they
            never override the keys above.

    Raises:
        ValueError: ``stage`` is not one of :data:`FALLBACK_STAGES`.
    """
    if stage not in FALLBACK_STAGES:
        raise ValueError(f"unknown fallback stage {stage!r}; expected one of {FALLBACK_STAGES}")
    fallback_attributes = _clean(
        {
            **attributes,
            ATTR_FALLBACK_REASON: reason,
            ATTR_FALLBACK_STAGE: stage,
            ATTR_LANE: lane,
            ATTR_REQUEST_ID: request_id,
        }
    )
    parent = trace.get_current_span()
    if parent.is_recording():
        parent.add_event(SPAN_FALLBACK, attributes=fallback_attributes)
    get_tracer().start_span(SPAN_FALLBACK, attributes=fallback_attributes).end()


_PROPAGATOR = TraceContextTextMapPropagator()


def inject_context(span: Span | None = None, *, force_sample: bool = False) -> dict[str, str]:
    """The W3C trace context of ``span`` (default: the current span) as a carrier dict.

    The dict (``{"traceparent": "00-<trace>-<span>-<flags>"}``, plus ``tracestate``
    when set) travels inside a request object across a Ray hop; the next hop
    passes it to :func:`extract_context` to parent its span on ``span``.

    Args:
        span: the parent-to-be; ``None`` takes the current span.
        force_sample: set the ``sampled`` flag even if ``span``'s trace was not
            picked by the sampler (the router does this once a request falls back,
            so the downstream hops of a fallback trace are exported).

    Returns:
        The carrier; empty when there is no valid span (tracing off or no span).
    """
    span = span if span is not None else trace.get_current_span()
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return {}
    if force_sample and not ctx.trace_flags.sampled:
        span = NonRecordingSpan(SpanContext(ctx.trace_id, ctx.span_id, is_remote=False,
                                            trace_flags=TraceFlags(ctx.trace_flags | TraceFlags.SAMPLED),
                                            trace_state=ctx.trace_state))
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def extract_context(carrier: dict[str, str] | None) -> Context | None:
    """The parent context a carrier names (from :func:`inject_context` or HTTP headers).

    Header names are matched case-insensitively, so a request's headers (any
    mapping) can be passed as they are. Returns ``None`` for an empty or missing
    carrier or a malformed ``traceparent`` (the span then starts a new trace).
    """
    if not carrier:
        return None
    lowered = {str(k).lower(): v for k, v in carrier.items()}
    ctx = _PROPAGATOR.extract(lowered)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def force_flush(timeout_ms: int = 5000) -> bool:
    """Export every span ended so far; wait at most ``timeout_ms`` milliseconds.

    Returns:
        True if everything was exported in time (also when tracing was never set
        up), False on timeout.
    """
    with _lock:
        provider = _provider
    if provider is None:
        return True
    return provider.force_flush(timeout_millis=timeout_ms)


def shutdown() -> None:
    """Flush and shut down this module's provider and forget it.

    A later :func:`setup_tracing` (or :func:`get_tracer`) builds a fresh provider.
    The global OpenTelemetry provider is not reset (OpenTelemetry does not allow
    it); if it was ours, spans started through the global API are dropped from
    now on. Safe to call when tracing was never set up.
    """
    global _provider, _provider_config
    with _lock:
        provider = _provider
        _provider, _provider_config = None, None
        _tracers.clear()
    if provider is not None:
        provider.shutdown()

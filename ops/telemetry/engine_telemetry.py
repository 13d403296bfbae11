"""Spans and metrics of one engine actor, handed to ``replicas/`` by injection.

The engine actor builds one :class:`EngineTelemetry` at start-up (the only
place ``replicas/`` touches ``ops/``, and not a hot path) and asks it for a
:class:`RequestTelemetry` per request. The lanes only call methods on that
object (``scheduled``, ``quantum``); they import nothing from here.

Spans (names and attributes from :mod:`ops.telemetry.tracing`):

* ``generation``: one per request in the engine actor, child of the replica's
  ``replica.generate`` span through the ``traceparent`` carried in
  ``GenerateRequest.trace_context``; GenAI attributes (model, temperature,
  max tokens, input/output tokens, finish reasons, ``gen_ai.latency.time_to_first_token``: seconds from the
  request's arrival in the actor to its first output token leaving it) plus ``lane`` and the engine's kernel choices,
  resolved once at load (``engine.moe_backend``, ``engine.pdl``, ...: :attr:`EngineTelemetry.settings`).
* ``quantum``: one per persistent quantum, child of ``generation``, with the
  quantum's size, tokens emitted, finish reason and backend; its start and end
  are the launch's wall-clock times.
"""

from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from ops.telemetry.tracing import (
    ATTR_GEN_AI_FINISH_REASONS,
    ATTR_GEN_AI_INPUT_TOKENS,
    ATTR_GEN_AI_MAX_TOKENS,
    ATTR_GEN_AI_MODEL,
    ATTR_GEN_AI_OUTPUT_TOKENS,
    ATTR_GEN_AI_TEMPERATURE,
    ATTR_GEN_AI_TTFT,
    ATTR_LANE,
    ATTR_REQUEST_ID,
    SPAN_GENERATION,
    SPAN_QUANTUM,
    extract_context,
)


class RequestTelemetry:
    """Spans and metrics of one request inside an engine actor (thread-safe enough: one writer at a time).

    Created by :meth:`EngineTelemetry.start`; call :meth:`end` exactly once.
    """

    def __init__(self, owner: EngineTelemetry, request) -> None:
        self._owner = owner
        self._arrival = time.monotonic()
        self._queued = False
        self.output_tokens = 0
        self.finish_reasons: list[str] = []
        p = request.params
        self.span = owner.tracer.start_span(SPAN_GENERATION, context=extract_context(request.trace_context), attributes={
            ATTR_LANE: owner.lane, ATTR_REQUEST_ID: request.request_id, ATTR_GEN_AI_MODEL: owner.model,
            ATTR_GEN_AI_TEMPERATURE: float(p.temperature), ATTR_GEN_AI_MAX_TOKENS: int(p.max_tokens),
            ATTR_GEN_AI_INPUT_TOKENS: len(request.prompt_token_ids), **owner.span_settings,
        })

    def scheduled(self) -> None:
        """The request was scheduled (prefill starts): records its queue time once."""
        if not self._queued:
            self._queued = True
            self._owner.metrics.queue_time(self._owner.lane, time.monotonic() - self._arrival)

    def quantum(self, size: int, emitted: int, finish_reason: str | None, start_ns: int, end_ns: int,
                backend: str | None = None, error: str | None = None) -> None:
        """One persistent quantum: ``size`` tokens asked, ``emitted`` returned (0 when it failed with ``error``).

        ``start_ns``/``end_ns`` are ``time.time_ns()`` from the launch to the read-back of its result; with
        pipelined quanta a quantum is launched while the one before runs, so consecutive spans overlap (a
        follower discarded because the request ended gets no span). ``backend``: the backend that ran it.
        """
        backend = backend or self._owner.backend or "none"
        attrs = {"quantum.size": size, "quantum.tokens_emitted": emitted, "persistent.backend": backend}
        if finish_reason:
            attrs["quantum.finish_reason"] = finish_reason
        if error:
            attrs["quantum.error"] = error
        span = self._owner.tracer.start_span(SPAN_QUANTUM, context=trace.set_span_in_context(self.span),
                                             attributes=attrs, start_time=start_ns)
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=end_ns)
        if not error:
            self._owner.metrics.quantum(backend, emitted)

    def chunk(self, item) -> None:
        """Account one item the actor streams back (chunk, rejection or error)."""
        tokens = getattr(item, "token_ids", None)
        if tokens is not None:
            if tokens and not self.output_tokens:
                self.span.set_attribute(ATTR_GEN_AI_TTFT, time.monotonic() - self._arrival)
            self.output_tokens += len(tokens)
            if item.finish_reason:
                self.finish_reasons.append(item.finish_reason)
        elif hasattr(item, "reason"):  # Rejection or GenerationError
            self.span.set_attribute("error.reason", item.reason)
            if type(item).__name__ == "GenerationError":
                self.span.set_status(Status(StatusCode.ERROR, item.message))

    def end(self) -> None:
        self.span.set_attribute(ATTR_GEN_AI_OUTPUT_TOKENS, self.output_tokens)
        if self.finish_reasons:
            self.span.set_attribute(ATTR_GEN_AI_FINISH_REASONS, self.finish_reasons)
        self.span.end()


class EngineTelemetry:
    """Per-actor factory of :class:`RequestTelemetry`, plus the actor's gauges.

    Args:
        lane: ``"persistent"`` or ``"standard"``.
        model: served model name (``gen_ai.request.model``).
        backend: persistent backend name, or None.
        tracer: an OpenTelemetry tracer (``ops.telemetry.tracing.get_tracer()``).
        metrics: an ``ops.telemetry.metrics.ServeMetrics``.
        settings: what the engine resolved at load (kernels, MoE backend, pipelining: the engine actor's
            ``settings``); every ``generation`` span carries them as ``engine.<key>`` attributes.
    """

    def __init__(self, lane: str, model: str, backend: str | None, tracer, metrics,
                 settings: dict | None = None) -> None:
        self.lane, self.model, self.backend = lane, model, backend
        self.tracer, self.metrics = tracer, metrics
        self.settings = dict(settings or {})
        self.span_settings = {f"engine.{k}": _attribute(v) for k, v in self.settings.items() if v is not None}

    def start(self, request) -> RequestTelemetry:
        """Open the ``generation`` span of ``request`` (a ``GenerateRequest``)."""
        return RequestTelemetry(self, request)

    def gauges(self, stats: dict) -> None:
        """Publish KV page and decoder-health gauges from the engine's ``stats()`` dict."""
        total, free = stats.get("kv_pages_total"), stats.get("kv_pages_free")
        if total is not None and free is not None:
            self.metrics.kv_pages(self.lane, total - free, free)
        if self.lane == "persistent":
            self.metrics.decoder_health(self.backend or "none", bool(stats.get("decoder_healthy")))


def _attribute(value):
    """An OpenTelemetry attribute value: scalars as they are, lists of scalars as lists, the rest as JSON."""
    if isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (bool, int, float, str)) for v in value):
        return list(value)
    import json

    return json.dumps(value, sort_keys=True)


def build_engine_telemetry(lane: str, model: str, backend: str | None, tracing_config=None,
                           settings: dict | None = None) -> EngineTelemetry:
    """Set up tracing for this process (``tracing_config``: an ``ops.telemetry.tracing.TracingConfig``) and build
    the telemetry (``settings``: see :class:`EngineTelemetry`)."""
    from ops.telemetry.metrics import get_metrics
    from ops.telemetry.tracing import get_tracer, setup_tracing

    setup_tracing(tracing_config)
    return EngineTelemetry(lane, model, backend, get_tracer(), get_metrics(), settings)

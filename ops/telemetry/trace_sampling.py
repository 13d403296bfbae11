"""Head sampling that never loses a fallback: the sampler and span processor behind it.

Head sampling decides at a trace's first span, before the router knows whether
the request will fall back. So a trace that the ratio does not pick is still
*recorded* (``RECORD_ONLY``: spans exist in memory but carry the unsampled flag),
and :class:`KeepFallbacksProcessor` holds those spans per trace until the
process's local root span of that trace ends. If any of them is a fallback span,
the held spans (and later ones of the trace) are exported as sampled; otherwise
they are dropped. Spans of sampled traces pass straight through.

Across Ray hops the router sends the ``sampled`` flag downstream once it knows
a request falls back (``ops.telemetry.tracing.inject_context(force_sample=True)``), so the
downstream hops of a fallback trace are exported too.

No torch, no ray.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.sampling import (
    Decision,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags, get_current_span
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import Attributes

MAX_HELD_TRACES = 4096
"""Unsampled traces whose spans are held at once; the oldest is dropped beyond this."""


UNTRACED_PATHS = frozenset({"/health"})
"""HTTP paths whose requests start no trace: a readiness probe every few seconds would bury the requests'
traces (with the console exporter, a screenful each)."""


class KeepFallbacksSampler(Sampler):
    """Sample ``ratio`` of root traces by trace id; record the rest without sampling.

    * parent sampled → ``RECORD_AND_SAMPLE`` (children follow their parent, across processes);
    * parent present but unsampled → ``RECORD_ONLY``;
    * no parent, a server span of a path in :data:`UNTRACED_PATHS` (its ``url.path`` attribute) → ``DROP``;
    * no parent otherwise → :class:`TraceIdRatioBased` ``(ratio)`` decides between
      ``RECORD_AND_SAMPLE`` and ``RECORD_ONLY``.

    Args:
        ratio: fraction of root traces sampled, in [0, 1].

    Raises:
        ValueError: ``ratio`` outside [0, 1].
    """

    def __init__(self, ratio: float = 1.0):
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"sample ratio must be in [0, 1], got {ratio}")
        self.ratio = ratio
        self._root = TraceIdRatioBased(ratio)

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        parent = get_current_span(parent_context).get_span_context()
        if parent.is_valid:
            sampled = parent.trace_flags.sampled
        elif attributes and attributes.get("url.path") in UNTRACED_PATHS:
            return SamplingResult(Decision.DROP)
        else:
            sampled = self._root.should_sample(parent_context, trace_id, name).decision.is_sampled()
        decision = Decision.RECORD_AND_SAMPLE if sampled else Decision.RECORD_ONLY
        return SamplingResult(decision, attributes, parent.trace_state if parent.is_valid else None)

    def get_description(self) -> str:
        return f"KeepFallbacksSampler{{ratio={self.ratio}}}"


def _as_sampled(span: ReadableSpan) -> ReadableSpan:
    ctx = span.context
    return ReadableSpan(
        name=span.name,
        context=SpanContext(ctx.trace_id, ctx.span_id, is_remote=False,
                            trace_flags=TraceFlags(ctx.trace_flags | TraceFlags.SAMPLED),
                            trace_state=ctx.trace_state),
        parent=span.parent, resource=span.resource, attributes=span.attributes, events=span.events,
        links=span.links, kind=span.kind, status=span.status, start_time=span.start_time,
        end_time=span.end_time, instrumentation_scope=span.instrumentation_scope,
    )


class KeepFallbacksProcessor(SpanProcessor):
    """Forward sampled spans to ``inner``; hold unsampled ones until their trace shows a fallback.

    A span is a fallback span when its name is in ``fallback_names`` or it has an
    attribute in ``fallback_attributes``. When the local root of an unsampled
    trace ends (no parent, or a remote parent) the spans still held for it are
    dropped.

    Args:
        inner: the exporting processor (e.g. a ``BatchSpanProcessor``).
        fallback_names: span names that keep their trace.
        fallback_attributes: attribute keys that keep their trace.
    """

    def __init__(self, inner: SpanProcessor, fallback_names: tuple[str, ...] = ("fallback",),
                 fallback_attributes: tuple[str, ...] = ("fallback.reason",)):
        self.inner = inner
        self.fallback_names = fallback_names
        self.fallback_attributes = fallback_attributes
        self._lock = threading.Lock()
        self._held: OrderedDict[int, list[ReadableSpan]] = OrderedDict()
        self._kept: set[int] = set()

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        self.inner.on_start(span, parent_context=parent_context)

    def _is_fallback(self, span: ReadableSpan) -> bool:
        attrs = span.attributes or {}
        return span.name in self.fallback_names or any(k in attrs for k in self.fallback_attributes)

    def on_end(self, span: ReadableSpan) -> None:
        if span.context.trace_flags.sampled:
            self.inner.on_end(span)
            return
        tid = span.context.trace_id
        local_root = span.parent is None or span.parent.is_remote
        with self._lock:
            if tid not in self._kept and self._is_fallback(span):
                self._kept.add(tid)
            if tid in self._kept:
                out = self._held.pop(tid, []) + [span]
            else:
                out = []
                self._held.setdefault(tid, []).append(span)
                self._held.move_to_end(tid)
                while len(self._held) > MAX_HELD_TRACES:
                    self._held.popitem(last=False)
            if local_root:
                self._held.pop(tid, None)
                self._kept.discard(tid)
        for held in out:
            self.inner.on_end(_as_sampled(held))

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)

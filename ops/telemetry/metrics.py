"""Prometheus metrics through Ray's metrics API (``ray.util.metrics``).

Every process that records (the ingress/router process, each engine actor)
builds its own metric objects with :func:`get_metrics`; Ray's per-node metrics
agent aggregates them and serves them on the node's metrics export port
(``ray start --metrics-export-port`` / ``ray.init(_metrics_export_port=...)``),
under the ``ray_`` prefix Ray adds to every application metric.

Names follow vLLM's (``vllm:time_to_first_token_seconds`` and so on) with our
prefix. Ray 2.60 no longer accepts ``:`` in metric names (it warns and drops
the metric), so the prefix is ``persistent_serve_``; on the Prometheus endpoint
a metric reads e.g. ``ray_persistent_serve_time_to_first_token_seconds_bucket``.

Where each is recorded:

=========================================  ==================  ==========================================
metric (``persistent_serve_`` + ...)        tags                recorded by
=========================================  ==================  ==========================================
``time_to_first_token_seconds``             lane                router: request arrival → first token
``inter_token_latency_seconds``             lane                router: gap between streamed chunks
``time_per_output_token_seconds``           lane                router: (e2e − TTFT) / (tokens − 1)
``e2e_request_latency_seconds``             lane                router: arrival → last token
``request_queue_time_seconds``              lane                engine actor: arrival → first scheduled
``requests_total``                          lane                router: requests finished
``fallbacks_total``                         reason, stage       router: every ``fallback`` span
``quanta_total``                            backend             persistent lane: quanta run
``tokens_per_quantum``                      backend             persistent lane: tokens one quantum emitted
``kv_pages_in_use`` / ``kv_pages_free``     lane                engine actor, after each request
``persistent_decoder_healthy``              backend             persistent engine actor (1 healthy, 0 not)
=========================================  ==================  ==========================================

Latency buckets are vLLM's (``vllm/v1/metrics/loggers.py``).
"""

from __future__ import annotations

import threading
import time

PREFIX = "persistent_serve_"
"""Prefix of every metric we define (Ray then prepends ``ray_`` on export)."""

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                         5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
QUANTUM_TOKEN_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8)

NAMES = (
    "time_to_first_token_seconds", "inter_token_latency_seconds", "time_per_output_token_seconds",
    "e2e_request_latency_seconds", "request_queue_time_seconds", "requests_total", "fallbacks_total",
    "quanta_total", "tokens_per_quantum", "kv_pages_in_use", "kv_pages_free",
    "persistent_decoder_healthy",
)
"""Every metric name, without the prefix (docs and tests iterate over it)."""


class ServeMetrics:
    """This process's metric objects (create through :func:`get_metrics`).

    Each method records one fact; tags are passed explicitly so a metric's
    label set never depends on call order. Values are seconds, counts or pages.
    """

    def __init__(self) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        def hist(name: str, doc: str, buckets, tags=("lane",)) -> Histogram:
            return Histogram(PREFIX + name, description=doc, boundaries=list(buckets), tag_keys=tags)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token (s).", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds",
                        "Time between consecutive streamed chunks of a request (s).", TOKEN_LATENCY_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds",
                         "(e2e latency - TTFT) / (output tokens - 1) per request (s).", TOKEN_LATENCY_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Request arrival to last token (s).",
                        REQUEST_LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds",
                          "Time a request waited in the engine before it was first scheduled (s).",
                          REQUEST_LATENCY_BUCKETS)
        self.requests = Counter(PREFIX + "requests_total", description="Requests finished, by lane.",
                                tag_keys=("lane",))
        self.fallbacks = Counter(PREFIX + "fallbacks_total",
                                 description="Requests that did not take (or left) the persistent lane.",
                                 tag_keys=("reason", "stage"))
        self.quanta = Counter(PREFIX + "quanta_total", description="Persistent-decoder quanta run.",
                              tag_keys=("backend",))
        self.quantum_tokens = hist("tokens_per_quantum", "Tokens emitted by one quantum.",
                                   QUANTUM_TOKEN_BUCKETS, tags=("backend",))
        self.pages_in_use = Gauge(PREFIX + "kv_pages_in_use", description="KV cache pages in use.",
                                  tag_keys=("lane",))
        self.pages_free = Gauge(PREFIX + "kv_pages_free", description="KV cache pages free.",
                                tag_keys=("lane",))
        self.healthy = Gauge(PREFIX + "persistent_decoder_healthy",
                             description="1 if this replica's persistent decoder is healthy, else 0.",
                             tag_keys=("backend",))

    def fallback(self, reason: str, stage: str) -> None:
        self.fallbacks.inc(1, tags={"reason": reason, "stage": stage})

    def request_done(self, lane: str, ttft: float | None, e2e: float, output_tokens: int) -> None:
        """One finished request as the router saw it (seconds; TPOT needs >= 2 tokens)."""
        tags = {"lane": lane}
        self.requests.inc(1, tags=tags)
        self.e2e.observe(e2e, tags=tags)
        if ttft is not None:
            self.ttft.observe(ttft, tags=tags)
            if output_tokens > 1:
                self.tpot.observe((e2e - ttft) / (output_tokens - 1), tags=tags)

    def inter_token(self, lane: str, seconds: float) -> None:
        self.itl.observe(seconds, tags={"lane": lane})

    def queue_time(self, lane: str, seconds: float) -> None:
        self.queue.observe(seconds, tags={"lane": lane})

    def quantum(self, backend: str, tokens: int) -> None:
        tags = {"backend": backend}
        self.quanta.inc(1, tags=tags)
        self.quantum_tokens.observe(tokens, tags=tags)

    def kv_pages(self, lane: str, in_use: int, free: int) -> None:
        self.pages_in_use.set(in_use, tags={"lane": lane})
        self.pages_free.set(free, tags={"lane": lane})

    def decoder_health(self, backend: str, healthy: bool) -> None:
        self.healthy.set(1 if healthy else 0, tags={"backend": backend})


_lock = threading.Lock()
_metrics: ServeMetrics | None = None


def get_metrics() -> ServeMetrics:
    """This process's :class:`ServeMetrics`, created on first use.

    Outside a Ray worker or driver (``ray.init`` not called) Ray's metric
    objects record nothing, so this is safe in offline tools and unit tests.
    """
    global _metrics
    with _lock:
        if _metrics is None:
            _metrics = ServeMetrics()
        return _metrics


class RequestClock:
    """Latency facts of one request as a streaming client sees them at the router.

    Call :meth:`chunk` for every item streamed back (in order) and
    :meth:`finish` once. Times are ``time.monotonic()`` seconds; ``arrival`` is
    when the HTTP request arrived. TTFT is arrival → first item carrying tokens;
    ITL is the gap between consecutive items carrying tokens (a persistent
    quantum arrives as one item); TPOT is ``(e2e − TTFT) / (tokens − 1)``.
    """

    def __init__(self, arrival: float | None = None) -> None:
        self.arrival = time.monotonic() if arrival is None else arrival
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0
        self.lane: str | None = None
        self.gaps: list[float] = []

    def chunk(self, item) -> None:
        tokens = getattr(item, "token_ids", None)
        if getattr(item, "lane", None):
            self.lane = item.lane
        if not tokens:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = now
        else:
            self.gaps.append(now - self.last)
        self.last = now
        self.tokens += len(tokens)

    def finish(self, metrics: ServeMetrics) -> None:
        """Record requests_total, TTFT, ITL, TPOT and e2e latency (nothing if no item had a lane)."""
        if self.lane is None:
            return
        end = self.last if self.last is not None else time.monotonic()
        ttft = None if self.first is None else self.first - self.arrival
        for gap in self.gaps:
            metrics.inter_token(self.lane, gap)
        metrics.request_done(self.lane, ttft, end - self.arrival, self.tokens)

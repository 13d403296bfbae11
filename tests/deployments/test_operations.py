"""Operations over real HTTP against the real Ray app: trace continuity across every Ray hop
(spans decoded by the real OTLP/HTTP receiver), fallback spans and counters (read from Ray's
Prometheus export endpoint), the gauges and histograms, and forcing a lane."""

from __future__ import annotations

import secrets
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.deployments.conftest import MODEL, metrics_url

pytestmark = pytest.mark.ray

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def _traceparent() -> tuple[str, str, str]:
    """A fresh client-side trace: (header value, trace id, parent span id)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _post(server: str, body: dict, traceparent: str | None = None, path: str = "/v1/chat/completions",
          **headers: str) -> httpx.Response:
    hdrs = {"traceparent": traceparent} if traceparent else {}
    hdrs.update({k.replace("_", "-"): v for k, v in headers.items()})
    r = httpx.post(f"{server}{path}", json={"model": MODEL, **body}, headers=hdrs, timeout=120)
    assert r.status_code == 200, r.text
    return r


def _trace(otlp, trace_id: str, names: set[str], timeout: float = 20.0) -> dict[str, list]:
    """Wait until spans of every name in ``names`` arrived for ``trace_id``; return spans by name."""
    deadline = time.monotonic() + timeout
    while True:
        spans = [s for s in otlp.spans() if s.trace_id == trace_id]
        by_name: dict[str, list] = {}
        for s in spans:
            by_name.setdefault(s.name, []).append(s)
        if names <= by_name.keys():
            return by_name
        if time.monotonic() > deadline:
            raise AssertionError(f"trace {trace_id}: wanted {sorted(names)}, got {sorted(by_name)}")
        time.sleep(0.2)


def _sample_sum(name: str, **labels: str) -> float:
    """Sum of one Prometheus sample over every series (workers) whose labels include ``labels``."""
    text = httpx.get(metrics_url(), timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def _wait_metric(name: str, at_least: float, timeout: float = 30.0, **labels: str) -> float:
    deadline = time.monotonic() + timeout
    while True:
        value = _sample_sum(name, **labels)
        if value >= at_least or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def test_one_trace_covers_all_four_hops_with_correct_parentage(server, otlp):
    header, trace_id, client_span = _traceparent()
    r = _post(server, {"messages": FRANCE, "temperature": 0, "max_tokens": 20}, header)
    assert r.headers["x-lane"] == "persistent"
    usage = r.json()["usage"]
    spans = _trace(otlp, trace_id, {"POST /v1/chat/completions", "route", "replica.generate",
                                    "generation", "quantum"})
    (http,) = spans["POST /v1/chat/completions"]
    (route,) = spans["route"]
    (replica,) = spans["replica.generate"]
    (generation,) = spans["generation"]
    assert http.parent_span_id == client_span  # continues the client's traceparent
    assert route.parent_span_id == http.span_id  # ingress -> router
    assert replica.parent_span_id == route.span_id  # router -> replica (Ray hop)
    assert generation.parent_span_id == replica.span_id  # replica -> engine actor (Ray hop)
    quanta = spans["quantum"]
    assert all(q.parent_span_id == generation.span_id for q in quanta)
    # the prefill token, then the quanta emit the rest
    assert sum(q.attributes["quantum.tokens_emitted"] for q in quanta) == usage["completion_tokens"] - 1
    assert all(1 <= q.attributes["quantum.tokens_emitted"] <= q.attributes["quantum.size"] <= 8 for q in quanta)
    assert quanta[-1].attributes.get("quantum.finish_reason") or usage["completion_tokens"] == 20
    for span in (http, generation):
        assert span.attributes["gen_ai.request.model"] == MODEL
        assert span.attributes["gen_ai.request.temperature"] == 0.0
        assert span.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
        assert span.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert generation.attributes["lane"] == replica.attributes["lane"] == http.attributes["lane"] == "persistent"
    assert not spans.get("fallback")


def test_standard_generation_trace_after_a_fallback(server, otlp):
    header, trace_id, _ = _traceparent()
    r = _post(server, {"messages": FRANCE, "temperature": 0.7, "seed": 3, "max_tokens": 6}, header)
    assert r.headers["x-lane"] == "standard"
    spans = _trace(otlp, trace_id, {"route", "fallback", "replica.generate", "generation"})
    (route,), (fallback,) = spans["route"], spans["fallback"]
    (replica,), (generation,) = spans["replica.generate"], spans["generation"]
    assert fallback.parent_span_id == route.span_id
    assert fallback.attributes["fallback.reason"] == "non_greedy"
    assert fallback.attributes["fallback.stage"] == "prelaunch"
    assert replica.parent_span_id == route.span_id and generation.parent_span_id == replica.span_id
    assert generation.attributes["lane"] == "standard"
    assert generation.attributes["gen_ai.usage.output_tokens"] == r.json()["usage"]["completion_tokens"]
    assert "quantum" not in spans


# Every fallback reason a client can cause over HTTP in auto mode (the others need a broken or
# differently built lane: see docs/operations.md).
REACHABLE = [
    ("non_greedy", {"messages": FRANCE, "temperature": 0.9, "max_tokens": 2}),
    ("unsupported_decode_batch", {"messages": FRANCE, "temperature": 0, "n": 2, "max_tokens": 2}),
    ("logprobs", {"messages": FRANCE, "temperature": 0, "logprobs": True, "max_tokens": 2}),
    ("logits_processing", {"messages": FRANCE, "temperature": 0, "frequency_penalty": 0.5, "max_tokens": 2}),
]


@pytest.mark.parametrize("reason,body", REACHABLE, ids=[r for r, _ in REACHABLE])
def test_fallback_reason_gives_span_and_counter(server, otlp, reason, body):
    series = {"reason": reason, "stage": "prelaunch"}
    before = _sample_sum("ray_persistent_serve_fallbacks_total", **series)
    header, trace_id, _ = _traceparent()
    assert _post(server, body, header).headers["x-lane"] == "standard"
    (fallback,) = _trace(otlp, trace_id, {"fallback"})["fallback"]
    assert fallback.attributes["fallback.reason"] == reason
    assert _wait_metric("ray_persistent_serve_fallbacks_total", before + 1, **series) >= before + 1


def test_max_sequence_length_fallback_gives_span_and_counter(server, otlp):
    series = {"reason": "max_sequence_length", "stage": "prelaunch"}
    before = _sample_sum("ray_persistent_serve_fallbacks_total", **series)
    header, trace_id, _ = _traceparent()
    # 1023 prompt tokens leave exactly one output token in the 1024-token context
    r = _post(server, {"prompt": [11] * 1023, "temperature": 0, "max_tokens": 1}, header, path="/v1/completions")
    assert r.headers["x-lane"] == "standard"
    (fallback,) = _trace(otlp, trace_id, {"fallback"})["fallback"]
    assert fallback.attributes["fallback.reason"] == "max_sequence_length"
    assert _wait_metric("ray_persistent_serve_fallbacks_total", before + 1, **series) >= before + 1


def test_persistent_capacity_fallback_gives_span_and_counter(server, otlp):
    """While the one persistent replica streams a long request, a second greedy one falls back."""
    series = {"reason": "persistent_capacity", "stage": "prelaunch"}
    before = _sample_sum("ray_persistent_serve_fallbacks_total", **series)
    long = {"model": MODEL, "messages": FRANCE, "temperature": 0, "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    started, release = threading.Event(), threading.Event()

    def hold():
        with httpx.stream("POST", f"{server}/v1/chat/completions", json=long, timeout=120) as r:
            assert r.headers["x-lane"] == "persistent"
            for line in r.iter_lines():
                if line.startswith("data: "):
                    started.set()
                if release.is_set():
                    break

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert started.wait(60)
        header, trace_id, _ = _traceparent()
        r = _post(server, {"messages": FRANCE, "temperature": 0, "max_tokens": 2}, header)
        assert r.headers["x-lane"] == "standard"
    finally:
        release.set()
        holder.join(60)
    (fallback,) = _trace(otlp, trace_id, {"fallback"})["fallback"]
    assert fallback.attributes["fallback.reason"] == "persistent_capacity"
    assert _wait_metric("ray_persistent_serve_fallbacks_total", before + 1, **series) >= before + 1


def test_forced_standard_lane_is_not_a_fallback(server, otlp):
    header, trace_id, _ = _traceparent()
    r = _post(server, {"messages": FRANCE, "temperature": 0, "max_tokens": 4}, header, x_lane="standard")
    assert r.headers["x-lane"] == "standard"
    spans = _trace(otlp, trace_id, {"route", "generation"})
    assert spans["route"][0].attributes["lane.forced"] == "standard"
    assert "fallback" not in spans
    bad = httpx.post(f"{server}/v1/chat/completions", headers={"x-lane": "fast"}, timeout=30,
                     json={"model": MODEL, "messages": FRANCE, "max_tokens": 2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-lane"


def test_latency_histograms_gauges_and_quanta_are_exported(server):
    quanta_before = _sample_sum("ray_persistent_serve_quanta_total")
    _post(server, {"messages": FRANCE, "temperature": 0, "max_tokens": 12, "ignore_eos": True})
    _post(server, {"messages": FRANCE, "temperature": 0.5, "max_tokens": 4, "ignore_eos": True})
    for lane in ("persistent", "standard"):
        for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                     "time_per_output_token_seconds", "e2e_request_latency_seconds",
                     "request_queue_time_seconds"):
            assert _wait_metric(f"ray_persistent_serve_{hist}_count", 1, lane=lane) >= 1, (hist, lane)
        assert _wait_metric("ray_persistent_serve_requests_total", 1, lane=lane) >= 1
        assert _wait_metric("ray_persistent_serve_kv_pages_free", 1, lane=lane) >= 1
    # 12 tokens: the prefill token, then quanta of at most 8 -> at least 2 quanta
    assert _wait_metric("ray_persistent_serve_quanta_total", quanta_before + 2) >= quanta_before + 2
    assert _wait_metric("ray_persistent_serve_tokens_per_quantum_sum", 11) >= 11
    assert _wait_metric("ray_persistent_serve_persistent_decoder_healthy", 1) >= 1
    text = httpx.get(metrics_url(), timeout=10).text
    assert "ray_persistent_serve_kv_pages_in_use" in text


@pytest.fixture(scope="module")
def sampled_none(server, otlp):
    """A small extra app on the session's Serve instance: auto mode with no persistent replica
    (every request falls back with ``disabled``: the lane is off for the replica) and
    ``tracing-sample-ratio=0``."""
    from ray import serve

    from deployments.app import build_app

    serve.run(build_app({"max_model_len": 1024, "num_kv_blocks": 128, "progress": False,
                         "num_persistent_replicas": 0, "tracing_exporter": "otlp",
                         "tracing_endpoint": otlp.endpoint, "tracing_sample_ratio": 0.0}),
              name="sampled", route_prefix="/sampled")
    yield f"{server}/sampled"
    serve.delete("sampled")


def test_ratio_zero_exports_only_fallback_traces_across_every_hop(sampled_none, otlp):
    series = {"reason": "disabled", "stage": "prelaunch"}
    before = _sample_sum("ray_persistent_serve_fallbacks_total", **series)
    # a client trace the client itself did not sample (flags 00): the ratio decides, and it says no
    trace_a, trace_b = secrets.token_hex(16), secrets.token_hex(16)
    forced = _post(sampled_none, {"messages": FRANCE, "temperature": 0, "max_tokens": 3},
                   f"00-{trace_a}-{secrets.token_hex(8)}-00", x_lane="standard")
    assert forced.headers["x-lane"] == "standard"  # forced: not a fallback, so not exported
    fell_back = _post(sampled_none, {"messages": FRANCE, "temperature": 0, "max_tokens": 3},
                      f"00-{trace_b}-{secrets.token_hex(8)}-00")
    assert fell_back.headers["x-lane"] == "standard"
    spans = _trace(otlp, trace_b, {"POST /sampled/v1/chat/completions", "route", "fallback", "replica.generate",
                                   "generation"})
    assert spans["fallback"][0].attributes["fallback.reason"] == "disabled"
    assert spans["generation"][0].parent_span_id == spans["replica.generate"][0].span_id
    assert _wait_metric("ray_persistent_serve_fallbacks_total", before + 1, **series) >= before + 1
    assert not [s for s in otlp.spans() if s.trace_id == trace_a]

"""End to end over real HTTP with the official ``openai`` client against the real Ray app."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.deployments.conftest import HARMONY_MODEL, MODEL, pool_stats

pytestmark = pytest.mark.ray

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def _fallbacks(otlp, request_id: str | None = None, reason: str | None = None):
    def match(span):
        return (
            span.name == "fallback"
            and (reason is None or span.attributes.get("fallback.reason") == reason)
            and (request_id is None or span.attributes.get("request.id") == request_id)
        )
    return otlp.wait_for(match, timeout=20)


def _route_for(otlp, trace_id: str):
    return otlp.wait_for(lambda s: s.name == "route" and s.trace_id == trace_id, timeout=20)[0]


def test_greedy_chat_is_served_by_persistent_lane(client):
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=32)
    body = raw.parse()
    assert raw.headers["x-lane"] == "persistent"
    assert "Paris" in body.choices[0].message.content
    assert body.choices[0].finish_reason == "stop"
    assert body.usage.completion_tokens > 0 and body.usage.prompt_tokens > 0


def test_greedy_chat_streams_from_persistent_lane_in_quanta(client):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=32, stream=True,
        stream_options={"include_usage": True},
    )
    assert raw.headers["x-lane"] == "persistent"
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens > 1
    # one chunk for the prefill token, then one per quantum of up to 8 tokens
    assert len(content_chunks) <= 1 + -(-(usage.completion_tokens - 1) // 8)


def test_sampled_request_falls_back_with_span(client, otlp):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=FRANCE, temperature=0.8, max_tokens=16, seed=1
    )
    assert raw.headers["x-lane"] == "standard"
    assert raw.parse().choices[0].message.content
    span = _fallbacks(otlp, reason="non_greedy")[-1]
    assert span.attributes["fallback.stage"] == "prelaunch"
    assert span.attributes["lane"] == "standard"
    route = _route_for(otlp, span.trace_id)
    assert span.parent_span_id == route.span_id
    assert route.attributes["reason"] == "non_greedy" and route.attributes["mode"] == "auto"


def test_n2_falls_back_unsupported_decode_batch(client, otlp):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=8, n=2
    )
    body = raw.parse()
    assert raw.headers["x-lane"] == "standard"
    assert sorted(c.index for c in body.choices) == [0, 1]
    assert body.choices[0].message.content == body.choices[1].message.content  # greedy: identical
    _fallbacks(otlp, reason="unsupported_decode_batch")


def test_stop_strings_run_on_the_persistent_lane_and_are_honoured(client):
    """lm-eval's GSM8K sends stop strings with every request: they are checked on the host after each quantum."""
    kwargs = dict(model=MODEL, messages=FRANCE, temperature=0, max_tokens=32, stop=["Paris", "Question:"])
    raw = client.chat.completions.with_raw_response.create(**kwargs)
    body = raw.parse()
    assert raw.headers["x-lane"] == "persistent"
    assert body.choices[0].finish_reason == "stop"
    standard = client.chat.completions.with_raw_response.create(**kwargs, extra_headers={"x-lane": "standard"})
    assert standard.headers["x-lane"] == "standard"
    assert standard.parse().choices[0].message.content == body.choices[0].message.content
    assert body.choices[0].message.content.endswith("capital of France is ")
    assert body.usage == standard.parse().usage


def test_a_stop_string_ends_the_request_in_the_engine_too(client, server):
    """The ingress makes the text and finds stop strings (``replicas.output_processor``); ending the stream
    there aborts the request in the engine at its next step: it does not decode on to ``max_tokens``."""
    import time

    for lane in ("persistent", "standard"):
        before = pool_stats(server)[lane]["tokens_generated"]
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=FRANCE, temperature=0, max_tokens=600, stop=["Paris"],
            extra_body={"ignore_eos": True}, extra_headers={"x-lane": lane})
        body = raw.parse()
        assert raw.headers["x-lane"] == lane
        assert body.choices[0].finish_reason == "stop" and "Paris" not in body.choices[0].message.content
        deadline = time.monotonic() + 60
        while (stats := pool_stats(server)[lane])["running"] and time.monotonic() < deadline:
            time.sleep(0.1)
        generated = stats["tokens_generated"] - before
        assert stats["running"] == 0
        assert body.usage.completion_tokens <= generated < 200, (lane, body.usage, generated)


def test_lanes_give_identical_greedy_text(client):
    persistent = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=24)
    standard = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=24, n=2)
    assert persistent.choices[0].message.content == standard.choices[0].message.content


def test_output_comes_over_the_direct_stream_and_matches_the_ray_path(server, off_app):
    """On ``/`` (``direct_stream`` on) both lanes' chunks come over the engines' direct streams once the
    engines are connected (the router counts such dispatches, each engine reports its connection);
    ``/off`` sends them back through Ray (``direct_stream`` off there), and the greedy text is the same."""
    import json

    from tests.deployments.conftest import pool_stats

    def text(base: str, lane: str | None) -> str:
        body = {"model": MODEL, "messages": FRANCE, "temperature": 0, "max_tokens": 24, "ignore_eos": True,
                "stream": True}
        out = []
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120,
                          headers={"x-lane": lane} if lane else {}) as r:
            assert r.status_code == 200 and r.headers["x-lane"] == (lane or "standard")
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choices = json.loads(line[6:])["choices"]
                    out += [c["delta"].get("content") or "" for c in choices]
        return "".join(out)

    before = pool_stats(server)["router"]["direct_stream"]
    assert before["enabled"] is True
    texts = {lane: [text(server, lane) for _ in range(3)] for lane in ("persistent", "standard")}
    after = pool_stats(server)
    direct = after["router"]["direct_stream"]
    # the first dispatch to an engine that has no connection yet goes through Ray and starts the connect
    assert direct["dispatches"] - before["dispatches"] >= 4, (before, direct)
    assert direct["connections"] >= 2 and direct["refused"] == 0
    for lane in ("persistent", "standard"):
        assert all(e["direct_streams"]["connected"] >= 1 for e in after[lane]["engines"]), after[lane]
    off = pool_stats(off_app)
    assert off["router"]["direct_stream"] == {"enabled": False, "dispatches": 0}
    ray_path = text(off_app, None)
    assert len({*texts["persistent"], *texts["standard"], ray_path}) == 1, (texts, ray_path)
    assert off["standard"]["engines"][0]["direct_streams"]["connected"] == 0


def test_completions_endpoint_streams(client):
    stream = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                       temperature=0, stream=True)
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert "Paris" in text


@pytest.mark.parametrize("kwargs,status", [
    ({"messages": FRANCE, "max_tokens": -1}, 400),
    ({"messages": []}, 400),
    ({"messages": FRANCE, "model": "no-such-model"}, 404),
    ({"messages": FRANCE, "temperature": 5}, 400),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400),
])
def test_invalid_requests_get_openai_errors_and_server_keeps_serving(client, kwargs, status):
    args = {"model": MODEL, **kwargs}
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(**args)
    assert info.value.status_code == status
    err = info.value.response.json()["error"]
    assert err["message"] and err["type"]
    ok = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=4)
    assert ok.choices[0].message.content


def test_missing_messages_field(server):
    r = httpx.post(f"{server}/v1/chat/completions", json={"model": MODEL}, timeout=30)
    assert r.status_code == 400
    assert "messages" in r.json()["error"]["message"]


def test_prompt_longer_than_context_names_limits(client):
    long = [{"role": "user", "content": "word " * 2000}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=long, temperature=0)
    msg = info.value.response.json()["error"]["message"]
    assert "1024" in msg and "context" in msg


def test_models_and_health(server):
    models = httpx.get(f"{server}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}


def test_models_retrieve(harmony_app, client):
    """``GET /v1/models/{id}`` (``client.models.retrieve``): the served model's card, else 404 model_not_found."""
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "persistent-serve")
    assert card.model_extra["max_model_len"] == 1024
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-5")
    assert info.value.response.json()["error"]["code"] == "model_not_found"
    r = httpx.get(f"{harmony_app}/v1/models/{HARMONY_MODEL}")
    assert r.status_code == 200 and r.json()["id"] == HARMONY_MODEL


def test_off_mode_serves_everything_on_standard_lane(off_app, otlp):
    c = openai.OpenAI(base_url=f"{off_app}/v1", api_key="unused", max_retries=0, timeout=120)
    raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=16)
    assert raw.headers["x-lane"] == "standard"
    assert "Paris" in raw.parse().choices[0].message.content
    route = otlp.wait_for(lambda s: s.name == "route" and s.attributes.get("mode") == "off")[-1]
    assert route.attributes["reason"] == "disabled"
    assert not [s for s in otlp.spans() if s.name == "fallback" and s.trace_id == route.trace_id]


@pytest.mark.parametrize("temperature,lane", [(0.8, "standard"), (0.0, "persistent")])
def test_client_disconnect_aborts_and_frees_pages(server, temperature, lane):
    """A client that goes away mid-stream stops its request: pages return long before it could finish."""
    import time

    from tests.deployments.conftest import assert_pages_returned, pool_stats

    body = {"model": MODEL, "messages": FRANCE, "temperature": temperature, "max_tokens": 900,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.headers["x-lane"] == lane
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: "):
                got += 1
            if got >= 3:
                break
        busy = pool_stats(server)[lane]
        assert busy["kv_pages_free"] < busy["kv_pages_total"]
    start = time.monotonic()
    assert_pages_returned(server, timeout=8.0)
    # 900 tokens would take far longer than this on CPU: the request was aborted
    assert time.monotonic() - start < 8.0


@pytest.mark.parametrize("path,kwargs,status,needle", [
    ("/v1/chat/completions", {"content": b'{"model": "m", "messages": [}',
                              "headers": {"content-type": "application/json"}}, 400, "not valid JSON"),
    ("/v1/chat/completions", {"content": b"model=m", "headers": {"content-type": "text/plain"}}, 400, "JSON object"),
    ("/v1/chat/completions", {"json": {"model": "\ud800", "messages": FRANCE}}, 404, "does not exist"),
    ("/v1/completions", {"json": {"model": MODEL, "prompt": "hi \ud800 there", "max_tokens": 2}}, 400, "tokenize"),
    ("/v1/chat/completions", {"json": {"model": MODEL, "messages": FRANCE, "seed": 10**30}}, 400, "seed"),
    ("/v1/chat/completions", {"json": {"model": MODEL, "messages": FRANCE, "tools": [{"type": "function"}]}},
     400, "tools"),
    ("/v1/completions", {"json": {"model": MODEL, "prompt": "hi", "logprobs": 6}}, 400, "logprobs"),
    ("/v1/completions", {"json": {"model": MODEL, "prompt": [1, "hi"]}}, 400, "do not mix"),
    ("/v1/no-such-endpoint", {"json": {}}, 404, "Not Found"),
])
def test_malformed_http_gets_openai_error(server, path, kwargs, status, needle):
    import json

    if "json" in kwargs:  # lone surrogates must go over the wire as JSON escapes
        kwargs = {"content": json.dumps(kwargs["json"]).encode(), "headers": {"content-type": "application/json"}}
    r = httpx.post(f"{server}{path}", timeout=30, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] or needle == err.get("param"), err
    assert httpx.get(f"{server}/health").status_code == 200


def test_each_engine_actor_runs_in_its_replicas_placement_group(server):
    """Every engine actor sits in bundle 1 of its own replica's placement group (one group per replica)."""
    from ray.util import placement_group_table

    from tests.deployments.conftest import pool_stats

    stats = pool_stats(server)
    groups = [e["placement_group_id"] for lane in ("standard", "persistent") for e in stats[lane]["engines"]]
    assert len(groups) == 2 and all(groups) and len(set(groups)) == 2, stats
    table = placement_group_table()
    for pg in groups:
        bundles = table[pg]["bundles"]
        assert len(bundles) == 2 and bundles[1]["CPU"] == 0.5, bundles  # shell + engine bundle
        assert table[pg]["strategy"] == "STRICT_PACK"


def test_nulls_mean_defaults_and_empty_stop_is_ignored(client):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=FRANCE, max_tokens=12,
        extra_body={"temperature": 0, "n": None, "top_p": None, "presence_penalty": None, "stop": [""]})
    assert raw.headers["x-lane"] == "persistent"  # "" is no stop string: still eligible
    assert "Paris" in raw.parse().choices[0].message.content


def test_max_tokens_past_the_context_is_refused_not_truncated(server):
    long = [{"role": "user", "content": "word " * 900}]
    r = httpx.post(f"{server}/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": long, "max_tokens": 500})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens" and "1024" in err["message"]

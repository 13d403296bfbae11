"""``topology=direct`` over real HTTP: one deployment of co-located replicas that are also the ingress, each
routing to its own engine's lanes in process (``deployments/direct.py``)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.deployments.conftest import (
    ASK,
    MODEL,
    assert_busy_persistent_lane_spills_at_once,
    assert_pages_returned,
    chat,
    extra_app,
    pool_stats,
)

pytestmark = pytest.mark.ray

@pytest.fixture(scope="module")
def direct(server, otlp):
    # a context long enough for a stream that outlives the disconnect test's reads by seconds
    with extra_app(server, otlp, "direct", topology="direct", max_model_len=1024, num_kv_blocks=96) as base:
        yield base


def test_one_deployment_serves_both_lanes_with_the_two_pool_apps_tokens(direct, server):
    """The app is one deployment; greedy goes persistent and sampled standard there, a forced standard greedy
    request too, all with the two-pool app's greedy text; streamed completions end with ``[DONE]``."""
    from ray import serve

    assert list(serve.status().applications["direct"].deployments) == ["DirectReplica"]
    greedy = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient() as c:
            reference = await chat(c, server, **greedy)
            persistent = await chat(c, direct, **greedy)
            standard = await chat(c, direct, "standard", **greedy)
            sampled = await chat(c, direct, temperature=0.9, seed=1, max_tokens=8)
            async with c.stream("POST", f"{direct}/v1/completions", timeout=300, json={
                    "model": MODEL, "prompt": "The sea is", "max_tokens": 8, "temperature": 0, "stream": True,
                    "ignore_eos": True}) as r:
                streamed = (r.status_code, r.headers.get("x-lane"), [line async for line in r.aiter_lines() if line])
            return reference, persistent, standard, sampled, streamed

    reference, persistent, standard, sampled, streamed = asyncio.run(main())
    for r in (reference, persistent, standard, sampled):
        assert r.status_code == 200, r.text
    assert [r.headers["x-lane"] for r in (reference, persistent, standard, sampled)] == [
        "persistent", "persistent", "standard", "standard"]
    text = reference.json()["choices"][0]["message"]["content"]
    assert persistent.json()["choices"][0]["message"]["content"] == text
    assert standard.json()["choices"][0]["message"]["content"] == text
    assert sampled.json()["usage"]["completion_tokens"] > 0
    status, lane, lines = streamed
    assert status == 200 and lane == "persistent"
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"])
    stats = assert_pages_returned(direct)
    assert stats["colocated"]["replicas"] == 1 and "standard" not in stats and "persistent" not in stats
    assert stats["router"]["served"]["persistent"] >= 2 and stats["router"]["served"]["standard"] >= 2


def test_a_busy_persistent_lane_spills_to_the_standard_lane_of_the_same_replica(direct):
    assert_busy_persistent_lane_spills_at_once(direct, ASK)


def test_health_and_openai_errors(direct):
    assert httpx.get(f"{direct}/health", timeout=30).json() == {"status": "ok"}
    cases = [  # (body, headers, status, error code or param)
        ({"model": MODEL, "messages": ASK, "max_tokens": -1}, {}, 400, None),
        ({"model": "no-such-model", "messages": ASK}, {}, 404, "model_not_found"),
        ({"model": MODEL, "messages": ASK}, {"x-lane": "fastest"}, 400, "x-lane"),
        ({"model": MODEL, "messages": ASK, "max_tokens": 100_000}, {}, 400, "context_length_exceeded"),
    ]
    for body, headers, status, code in cases:
        r = httpx.post(f"{direct}/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert error["message"] and error["type"] in ("invalid_request_error", "not_found_error"), error
        if code is not None:
            assert code in (error.get("code"), error.get("param")), error
    r = httpx.post(f"{direct}/v1/chat/completions", content=b"{not json", timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json(), r.text
    assert_pages_returned(direct)


def test_client_disconnect_stops_the_in_process_request_and_frees_its_pages(direct):
    """A client leaving mid-stream cancels the in-process dispatch (``LocalStream.cancel``), which cancels the
    engine's work: the page pool is full again with far fewer tokens made than were asked for, on either lane."""
    def made(lane: str) -> int:
        return pool_stats(direct)["colocated"]["engines"][0]["lanes"][lane]["tokens_generated"]

    asked = 900
    for lane in ("persistent", "standard"):
        before = made(lane)
        body = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": asked, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{direct}/v1/chat/completions", json=body, headers={"x-lane": lane},
                          timeout=60) as r:
            assert r.status_code == 200 and r.headers["x-lane"] == lane
            got, seen = 0, []
            for line in r.iter_lines():
                seen.append(line)
                got += line.startswith("data: ")
                if got >= 3:
                    break
            assert not any('"error"' in line for line in seen), seen
            events = [json.loads(line[6:]) for line in seen if line.startswith("data: {")]
            # still running at the disconnect, as its stream says (a pages-in-use reading here is not asserted:
            # it read 0 now and then on the CPU VM, cause not found; see decision 0032)
            assert not any(c.get("finish_reason") for e in events for c in e["choices"]), seen
        assert_pages_returned(direct)
        assert 0 < made(lane) - before < asked, (lane, before, made(lane))

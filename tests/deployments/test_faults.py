"""Injected persistent-backend failures (``persistent_fault_injection``) over real HTTP.

After launch: that request gets a clear error, the decoder is marked unhealthy,
Serve's health check replaces the replica, a concurrent request on another
replica is unaffected. Prelaunch: the request continues on the reference path
and succeeds with the same tokens.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.deployments.conftest import MODEL, assert_pages_returned, extra_app, pool_stats

pytestmark = pytest.mark.ray

ASK = [{"role": "user", "content": "Count from one to fifty in words."}]


async def _chat(client: httpx.AsyncClient, base: str, **body) -> httpx.Response:
    return await client.post(f"{base}/v1/chat/completions", timeout=120,
                             json={"model": MODEL, "messages": ASK, **body})


def _persistent_engine(base: str) -> dict:
    engines = pool_stats(base)["persistent"]["engines"]
    assert len(engines) <= 1, engines
    return engines[0] if engines else {}


def test_failure_after_launch_errors_that_request_and_serve_replaces_the_replica(server, otlp):
    fault = {"stage": "after_launch", "every_n": 2}
    with extra_app(server, otlp, "faulty", persistent_fault_injection=fault,
                   persistent_pool={"health_check_period_s": 1.0}) as base:
        before = _persistent_engine(base)
        assert before["decoder_healthy"]

        async def main():
            async with httpx.AsyncClient() as c:
                other = asyncio.create_task(_chat(c, base, temperature=0.9, seed=3, max_tokens=64, ignore_eos=True))
                await asyncio.sleep(0.2)
                # prefill token + quantum 1 (ok) + quantum 2 (fails after launch)
                failing = await _chat(c, base, temperature=0, max_tokens=40, ignore_eos=True)
                return failing, await other

        failing, other = asyncio.run(main())
        assert failing.status_code == 500, failing.text
        err = failing.json()["error"]
        assert err["code"] == "backend_launch_error" and "failed after launch" in err["message"], err
        assert other.status_code == 200 and other.headers["x-lane"] == "standard"
        assert other.json()["usage"]["completion_tokens"] == 64  # the concurrent request is unaffected
        span = otlp.wait_for(lambda s: s.name == "fallback" and s.attributes.get("fallback.stage") == "postlaunch"
                             and s.attributes.get("fallback.reason") == "backend_launch_error", timeout=20)
        assert span

        # Serve's health check fails on the unhealthy decoder and a fresh replica takes over
        deadline = time.monotonic() + 150
        after: dict = {}
        while time.monotonic() < deadline:
            after = _persistent_engine(base)
            if after and after["placement_group_id"] != before["placement_group_id"] and after["decoder_healthy"]:
                break
            time.sleep(1)
        else:
            raise AssertionError(f"persistent replica was not replaced: {after}")
        # one quantum after the prefill token: below every_n, so the fresh replica serves it
        deadline = time.monotonic() + 30
        while True:
            ok = httpx.post(f"{base}/v1/chat/completions", timeout=120,
                            json={"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 8})
            assert ok.status_code == 200, ok.text
            if ok.headers["x-lane"] == "persistent" or time.monotonic() > deadline:
                break
            time.sleep(1)  # the router skips the lane for a few seconds after a failure
        assert ok.headers["x-lane"] == "persistent"
        assert_pages_returned(base)


def test_prelaunch_failure_falls_back_and_succeeds_with_the_same_tokens(server, otlp):
    body = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 24, "ignore_eos": True}
    expected = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=120)
    assert expected.status_code == 200 and expected.headers["x-lane"] == "persistent"
    with extra_app(server, otlp, "prefault", persistent_fault_injection={"stage": "prelaunch", "every_n": 1}) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.headers["x-lane"] == "persistent"
        assert r.json()["choices"][0]["message"]["content"] == expected.json()["choices"][0]["message"]["content"]
        spans = otlp.wait_for(lambda s: s.name == "fallback" and s.attributes.get("fallback.reason") == "injected_fault",
                              timeout=20)
        assert spans[0].attributes["continued_on"] == "reference_decode"
        assert _persistent_engine(base)["decoder_healthy"]  # a prelaunch failure is not a health problem
        assert_pages_returned(base)

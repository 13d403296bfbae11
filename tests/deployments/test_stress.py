"""The longer reliability runs (CI stage ``make test-stress``): a 1,000-request soak and
schemathesis against the ingress's OpenAPI schema, both over real HTTP to the real app.

Their numbers go to docs/reliability.md (run with ``-s`` to see them printed).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from hypothesis import HealthCheck, settings

from ops.tools.soak import soak
from tests.deployments.conftest import assert_pages_returned, extra_app

schemathesis = pytest.importorskip("schemathesis")

pytestmark = [pytest.mark.ray, pytest.mark.stress]

FUZZ_EXAMPLES = 25
"""Examples per operation: 7 operations x 25 keeps the run to a couple of minutes on 2 cores."""


def test_soak_of_1000_mixed_requests_loses_nothing_and_leaks_no_pages(server):
    result = asyncio.run(soak(server, requests=1000, concurrency=16, progress=False))
    print("\nsoak:", json.dumps(result))
    assert result["lost"] == 0, result["lost_reasons"]
    assert result["ok"] == 1000
    assert result["leaked_pages"] == 0
    assert_pages_returned(server)


@pytest.fixture(scope="module")
def fuzz_app(server, otlp):
    # a short context keeps every generated completion short (the fuzzer picks max_tokens freely; the 200s of
    # chat and responses were 550 of the run's 630 s at 96 tokens). A chat prompt is 31 tokens at the least.
    with extra_app(server, otlp, "fuzz", max_model_len=64, num_kv_blocks=128) as base:
        yield base


@pytest.fixture(scope="module")
def fuzz_schema(fuzz_app):
    return schemathesis.openapi.from_dict(httpx.get(f"{fuzz_app}/openapi.json", timeout=30).json())


schema = schemathesis.pytest.from_fixture("fuzz_schema")
STATUSES: dict[int, int] = {}


@schema.parametrize()
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_fuzzed_requests_never_get_5xx_and_errors_are_openai_shaped(fuzz_app, case):
    response = case.call(base_url=fuzz_app, timeout=120)
    STATUSES[response.status_code] = STATUSES.get(response.status_code, 0) + 1
    assert response.status_code < 500, (case.path, case.body, response.text)
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"}, body
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]


def test_fuzz_left_the_app_healthy_and_leak_free(fuzz_app):
    print("\nschemathesis status counts:", json.dumps(dict(sorted(STATUSES.items()))))
    assert httpx.get(f"{fuzz_app}/health", timeout=10).status_code == 200
    assert_pages_returned(fuzz_app, timeout=30)

"""The request guard's decisions without Ray: keys, admin access, limits, config and CLI spellings.

The same guard runs in the ingress; tests/deployments/test_security.py checks it over real HTTP.
"""

from __future__ import annotations

import asyncio
import hmac

import pytest

from deployments.cli import parse_args
from deployments.config import AppConfig
from deployments.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError
from deployments.security import (
    KeySet,
    RequestGuard,
    RequestLimits,
    SecurityConfig,
    bearer_token,
    route_path,
)
from replicas import envs


def _scope(path="/v1/models", key=None, client=("127.0.0.1", 5000), root=""):
    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    return {"type": "http", "path": root + path, "root_path": root, "headers": headers, "client": client}


def _guard(api=(), admin=(), **limits):
    return RequestGuard(SecurityConfig(api_key=list(api), admin_api_key=list(admin)), RequestLimits(**limits),
                        max_model_len=1024, env_api_keys=(), env_admin_keys=())


def test_every_key_is_compared_in_constant_time(monkeypatch):
    calls = []
    real = hmac.compare_digest

    def counting(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr("deployments.security.hmac.compare_digest", counting)
    keys = KeySet(["first", "second", "third-key"])
    for presented in ("first", "third-key", "nope", "x" * 500):
        calls.clear()
        keys.matches(presented)
        assert calls == [(32, 32)] * 3  # all keys, equal-length digests, whatever matched
    assert keys.matches("second") and not keys.matches("secon") and not keys.matches(None)


def test_bearer_token_parsing():
    assert bearer_token([(b"Authorization", b"Bearer abc")]) == "abc"
    assert bearer_token([(b"authorization", b"bearer  abc ")]) == "abc"
    assert bearer_token([(b"authorization", b"Basic abc")]) is None
    assert bearer_token([(b"authorization", b"Bearer ")]) is None
    assert bearer_token([]) is None


def test_authorize_routes():
    g = _guard(api=["k1"], admin=["a1"])
    assert g.authorize(_scope("/health")) is None
    assert g.authorize(_scope("/v1/models", "k1")) is None
    assert g.authorize(_scope("/v1/models", "a1")) is None  # admin keys are API keys
    for denied in (_scope("/v1/models"), _scope("/v1/models", "k2"), _scope("/tokenize", "k1x"),
                   _scope("/debug/stats", "k1"), _scope("/debug/stats")):
        err = g.authorize(denied)
        assert err is not None and err.status == 401 and err.code == "invalid_api_key"
        assert "k1" not in err.message and "a1" not in err.message
    assert g.authorize(_scope("/debug/stats", "a1", client=("10.1.2.3", 1))) is None
    # the route prefix of a Serve app is stripped before matching
    assert g.authorize(_scope("/health", root="/off")) is None
    assert route_path(_scope("/v1/models", root="/off")) == "/v1/models"


def test_admin_routes_without_an_admin_key_answer_loopback_only():
    g = _guard()
    assert g.authorize(_scope("/v1/models")) is None  # no API key configured: the API is open
    assert g.authorize(_scope("/debug/stats", client=("127.0.0.1", 1))) is None
    assert g.authorize(_scope("/debug/stats", client=("::1", 1))) is None
    for client in (("10.0.0.7", 1), ("192.168.1.2", 1), None, ("not-an-ip", 1)):
        err = g.authorize(_scope("/debug/stats", client=client))
        assert err is not None and err.status == 403 and err.code == "admin_only"


def test_behind_haproxy_no_client_is_trusted_as_local(monkeypatch):
    # HAProxy connects to the replica itself: a remote client arrives from its (loopback) address
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
    g = _guard()
    assert not g.trust_loopback and g.stats()["admin_access"] == "none"
    for client in (("127.0.0.1", 1), ("::1", 1), ("10.0.0.7", 1)):
        err = g.authorize(_scope("/debug/stats", client=client))
        assert err is not None and err.status == 403 and err.code == "admin_only" and "HAProxy" in err.message
    assert g.refused["forbidden"] == 3
    assert g.authorize(_scope("/v1/models")) is None  # the API itself is unchanged
    keyed = _guard(admin=["a1"])
    assert keyed.authorize(_scope("/debug/stats", "a1")) is None and keyed.stats()["admin_access"] == "admin_key"
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")  # Ray's own test: "1" and nothing else
    assert _guard().trust_loopback and _guard().authorize(_scope("/debug/stats")) is None


def test_environment_keys_add_to_the_options(monkeypatch):
    monkeypatch.setenv("PERSISTENT_SERVE_API_KEY", "env-1, env-2\nenv-3")
    monkeypatch.setenv("PERSISTENT_SERVE_ADMIN_API_KEY", "env-admin")
    assert envs.api_keys() == ("env-1", "env-2", "env-3") and envs.admin_api_keys() == ("env-admin",)
    g = RequestGuard(SecurityConfig(api_key="opt-1"), RequestLimits(), 1024)
    for key in ("opt-1", "env-1", "env-3", "env-admin"):
        assert g.authorize(_scope("/v1/models", key)) is None
    assert g.stats()["api_keys"] == 4 and g.stats()["admin_api_keys"] == 1
    monkeypatch.delenv("PERSISTENT_SERVE_API_KEY")
    assert envs.api_keys() == ()
    assert {v.name for v in envs.VARIABLES} >= {"PERSISTENT_SERVE_API_KEY", "PERSISTENT_SERVE_ADMIN_API_KEY"}


def test_keys_never_show_in_config_reprs_dumps_or_stats():
    config = AppConfig.from_args({"api-key": "sk-aaa,sk-bbb", "admin_api_key": ["adm-ccc"]})
    assert len(config.security.api_key) == 2 and len(config.security.admin_api_key) == 1
    for text in (repr(config), str(config), config.model_dump_json(), str(config.model_dump())):
        assert "sk-aaa" not in text and "sk-bbb" not in text and "adm-ccc" not in text
    stats = RequestGuard(config.security, config.limits, 1024, env_api_keys=(), env_admin_keys=()).stats()
    assert "sk-aaa" not in repr(stats) and stats["api_keys"] == 2


def test_cli_and_flat_serve_args():
    args = parse_args(["--api-key", "k1", "k2", "--api-key", "k3", "--max-request-body-bytes", "65536",
                       "--allow-special-tokens", "--max-output-tokens", "64", "--keep-alive-timeout-s", "5"])
    assert args["api_key"] == ["k1", "k2", "k3"] and args["keep_alive_timeout_s"] == 5
    args.pop("host"), args.pop("port"), args.pop("keep_alive_timeout_s")
    config = AppConfig.from_args(args)
    assert len(config.security.api_key) == 3 and config.security.allow_special_tokens
    assert config.limits.max_request_body_bytes == 65536 and config.limits.max_output_tokens == 64
    flat = AppConfig.from_args({"max-messages": 8, "request-idle-timeout-s": 2, "allow-special-tokens": "false"})
    assert flat.limits.max_messages == 8 and flat.limits.request_idle_timeout_s == 2
    assert AppConfig().security.allow_special_tokens is False and AppConfig().security.api_key == ()


def _chat(**kw):
    return ChatCompletionRequest(model="m", messages=kw.pop("messages", [{"role": "user", "content": "hi"}]), **kw)


@pytest.mark.parametrize(("request_", "param"), [
    (_chat(messages=[{"role": "user", "content": "a"}] * 5), "messages"),
    (_chat(messages=[{"role": "user", "content": "a" * 60}, {"role": "user", "content": "b" * 50}]),
     "messages.1.content"),
    (_chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a" * 101}]}]), "messages.0.content"),
    (CompletionRequest(model="m", prompt="p" * 101), "prompt"),
    (CompletionRequest(model="m", prompt=["p" * 60, "r", "q" * 50]), "prompt.2"),  # batched: counted together
    (_chat(stop=["x" * 9]), "stop.0"),
    (_chat(stop_token_ids=[1, 2, 3]), "stop_token_ids"),
    (_chat(n=3), "n"),
    (_chat(max_tokens=33), "max_tokens"),
    (_chat(max_completion_tokens=33), "max_completion_tokens"),
])
def test_check_request_names_the_parameter(request_, param):
    g = _guard(max_messages=4, max_prompt_chars=100, max_stop_chars=8, max_stop_token_ids=2, max_n=2,
               max_output_tokens=32)
    with pytest.raises(OpenAIError) as info:
        g.check_request(request_)
    assert info.value.status == 400 and info.value.param == param


def test_check_request_passes_ordinary_requests_and_defaults_follow_the_context():
    g = _guard()
    assert g.max_prompt_chars == 32 * 1024
    with pytest.raises(OpenAIError) as info:  # no prompt fits next to this many output tokens
        g.check_request(CompletionRequest(model="m", prompt="p", max_tokens=1024))
    assert info.value.code == "context_length_exceeded" and info.value.param == "max_tokens"
    g.check_request(_chat(max_tokens=1023, stop=["\n\n"], n=16))
    g.check_request(CompletionRequest(model="m", prompt=[1, 2, 3]))


async def _read(guard, scope, messages, delay_s=0.0):
    queue = list(messages)

    async def receive():
        if not queue:
            await asyncio.sleep(3600)
        await asyncio.sleep(delay_s)
        return queue.pop(0)

    return await guard.read_body(scope, receive)


def test_read_body_limits_and_timeouts():
    g = _guard(max_request_body_bytes=2048, request_body_timeout_s=0.5, request_idle_timeout_s=0.2)
    scope = _scope()
    chunks = [{"type": "http.request", "body": b"a" * 1000, "more_body": True},
              {"type": "http.request", "body": b"b" * 1000, "more_body": False}]
    assert asyncio.run(_read(g, scope, chunks)) == b"a" * 1000 + b"b" * 1000
    too_big = [{"type": "http.request", "body": b"a" * 1500, "more_body": True}] * 2
    with pytest.raises(OpenAIError) as info:
        asyncio.run(_read(g, scope, too_big))
    assert info.value.status == 413 and info.value.headers["Connection"] == "close"
    declared = {**scope, "headers": [(b"content-length", b"999999")]}
    with pytest.raises(OpenAIError) as info:  # refused from the header alone, nothing read
        asyncio.run(_read(g, declared, []))
    assert info.value.status == 413 and "999999" in info.value.message
    with pytest.raises(OpenAIError) as info:  # nothing after the first chunk: idle timeout
        asyncio.run(_read(g, scope, chunks[:1]))
    assert info.value.status == 408 and "request-idle-timeout-s" in info.value.message
    trickle = [{"type": "http.request", "body": b"x", "more_body": True}] * 100
    with pytest.raises(OpenAIError) as info:  # each gap under the idle timeout, the whole too slow
        asyncio.run(_read(g, scope, trickle, delay_s=0.1))
    assert info.value.status == 408 and "request-body-timeout-s" in info.value.message
    assert asyncio.run(_read(g, scope, [{"type": "http.disconnect"}])) is None
    assert g.stats()["refused"] == {"unauthorized": 0, "forbidden": 0, "too_large": 2, "timeout": 2}

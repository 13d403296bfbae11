"""Who may call the app and how much one request may ask: API keys, request limits, body timeouts.

One pure ASGI middleware (:class:`RequestGuardMiddleware`) runs in front of the ingress's FastAPI
routes, before FastAPI reads the body:

1. **API keys.** With keys configured (option ``api-key``, or ``envs.API_KEY``, a variable),
   every route except ``/health`` needs ``Authorization: Bearer KEY``, else 401 in OpenAI's error
   format. Keys are compared in constant time (``hmac.compare_digest`` over SHA-256 digests, every
   configured key compared, no early exit). Admin routes (``/debug/...``) need an admin key
   (``admin-api-key``, ``envs.ADMIN_API_KEY``); with none configured they answer only
   clients on a loopback address, and nobody behind Ray Serve's HAProxy ingress
   (``RAY_SERVE_ENABLE_HA_PROXY=1``), where every client reaches the replica from HAProxy's address
   and that is a loopback one on the same node (decision 0027). A key never reaches a log line, a span or a metric label: the
   guard reads the header and keeps only whether it matched.
2. **Body size and time.** A ``Content-Length`` above ``max-request-body-bytes`` is refused with
   413 before a byte is read; a body without one is counted as it arrives and refused at the limit.
   The whole body must arrive within ``request-body-timeout-s`` and no gap between its chunks may
   exceed ``request-idle-timeout-s`` (408 otherwise), so a body shorter than its ``Content-Length``
   or one that trickles in cannot hold a connection. These errors close the connection.
3. **HTTP/1.0.** HTTP/1.0 has no chunked transfer encoding, and Serve's HTTP server (uvicorn with
   httptools) chunks every response that has no ``Content-Length``. To an HTTP/1.0 client a
   response without one (a stream) is therefore sent whole, with ``Content-Length``, once complete.

Why here and not in Ray Serve: Serve's proxy (``ray/serve/_private/proxy.py``,
``proxy_asgi_receive``) reads the body from uvicorn into an unbounded per-request queue as fast as
it arrives, and the ingress replica pulls it into another (``ASGIReceiveProxy`` in
``ray/serve/_private/http_util.py``); neither has a size limit or a read timeout, and uvicorn only
bounds the header size. The ingress replica is invoked as soon as the headers are parsed, so it is
the first place that can refuse a body. ``docs/operations.md`` ("Security") lists the settings.

:class:`RequestGuard` also checks the limits of a parsed request that are cheaper to enforce
before tokenizing (prompt characters, messages, stop strings, ``n``, ``max_tokens``).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import logging
import os
from collections.abc import Awaitable, Callable, Iterable

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from deployments.protocol import OpenAIError
from replicas import envs

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health"})
"""Routes that never need a key (load balancers and Kubernetes probes call them)."""

ADMIN_PREFIXES = ("/debug/",)
"""Routes that need an admin key, or a loopback client when no admin key is configured."""

PROMPT_CHARS_PER_TOKEN = 32
"""``max_prompt_chars`` default = this x ``max_model_len``. Real text averages about 4 characters
per token (byte-level BPE); a prompt above 32 per token cannot be a prompt that fits the context
except for long runs of one repeated character, so refusing it before tokenizing loses nothing."""


def _split_keys(value) -> tuple[str, ...]:
    """Keys from a string (comma- or whitespace-separated) or a list of strings; empties dropped."""
    if value is None:
        return ()
    if isinstance(value, SecretStr):
        value = value.get_secret_value()
    if isinstance(value, str):
        value = value.replace(",", " ").split()
    out = []
    for item in value:
        item = item.get_secret_value() if isinstance(item, SecretStr) else str(item)
        out.extend(k for k in item.replace(",", " ").split() if k)
    return tuple(out)


class SecurityConfig(BaseModel):
    """API keys and how client text is tokenized.

    The keys given here are added to those of the environment variables ``envs.API_KEY`` /
    ``envs.ADMIN_API_KEY`` (``replicas/envs.py``), which are the way to pass them in production: a
    config file never needs a literal key.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    api_key: tuple[SecretStr, ...] = Field(
        (), description="API keys clients send as `Authorization: Bearer KEY` (one or more; a string is split "
        f"at commas). Set: every route but /health needs one. Prefer ${envs.API_KEY.name} for real keys.",
    )
    admin_api_key: tuple[SecretStr, ...] = Field(
        (), description="Keys for the admin routes (/debug/...); they also work as API keys. None configured: "
        f"admin routes answer loopback clients only. Prefer ${envs.ADMIN_API_KEY.name}.",
    )
    allow_special_tokens: bool = Field(
        False, description="Parse special-token strings in client text (e.g. `<|im_end|>`) as the special tokens "
        "they name, as vLLM does. Default false: client text is tokenized as plain text, so a client cannot forge "
        "turns, channels or tool calls.",
    )

    @field_validator("api_key", "admin_api_key", mode="before")
    @classmethod
    def _keys(cls, v):
        return tuple(SecretStr(k) for k in _split_keys(v))


class RequestLimits(BaseModel):
    """Bounds on one request; each refusal is a 400/408/413 naming the parameter."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_request_body_bytes: int = Field(
        4 * 2**20, ge=1024, description="Largest request body in bytes (413 above; checked against Content-Length "
        "before reading, and while reading a body without one).",
    )
    request_body_timeout_s: float = Field(
        30.0, gt=0, description="Seconds the whole request body may take to arrive once the headers are in (408).",
    )
    request_idle_timeout_s: float = Field(
        10.0, gt=0, description="Longest gap in seconds between two chunks of a request body (408).",
    )
    max_prompt_chars: int | None = Field(
        None, ge=1, description=f"Most characters of prompt text (all messages, or all prompts of a completions "
        "request, together), checked before "
        f"tokenizing (400); default {PROMPT_CHARS_PER_TOKEN} x max_model_len.",
    )
    max_messages: int = Field(2048, ge=1, description="Most messages in one chat request (400).")
    max_stop_chars: int = Field(512, ge=1, description="Longest stop string in characters (400).")
    max_stop_token_ids: int = Field(256, ge=0, description="Most entries in stop_token_ids (400).")
    max_n: int = Field(16, ge=1, le=16, description="Most choices (`n`) per request (400).")
    max_output_tokens: int | None = Field(
        None, ge=1, description="Most output tokens one request may ask for (400 above); default: whatever fits "
        "the context.",
    )


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class KeySet:
    """Configured keys as SHA-256 digests; :meth:`matches` compares a presented key in constant time."""

    def __init__(self, keys: Iterable[str]):
        self._digests = tuple(_digest(k) for k in dict.fromkeys(keys))

    def __len__(self) -> int:
        return len(self._digests)

    def matches(self, presented: str | None) -> bool:
        """Whether ``presented`` is one of the keys. Every key is compared (no early exit), each comparison
        is ``hmac.compare_digest`` over equal-length digests, so the time does not depend on which key or
        how many characters matched."""
        if presented is None or not self._digests:
            return False
        probe = _digest(presented)
        found = False
        for d in self._digests:
            found |= hmac.compare_digest(probe, d)
        return found


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` header among raw ASGI headers, or None."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


def behind_haproxy() -> bool:
    """Whether this process runs under Ray Serve's HAProxy ingress: ``RAY_SERVE_ENABLE_HA_PROXY`` is ``"1"``,
    the test Ray itself makes (``ray/serve/_private/constants.py``). Ray reads it in every process at start,
    so the ingress replica sees what HAProxy's node was started with. HAProxy opens its own connection to the
    replica and adds no forwarded-for header (Ray's ``haproxy_templates.py``), so the client address a route
    sees is HAProxy's."""
    return os.environ.get("RAY_SERVE_ENABLE_HA_PROXY", "0") == "1"


def is_loopback(client) -> bool:
    """Whether an ASGI ``scope["client"]`` (``(host, port)`` or None) is a loopback address."""
    if not client:
        return False
    try:
        return ipaddress.ip_address(client[0]).is_loopback
    except ValueError:
        return False


def route_path(scope) -> str:
    """The path inside the app: ``scope["path"]`` without the app's ``root_path`` (Serve's route prefix)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):]
    return path or "/"


def _unauthorized(message: str) -> OpenAIError:
    return OpenAIError(message, status=401, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


class RequestGuard:
    """The resolved keys and limits of one ingress replica.

    Args:
        security: the app's :class:`SecurityConfig`.
        limits: the app's :class:`RequestLimits`.
        max_model_len: context length (default ``max_prompt_chars``, the early ``max_tokens`` check).
        env_api_keys, env_admin_keys: keys from the environment (default: ``replicas.envs``).
        trust_loopback: whether a loopback client may use the admin routes while no admin key is configured
            (default: unless :func:`behind_haproxy`).
    """

    def __init__(self, security: SecurityConfig, limits: RequestLimits, max_model_len: int,
                 env_api_keys: Iterable[str] | None = None, env_admin_keys: Iterable[str] | None = None,
                 trust_loopback: bool | None = None):
        admin = [*_split_keys(security.admin_api_key), *(envs.admin_api_keys() if env_admin_keys is None
                                                         else env_admin_keys)]
        api = [*_split_keys(security.api_key), *(envs.api_keys() if env_api_keys is None else env_api_keys)]
        self.admin_keys = KeySet(admin)
        self.api_keys = KeySet([*api, *admin])  # an admin key is also an API key
        self.limits = limits
        self.max_model_len = max_model_len
        self.max_prompt_chars = limits.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * max_model_len
        self.refused = {"unauthorized": 0, "forbidden": 0, "too_large": 0, "timeout": 0}
        self.trust_loopback = not behind_haproxy() if trust_loopback is None else trust_loopback
        if not len(self.admin_keys) and not self.trust_loopback:
            logger.warning("persistent-serve: behind Ray Serve's HAProxy every client looks local, so the admin "
                           f"routes (/debug/...) answer nobody until an admin key is set (${envs.ADMIN_API_KEY.name})")
        if not len(self.api_keys):
            logger.warning("persistent-serve: no API key configured: the API answers any client that can reach "
                           f"it (set ${envs.API_KEY.name} or api-key)")

    @property
    def auth_enabled(self) -> bool:
        return len(self.api_keys) > 0

    def stats(self) -> dict:
        """For ``/debug/stats``: how many keys of each kind (never the keys), the limits, refusal counts."""
        return {"api_keys": len(self.api_keys) - len(self.admin_keys), "admin_api_keys": len(self.admin_keys),
                "admin_access": ("admin_key" if len(self.admin_keys) else
                                 "loopback" if self.trust_loopback else "none"),
                "limits": {**self.limits.model_dump(), "max_prompt_chars": self.max_prompt_chars},
                "refused": dict(self.refused)}

    # ---- before the body ---------------------------------------------------------------------
    def authorize(self, scope) -> OpenAIError | None:
        """The error for a request that may not reach its route, or None when it may."""
        path = route_path(scope)
        if path in OPEN_PATHS:
            return None
        token = bearer_token(scope.get("headers", ()))
        if path.startswith(ADMIN_PREFIXES):
            if len(self.admin_keys):
                if self.admin_keys.matches(token):
                    return None
                self.refused["unauthorized"] += 1
                return _unauthorized("this admin route needs an admin API key (Authorization: Bearer ADMIN_KEY)")
            if self.trust_loopback and is_loopback(scope.get("client")):
                return None
            self.refused["forbidden"] += 1
            if not self.trust_loopback:
                return OpenAIError("admin routes need an admin API key behind Ray Serve's HAProxy ingress, where "
                                   f"every client looks local (set ${envs.ADMIN_API_KEY.name})", status=403,
                                   type_="permission_error", code="admin_only")
            return OpenAIError("admin routes answer loopback clients only while no admin API key is configured "
                               f"(set ${envs.ADMIN_API_KEY.name})", status=403, type_="permission_error",
                               code="admin_only")
        if not self.auth_enabled or self.api_keys.matches(token):
            return None
        self.refused["unauthorized"] += 1
        if token is None:
            return _unauthorized("You didn't provide an API key. Send it in the Authorization header with Bearer "
                                 "auth (Authorization: Bearer YOUR_KEY).")
        return _unauthorized("Incorrect API key provided.")

    def content_length(self, scope) -> int | None:
        for name, value in scope.get("headers", ()):
            if name.lower() == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return None
        return None

    def too_large(self, size: int, exact: bool) -> OpenAIError:
        self.refused["too_large"] += 1
        limit = self.limits.max_request_body_bytes
        what = f"is {size} bytes" if exact else f"exceeds {limit} bytes"
        return OpenAIError(f"the request body {what}; this server accepts at most {limit} bytes "
                           "(max-request-body-bytes)", status=413, code="request_too_large",
                           headers={"Connection": "close"})

    async def read_body(self, scope, receive) -> bytes | None:
        """The whole request body, within the size limit and the timeouts; None when the client went away.

        Raises:
            OpenAIError: 413 (too large) or 408 (too slow), each with ``Connection: close``.
        """
        limits = self.limits
        declared = self.content_length(scope)
        if declared is not None and declared > limits.max_request_body_bytes:
            raise self.too_large(declared, exact=True)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limits.request_body_timeout_s
        chunks, size = [], 0
        while True:
            left = deadline - loop.time()
            wait = min(limits.request_idle_timeout_s, left)
            try:
                if wait <= 0:
                    raise asyncio.TimeoutError
                message = await asyncio.wait_for(receive(), wait)
            except asyncio.TimeoutError:  # TimeoutError itself on Python >= 3.11
                self.refused["timeout"] += 1
                whole = left <= limits.request_idle_timeout_s
                raise OpenAIError(
                    f"the request body did not arrive in time: {size} bytes"
                    + (f" of {declared}" if declared is not None else "")
                    + (f" in {limits.request_body_timeout_s:g} s (request-body-timeout-s)" if whole else
                       f", then nothing for {limits.request_idle_timeout_s:g} s (request-idle-timeout-s)"),
                    status=408, code="request_timeout", headers={"Connection": "close"}) from None
            if message["type"] == "http.disconnect":
                return None
            body = message.get("body", b"")
            size += len(body)
            if size > limits.max_request_body_bytes:
                raise self.too_large(size, exact=False)
            chunks.append(body)
            if not message.get("more_body", False):
                return b"".join(chunks)

    # ---- after parsing, before tokenizing ----------------------------------------------------
    def check_request(self, body) -> None:
        """Refuse a parsed chat/completions/tokenize request that is over a limit (400 naming the parameter).

        Cheap checks only (lengths and counts): they run on the event loop before tokenization.

        Raises:
            OpenAIError: the first limit exceeded.
        """
        limits = self.limits
        messages = getattr(body, "messages", None)
        if messages is not None:
            if len(messages) > limits.max_messages:
                raise OpenAIError(f"messages has {len(messages)} entries; at most {limits.max_messages} are "
                                  "allowed (max-messages)", param="messages", code="array_above_max_length")
            total = 0
            for i, m in enumerate(messages):
                n = len(m.text())
                total += n
                if n > self.max_prompt_chars or total > self.max_prompt_chars:
                    raise OpenAIError(
                        f"the messages hold more than {self.max_prompt_chars} characters (max-prompt-chars; at "
                        f"messages.{i}: {n} characters)", param=f"messages.{i}.content",
                        code="string_above_max_length")
        prompts = getattr(body, "prompt", None)
        prompts = [prompts] if isinstance(prompts, str) else prompts or []  # completions: a list once validated
        total = 0
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, str):
                continue  # token ids: the engine's context check counts them
            total += len(prompt)
            if total > self.max_prompt_chars:
                where = "the prompt has" if len(prompts) == 1 else f"the prompts (up to prompt.{i}) hold"
                raise OpenAIError(f"{where} {total} characters; at most {self.max_prompt_chars} are "
                                  "allowed (max-prompt-chars)", param="prompt" if len(prompts) == 1 else f"prompt.{i}",
                                  code="string_above_max_length")
        for i, s in enumerate(getattr(body, "stop", None) or ()):
            if len(s) > limits.max_stop_chars:
                raise OpenAIError(f"stop[{i}] has {len(s)} characters; at most {limits.max_stop_chars} are "
                                  "allowed (max-stop-chars)", param=f"stop.{i}", code="string_above_max_length")
        ids = getattr(body, "stop_token_ids", None) or ()
        if len(ids) > limits.max_stop_token_ids:
            raise OpenAIError(f"stop_token_ids has {len(ids)} entries; at most {limits.max_stop_token_ids} are "
                              "allowed (max-stop-token-ids)", param="stop_token_ids", code="array_above_max_length")
        n = getattr(body, "n", 1)
        if n > limits.max_n:
            raise OpenAIError(f"n is {n}; this server allows at most {limits.max_n} (max-n)", param="n",
                              code="integer_above_max_value")
        output_limit = getattr(body, "output_limit", None)
        asked = output_limit() if output_limit is not None else None
        if asked is None:
            return
        param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
        if limits.max_output_tokens is not None and asked > limits.max_output_tokens:
            raise OpenAIError(f"{param} is {asked}; this server allows at most {limits.max_output_tokens} output tokens "
                              "per request (max-output-tokens)", param=param, code="integer_above_max_value")
        if asked >= self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{asked} output tokens, which leaves no room for the prompt. Please reduce {param}.",
                param=param, code="context_length_exceeded")


# ---- the ASGI middleware --------------------------------------------------------------------------
async def send_error(send, exc: OpenAIError) -> None:
    """Send ``exc`` as a complete OpenAI-style JSON response on a raw ASGI ``send``."""
    body = json.dumps(exc.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in exc.headers.items()]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _replay(body: bytes, receive):
    """A ``receive`` that returns the already-read ``body`` once, then waits on the real one (disconnect)."""
    pending = True

    async def replay():
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _sized(send):
    """A ``send`` that holds a response without ``Content-Length`` and sends it whole with one (HTTP/1.0)."""
    start: dict | None = None
    parts: list[bytes] = []

    async def sized(message):
        nonlocal start
        if message["type"] == "http.response.start":
            if any(k.lower() == b"content-length" for k, _ in message.get("headers", ())):
                await send(message)
                return
            start = message
            return
        if message["type"] == "http.response.body" and start is not None:
            parts.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = b"".join(parts)
            headers = [(k, v) for k, v in start.get("headers", ()) if k.lower() != b"transfer-encoding"]
            await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        await send(message)

    return sized


class RequestGuardMiddleware:
    """Pure ASGI middleware: keys, then the body (size, timeouts), then the app (see the module doc).

    Args:
        app: the ASGI app (FastAPI's router stack).
        guard: returns the :class:`RequestGuard` in force (the ingress replica's); called per request.
    """

    def __init__(self, app, guard: Callable[[], RequestGuard]):
        self.app = app
        self.guard = guard

    async def __call__(self, scope, receive, send) -> Awaitable[None] | None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        guard = self.guard()
        denied = guard.authorize(scope)
        if denied is not None:
            return await send_error(send, denied)
        try:
            body = await guard.read_body(scope, receive)
        except OpenAIError as exc:
            return await send_error(send, exc)
        if body is None:  # the client went away before the body arrived: nothing to answer
            return None
        if scope.get("http_version") == "1.0":
            send = _sized(send)
        return await self.app(scope, _replay(body, receive), send)

"""OpenAI response bodies and SSE chunks built from one request's engine chunks.

The engine streams the chunks of all ``n`` completions of a request on one
stream, told apart by ``GenerationChunk.index``; the formatters demultiplex
them into ``n`` choices (JSON body or SSE), sum the usage over the choices and
render token logprobs in OpenAI's chat or completions shape.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator

from deployments.protocol import OpenAIError, new_id, now
from replicas.messages import GenerationChunk, GenerationError, TokenLogprobs

MIN_LOGPROB = -9999.0
"""Floor for reported logprobs (as vLLM): ``-inf`` is not valid JSON."""


def sse(obj: dict) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj)}\n\n"


RETRY_AFTER_S = 1
"""``Retry-After`` seconds sent with 503 overloaded (the pools drain or scale within seconds)."""


def to_http(err: GenerationError) -> OpenAIError:
    """The HTTP error for a failed request: 400 (validation), 503 + Retry-After (overloaded), else 500."""
    if err.stage == "validation":
        return OpenAIError(err.message, param="messages")
    if err.reason == "overloaded":
        return OpenAIError(err.message, status=503, type_="server_error", code="overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
    return OpenAIError(err.message, status=500, type_="server_error", code=err.reason)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, reversed: printable stand-in character → byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class TokenText:
    """Token id → its text and bytes, for logprobs (cached; make one per tokenizer).

    ``text`` is ``tokenizer.decode([id])``, as vLLM reports it: a byte-level BPE
    token that holds only part of a multi-byte UTF-8 character renders as U+FFFD.
    ``bytes`` are that token's raw bytes when the tokenizer is byte-level BPE (so
    the bytes of consecutive tokens join into the real character, which is what
    OpenAI's ``bytes`` field is for); otherwise the UTF-8 bytes of ``text``.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        self._decoder = _byte_decoder() if _is_byte_level(tokenizer) else None
        self._added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})

    def text(self, token_id: int) -> str:
        s = self._text.get(token_id)
        if s is None:
            s = self._text[token_id] = self.tokenizer.decode([token_id])
        return s

    def bytes(self, token_id: int) -> list[int]:
        b = self._bytes.get(token_id)
        if b is None:
            b = None
            if self._decoder is not None and token_id not in self._added:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
                if isinstance(piece, str) and all(ch in self._decoder for ch in piece):
                    b = [self._decoder[ch] for ch in piece]
            if b is None:
                b = list(self.text(token_id).encode("utf-8", errors="replace"))
            self._bytes[token_id] = b
        return b


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and type(backend.decoder).__name__ == "ByteLevel"


def _logprob(x: float) -> float:
    x = float(x)
    return MIN_LOGPROB if math.isnan(x) else max(x, MIN_LOGPROB)


def _finish(reason: str | None) -> str | None:
    return "stop" if reason == "abort" else reason


class _Choice:
    """What one of the ``n`` completions has produced so far."""

    def __init__(self):
        self.text = ""
        self.finish: str | None = None
        self.completion_tokens = 0
        self.logprobs: dict | None = None


class _Format:
    """Builds OpenAI JSON bodies and SSE chunks from one request's engine chunks.

    Args:
        model: the served model name.
        tokens: token texts for logprobs (required when ``logprobs``).
        logprobs: the request asked for logprobs (every choice gets a logprobs object).
    """

    object_name = ""
    chunk_object_name = ""
    id_prefix = ""

    def __init__(self, model: str, tokens: TokenText | None = None, logprobs: bool = False):
        if logprobs and tokens is None:
            raise ValueError("logprobs need a TokenText")
        self.model, self.id, self.created = model, new_id(self.id_prefix), now()
        self.tokens, self.want_logprobs = tokens, logprobs

    def _envelope(self, choices, chunk=False, **extra) -> dict:
        return {"id": self.id, "object": self.chunk_object_name if chunk else self.object_name,
                "created": self.created, "model": self.model, "choices": choices, **extra}

    def _update(self, choices: list[_Choice], item: GenerationChunk) -> tuple[_Choice, dict | None]:
        """Fold ``item`` into its choice; return the choice and the logprobs of ``item``'s tokens."""
        if not 0 <= item.index < len(choices):
            raise OpenAIError(f"engine returned choice index {item.index} for n={len(choices)}",
                              status=500, type_="server_error", code="engine_error")
        c = choices[item.index]
        part = None
        if self.want_logprobs:
            part = self.logprobs_part(item.logprobs or [], self.text_offset(c))
            if c.logprobs is None:
                c.logprobs = {k: [] for k in part}
            for k, v in part.items():
                c.logprobs[k].extend(v)
        c.text += item.text
        c.completion_tokens = max(c.completion_tokens, item.num_output_tokens)
        if item.finish_reason:
            c.finish = _finish(item.finish_reason)
        return c, part

    async def collect(self, first, rest, n: int) -> dict:
        """The non-streaming response body."""
        choices, prompt_tokens = [self.new_choice() for _ in range(n)], 0
        async for item in _chain(first, rest):
            if isinstance(item, GenerationError):
                raise to_http(item)
            prompt_tokens = max(prompt_tokens, item.num_prompt_tokens)
            self._update(choices, item)
        for c in choices:
            if self.want_logprobs and c.logprobs is None:
                c.logprobs = self.logprobs_part([], 0)
        usage = _usage(prompt_tokens, sum(c.completion_tokens for c in choices))
        return self._envelope([self.choice(i, c) for i, c in enumerate(choices)], usage=usage)

    async def sse(self, first, rest, n: int, include_usage: bool) -> AsyncIterator[str]:
        """The streaming response: SSE chunks, then the usage chunk if asked, then ``[DONE]``."""
        choices, prompt_tokens = [self.new_choice() for _ in range(n)], 0
        extra = {"usage": None} if include_usage else {}
        try:
            for i in range(n):
                for opening in self.opening(i):
                    yield sse(self._envelope([opening], chunk=True, **extra))
            async for item in _chain(first, rest):
                if isinstance(item, GenerationError):
                    yield sse(to_http(item).body())
                    break
                prompt_tokens = max(prompt_tokens, item.num_prompt_tokens)
                c, part = self._update(choices, item)
                event = self.event(c, item, _finish(item.finish_reason), part)
                if event is not None:
                    yield sse(self._envelope([event], chunk=True, **extra))
            if include_usage:
                usage = _usage(prompt_tokens, sum(c.completion_tokens for c in choices))
                yield sse(self._envelope([], chunk=True, usage=usage))
            yield "data: [DONE]\n\n"
        finally:
            await rest.aclose()

    # ---- per-format pieces -------------------------------------------------------------------
    def new_choice(self) -> _Choice:
        return _Choice()

    def event(self, c: _Choice, item: GenerationChunk, finish: str | None, part: dict | None) -> dict | None:
        """The SSE choice for ``item`` (already folded into ``c``), or None when it adds nothing."""
        if item.text or finish or (part and item.token_ids):
            return self.delta(item.index, item.text, finish, part)
        return None

    def text_offset(self, c: _Choice) -> int:
        return len(c.text)

    def opening(self, i: int) -> list[dict]:
        return []

    def logprobs_part(self, lps: list[TokenLogprobs], offset: int) -> dict:
        raise NotImplementedError

    def choice(self, i: int, c: _Choice) -> dict:
        raise NotImplementedError

    def delta(self, i: int, text: str, finish: str | None, logprobs: dict | None) -> dict:
        raise NotImplementedError


class ChatFormat(_Format):
    """``chat.completion`` bodies and ``chat.completion.chunk`` events.

    Logprobs: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``
    with the ``k`` most likely alternatives, most likely first.
    """

    object_name, chunk_object_name, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def _entry(self, token_id: int, logprob: float) -> dict:
        return {"token": self.tokens.text(token_id), "logprob": _logprob(logprob), "bytes": self.tokens.bytes(token_id)}

    def logprobs_part(self, lps, offset):
        return {"content": [
            {**self._entry(lp.token_id, lp.logprob), "top_logprobs": [self._entry(t, v) for t, v in lp.top]}
            for lp in lps
        ]}

    def opening(self, i):
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}]

    def choice(self, i, c):
        return {"index": i, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish,
                "logprobs": c.logprobs}

    def delta(self, i, text, finish, logprobs):
        return {"index": i, "delta": {"content": text} if text else {}, "finish_reason": finish, "logprobs": logprobs}


class CompletionFormat(_Format):
    """``text_completion`` bodies and events.

    Logprobs (OpenAI's legacy shape): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``;
    each ``top_logprobs`` entry maps token text → logprob for the ``k`` most likely tokens plus the
    sampled one (so up to ``k + 1`` entries, as OpenAI and vLLM). ``text_offset`` is each token's
    character offset in the choice's text (echoed prompt included).

    Args:
        echo: text to put before each choice's text (``echo: true``), or "".
    """

    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, model: str, tokens: TokenText | None = None, logprobs: bool = False, echo: str = ""):
        super().__init__(model, tokens, logprobs)
        self.echo = echo

    def text_offset(self, c):
        return len(self.echo) + len(c.text)

    def logprobs_part(self, lps, offset):
        part = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps:
            token = self.tokens.text(lp.token_id)
            top: dict[str, float] = {}
            for t, v in lp.top:
                top.setdefault(self.tokens.text(t), _logprob(v))
            top.setdefault(token, _logprob(lp.logprob))
            part["tokens"].append(token)
            part["token_logprobs"].append(_logprob(lp.logprob))
            part["top_logprobs"].append(top)
            part["text_offset"].append(offset)
            offset += len(token)
        return part

    def opening(self, i):
        return [self.delta(i, self.echo, None, None)] if self.echo else []

    def choice(self, i, c):
        return {"index": i, "text": self.echo + c.text, "finish_reason": c.finish, "logprobs": c.logprobs}

    def delta(self, i, text, finish, logprobs):
        return {"index": i, "text": text, "finish_reason": finish, "logprobs": logprobs}


async def _chain(first, rest):
    yield first
    async for item in rest:
        yield item


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

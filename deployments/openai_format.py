"""OpenAI response bodies and SSE chunks built from one request's engine chunks.

The engine streams the chunks of all ``n`` completions of a request on one
stream, told apart by ``GenerationChunk.index``; the formatters demultiplex
them into ``n`` choices (JSON body or SSE), sum the usage over the choices and
render token logprobs in OpenAI's chat or completions shape. A completions
request with several prompts is one engine request per prompt, merged into
one stream by :func:`merge_prompt_streams` (choice ``p * n + i`` is the
``i``-th completion of prompt ``p``, OpenAI's numbering).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
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
    """The HTTP error for a failed request: 400 (validation), 503 + Retry-After (overloaded, no replica
    could take it), else 500."""
    if err.stage == "validation":
        return OpenAIError(err.message, param="messages")
    if err.reason in ("overloaded", "replica_unavailable"):  # nothing ran: retry later
        return OpenAIError(err.message, status=503, type_="server_error", code=err.reason,
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
    """What one of the choices (``n`` per prompt) has produced so far."""

    def __init__(self, index: int = 0):
        self.index = index
        self.prompt_head: dict | None = None
        self.text = ""
        self.finish: str | None = None
        self.completion_tokens = 0
        self.prompt_tokens = 0
        self.logprobs: dict | None = None
        self.prompt_logprobs_seen = False


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
        """Fold ``item`` into its choice; return the choice and the logprobs of ``item``'s tokens. When ``item``
        brings the prompt's logprobs (echo with logprobs) they go first in the choice's logprobs and, for
        streaming, into ``choice.prompt_head``."""
        if not 0 <= item.index < len(choices):
            raise OpenAIError(f"engine returned choice index {item.index} for {len(choices)} choices",
                              status=500, type_="server_error", code="engine_error")
        c = choices[item.index]
        part = None
        if self.want_logprobs:
            if item.prompt_logprobs is not None and not c.prompt_logprobs_seen:
                c.prompt_logprobs_seen = True
                c.prompt_head = self.prompt_logprobs_part(item.index, item.prompt_logprobs)
                if c.prompt_head is not None:
                    c.logprobs = {k: list(v) for k, v in c.prompt_head.items()}
            part = self.logprobs_part(item.logprobs or [], self.text_offset(c))
            if c.logprobs is None:
                c.logprobs = {k: [] for k in part}
            for k, v in part.items():
                c.logprobs[k].extend(v)
        c.text += item.text
        c.completion_tokens = max(c.completion_tokens, item.num_output_tokens)
        c.prompt_tokens = max(c.prompt_tokens, item.num_prompt_tokens)
        if item.finish_reason:
            c.finish = _finish(item.finish_reason)
        return c, part

    @staticmethod
    def _usage(choices: list[_Choice], n: int) -> dict:
        """Usage over every choice: each prompt's tokens counted once (not once per choice), outputs summed."""
        prompts = sum(max(c.prompt_tokens for c in choices[p:p + n]) for p in range(0, len(choices), n))
        return _usage(prompts, sum(c.completion_tokens for c in choices))

    def _choices(self, count: int) -> list[_Choice]:
        choices = [self.new_choice() for _ in range(count)]
        for i, c in enumerate(choices):
            c.index = i
        return choices

    async def collect(self, first, rest, n: int, num_prompts: int = 1) -> dict:
        """The non-streaming response body: ``n`` choices per prompt."""
        choices = self._choices(n * num_prompts)
        try:
            async for item in _chain(first, rest):
                if isinstance(item, GenerationError):
                    raise to_http(item)
                self._update(choices, item)
        finally:
            await rest.aclose()
        for c in choices:
            if self.want_logprobs and c.logprobs is None:
                c.logprobs = self.logprobs_part([], 0)
        return self._envelope([self.choice(i, c) for i, c in enumerate(choices)], usage=self._usage(choices, n))

    async def sse(self, first, rest, n: int, include_usage: bool, num_prompts: int = 1) -> AsyncIterator[str]:
        """The streaming response: SSE chunks, then the usage chunk if asked, then ``[DONE]``."""
        choices = self._choices(n * num_prompts)
        extra = {"usage": None} if include_usage else {}
        try:
            for i in range(n * num_prompts):
                for opening in self.opening(i):
                    yield sse(self._envelope([opening], chunk=True, **extra))
            async for item in _chain(first, rest):
                if isinstance(item, GenerationError):
                    yield sse(to_http(item).body())
                    break
                c, part = self._update(choices, item)
                if c.prompt_head is not None:  # echo with logprobs: the prompt's text and logprobs first
                    head, c.prompt_head = c.prompt_head, None
                    yield sse(self._envelope([self.prompt_delta(item.index, head)], chunk=True, **extra))
                event = self.event(c, item, _finish(item.finish_reason), part)
                if event is not None:
                    yield sse(self._envelope([event], chunk=True, **extra))
            if include_usage:
                yield sse(self._envelope([], chunk=True, usage=self._usage(choices, n)))
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

    def prompt_logprobs_part(self, i: int, entries: list[TokenLogprobs | None]) -> dict | None:
        """Logprobs of choice ``i``'s echoed prompt, in :meth:`logprobs_part`'s shape (None: not shown)."""
        return None

    def prompt_delta(self, i: int, head: dict) -> dict:
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
    character offset in the choice's text (echoed prompt included). With ``echo`` the prompt's
    tokens come first (``token_logprobs[0]`` and ``top_logprobs[0]`` are null: nothing predicts the
    first token); streamed, they come in one event with the echoed text, before the first token's.

    Args:
        echo: per prompt, the text to put before each of its choices' text (``echo: true``), or "";
            a single string applies to every choice.
        n: choices per prompt (choice ``i`` belongs to prompt ``i // n``).
        prompt_ids: per prompt, its token ids (echo with logprobs names the first token from them).
    """

    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, model: str, tokens: TokenText | None = None, logprobs: bool = False,
                 echo: str | list[str] = "", n: int = 1, prompt_ids: list[list[int]] | None = None):
        super().__init__(model, tokens, logprobs)
        self.echoes = [echo] if isinstance(echo, str) else list(echo)
        self.n = n
        self.prompt_ids = prompt_ids or []

    def echo_of(self, i: int) -> str:
        return self.echoes[min(i // self.n, len(self.echoes) - 1)] if self.echoes else ""

    def text_offset(self, c):
        return len(self.echo_of(c.index)) + len(c.text)

    def _logprob_entries(self, entries, first_token: int | None, offset: int) -> dict:
        part = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for j, lp in enumerate(entries):
            if lp is None:  # the first prompt token: no logprob
                token = self.tokens.text(first_token) if j == 0 and first_token is not None else ""
                part["tokens"].append(token)
                part["token_logprobs"].append(None)
                part["top_logprobs"].append(None)
            else:
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

    def logprobs_part(self, lps, offset):
        return self._logprob_entries(lps, None, offset)

    def prompt_logprobs_part(self, i, entries):
        if not self.echo_of(i):
            return None
        ids = self.prompt_ids[i // self.n] if i // self.n < len(self.prompt_ids) else []
        return self._logprob_entries(entries, ids[0] if ids else None, 0)

    def opening(self, i):
        if self.want_logprobs:  # the echo comes with the prompt's logprobs (prompt_delta)
            return []
        return [self.delta(i, self.echo_of(i), None, None)] if self.echo_of(i) else []

    def prompt_delta(self, i, head):
        return self.delta(i, self.echo_of(i), None, head)

    def choice(self, i, c):
        return {"index": i, "text": self.echo_of(i) + c.text, "finish_reason": c.finish, "logprobs": c.logprobs}

    def delta(self, i, text, finish, logprobs):
        return {"index": i, "text": text, "finish_reason": finish, "logprobs": logprobs}


async def merge_prompt_streams(streams: list, n: int) -> AsyncIterator[GenerationChunk | GenerationError]:
    """One stream of the engine items of several prompts' requests, as they arrive (all run at once).

    A chunk of prompt ``p`` gets choice index ``p * n + chunk.index``. Closing the
    merged stream closes every prompt's stream (their work stops, their pages are freed).

    Args:
        streams: per prompt, an async iterator of its items (the router's ``generate``).
        n: completions per prompt.
    """
    queue: asyncio.Queue = asyncio.Queue()
    finished = object()

    async def pump(p: int, stream) -> None:
        try:
            async for item in stream:
                if isinstance(item, GenerationChunk):
                    item = dataclasses.replace(item, index=p * n + item.index)
                queue.put_nowait(item)
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(finished)

    tasks = [asyncio.ensure_future(pump(p, s)) for p, s in enumerate(streams)]
    open_streams = len(tasks)
    try:
        while open_streams:
            item = await queue.get()
            if item is finished:
                open_streams -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            with contextlib.suppress(Exception):
                await s.aclose()


async def _chain(first, rest):
    yield first
    async for item in rest:
        yield item


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

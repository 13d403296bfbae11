"""OpenAI response bodies and SSE chunks built from engine chunks, and stream merging for ``n > 1``."""

import asyncio
import json
from collections.abc import AsyncIterator

from deployments.protocol import OpenAIError, new_id, now
from replicas.messages import GenerationChunk, GenerationError


def sse(obj: dict) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj)}\n\n"


def to_http(err: GenerationError) -> OpenAIError:
    if err.stage == "validation":
        return OpenAIError(err.message, param="messages")
    return OpenAIError(err.message, status=500, type_="server_error", code=err.reason)


async def merge(gens: list[AsyncIterator]) -> AsyncIterator[tuple[int, GenerationChunk | GenerationError]]:
    """Interleave ``n`` streams, tagging each item with its choice index."""
    if len(gens) == 1:
        async for item in gens[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, gen):
        try:
            async for item in gen:
                await queue.put((i, item))
        except Exception as exc:  # noqa: BLE001 - surfaced as an error item
            await queue.put((i, GenerationError("", str(exc), "standard", "engine", "engine_error")))
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


class _Format:
    """Builds OpenAI JSON bodies and SSE chunks from engine chunks."""

    object_name = ""
    id_prefix = ""

    def __init__(self, model: str):
        self.model, self.id, self.created = model, new_id(self.id_prefix), now()

    def _envelope(self, choices, usage=None, chunk=False) -> dict:
        body = {"id": self.id, "object": self.object_name + (".chunk" if chunk and self.object_name == "chat.completion" else ""),
                "created": self.created, "model": self.model, "choices": choices}
        if usage is not None or not chunk:
            body["usage"] = usage
        return body

    async def collect(self, first, rest, n: int) -> dict:
        texts, finish, prompt_tokens, completion = [""] * n, [None] * n, 0, [0] * n
        async for i, item in _chain(first, rest):
            if isinstance(item, GenerationError):
                raise to_http(item)
            texts[i] += item.text
            prompt_tokens = item.num_prompt_tokens
            completion[i] = item.num_output_tokens
            if item.finish_reason:
                finish[i] = "stop" if item.finish_reason == "abort" else item.finish_reason
        usage = _usage(prompt_tokens, sum(completion))
        return self._envelope([self.choice(i, texts[i], finish[i]) for i in range(n)], usage)

    async def sse(self, first, rest, n: int, include_usage: bool) -> AsyncIterator[str]:
        prompt_tokens, completion = 0, [0] * n
        try:
            if self.object_name == "chat.completion":
                for i in range(n):
                    yield sse(self._envelope([{"index": i, "delta": {"role": "assistant", "content": ""},
                                                "finish_reason": None}], chunk=True))
            async for i, item in _chain(first, rest):
                if isinstance(item, GenerationError):
                    yield sse(to_http(item).body())
                    break
                prompt_tokens, completion[i] = item.num_prompt_tokens, item.num_output_tokens
                finish = item.finish_reason
                if finish == "abort":
                    finish = "stop"
                if item.text or finish:
                    yield sse(self._envelope([self.delta(i, item.text, finish)], chunk=True))
            if include_usage:
                yield sse(self._envelope([], usage=_usage(prompt_tokens, sum(completion)), chunk=True))
            yield "data: [DONE]\n\n"
        finally:
            await rest.aclose()


class ChatFormat(_Format):
    object_name, id_prefix = "chat.completion", "chatcmpl"

    def choice(self, i, text, finish):
        return {"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": finish, "logprobs": None}

    def delta(self, i, text, finish):
        return {"index": i, "delta": {"content": text} if text else {}, "finish_reason": finish, "logprobs": None}


class CompletionFormat(_Format):
    object_name, id_prefix = "text_completion", "cmpl"

    def choice(self, i, text, finish):
        return {"index": i, "text": text, "finish_reason": finish, "logprobs": None}

    delta = choice


async def _chain(first, rest):
    yield first
    async for item in rest:
        yield item


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

"""``POST /v1/responses``: OpenAI's Responses API, stateless.

A request becomes one chat request (the same prompt, lanes and engine as
``/v1/chat/completions``): ``instructions`` → a system message (for harmony: the developer
message's instructions), ``input`` (a string, or items: messages, ``function_call``,
``function_call_output``, ``reasoning``) → messages, ``reasoning.effort`` →
``reasoning_effort``, function ``tools`` / ``tool_choice``, ``text.format`` →
``response_format``, ``max_output_tokens`` → ``max_completion_tokens``. Nothing is stored:
``previous_response_id`` and ``store: true`` with a later lookup are not supported
(``previous_response_id`` gets a 400; ``store`` is accepted and ignored).

The answer is a ``response`` object whose ``output`` holds, in order, ``reasoning`` items
(the analysis channel, as ``content[{"type": "reasoning_text"}]``), ``message`` items
(``output_text``) and ``function_call`` items (``call_id``, ``name``, ``arguments``), with
``usage`` filled in (``output_tokens_details.reasoning_tokens`` counted by the parser). What the
harmony parser could not use is listed in ``harmony_errors`` (as in chat); a reply that ended
with no message and no call (only reasoning) is ``incomplete`` with ``incomplete_details.reason``
``no_final_message``, so a client never takes an empty ``output_text`` for an answer.
Streaming sends ``response.created``, ``response.in_progress``, per item
``response.output_item.added`` / ``.done``, ``response.reasoning_text.delta`` / ``.done``,
``response.content_part.added`` / ``.done``, ``response.output_text.delta`` / ``.done``,
``response.function_call_arguments.delta`` / ``.done``, and ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` cut it short); each event has a
``sequence_number``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deployments.chat_extensions import (
    FunctionDefinition,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    ToolParam,
)
from deployments.harmony.parser import NO_FINAL_MESSAGE, Delta, HarmonyOutputParser
from deployments.openai_format import _chain, to_http
from deployments.protocol import ChatCompletionRequest, OpenAIError, new_id, now, validation_error
from replicas.messages import GenerationError


class ResponsesFunctionTool(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ResponsesNamedChoice(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = Field("response", min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    format: TextFormat | None = None


class ReasoningOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    effort: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(BaseModel):
    """The Responses API's request fields this server honours (others are accepted and ignored,
    except the stateful ones, which get a 400)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    reasoning: ReasoningOptions | None = None
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | ResponsesNamedChoice | None = None
    text: TextOptions | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict | None = None
    parallel_tool_calls: bool | None = None


def _content_text(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(f"{where}.content must be a string or a list of parts", param=f"{where}.content")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "reasoning_text", "summary_text"):
            raise OpenAIError(f"{where}.content[{j}]: type {kind!r} is not supported (text parts only)",
                              param=f"{where}.content.{j}")
        out.append(str(part.get("text", "")))
    return "".join(out)


def input_messages(body: ResponsesRequest) -> list[dict]:
    """Chat messages for ``instructions`` + ``input`` (see the module docstring).

    Raises:
        OpenAIError: an item of an unknown type or shape.
    """
    messages: list[dict] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
        return messages
    pending_reasoning = ""
    assistant: dict | None = None  # the assistant message function calls are being added to
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise OpenAIError(f"{where}: role {role!r} is not supported", param=f"input.{i}.role")
            msg = {"role": role, "content": _content_text(item.get("content"), where)}
            if role == "assistant" and pending_reasoning:
                msg["reasoning_content"], pending_reasoning = pending_reasoning, ""
            messages.append(msg)
            assistant = None
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            pending_reasoning += _content_text(parts, where)
        elif kind == "function_call":
            if not item.get("name") or not item.get("call_id"):
                raise OpenAIError(f"{where}: a function_call needs call_id and name", param=f"input.{i}")
            if assistant is None:
                assistant = {"role": "assistant", "content": None, "tool_calls": []}
                if pending_reasoning:
                    assistant["reasoning_content"], pending_reasoning = pending_reasoning, ""
                messages.append(assistant)
            assistant["tool_calls"].append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": item.get("arguments") or "{}"}})
        elif kind == "function_call_output":
            if not item.get("call_id"):
                raise OpenAIError(f"{where}: a function_call_output needs call_id", param=f"input.{i}.call_id")
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": output if isinstance(output, str) else json.dumps(output)})
            assistant = None
        else:
            raise OpenAIError(f"{where}: item type {kind!r} is not supported", param=f"input.{i}.type")
    return messages


def to_chat_request(body: ResponsesRequest, model: str) -> ChatCompletionRequest:
    """The chat request that serves ``body``.

    Raises:
        OpenAIError: 400 for stateful fields or input that cannot be converted.
    """
    if body.previous_response_id:
        raise OpenAIError("previous_response_id is not supported: this server stores no responses; send the "
                          "whole conversation in input", param="previous_response_id", code="unsupported_parameter")
    fields: dict = {"model": model, "messages": input_messages(body), "stream": body.stream}
    if not fields["messages"]:
        raise OpenAIError("input must not be empty", param="input")
    if body.max_output_tokens is not None:
        fields["max_completion_tokens"] = body.max_output_tokens
    for key in ("temperature", "top_p"):
        if getattr(body, key) is not None:
            fields[key] = getattr(body, key)
    if body.reasoning is not None and body.reasoning.effort:
        fields["reasoning_effort"] = body.reasoning.effort
    try:  # the chat request's own models check what the Responses models let through
        if body.tools:
            fields["tools"] = [ToolParam(function=FunctionDefinition(
                name=t.name, description=t.description, parameters=t.parameters, strict=t.strict)) for t in body.tools]
        if isinstance(body.tool_choice, str):
            fields["tool_choice"] = body.tool_choice
        elif body.tool_choice is not None:
            fields["tool_choice"] = NamedToolChoice(function=NamedFunction(name=body.tool_choice.name))
        fmt = body.text.format if body.text is not None else None
        if fmt is not None and fmt.type != "text":
            fields["response_format"] = ResponseFormat(type=fmt.type, json_schema=JsonSchemaFormat(
                name=fmt.name, description=fmt.description, schema=fmt.schema_, strict=fmt.strict)
                if fmt.type == "json_schema" else None)
        chat = ChatCompletionRequest(**fields)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from exc
    chat.check()
    return chat


class _Item:
    """One output item being built (reasoning, message or function_call)."""

    def __init__(self, kind: str, index: int, call=None):
        self.kind, self.index, self.text, self.call = kind, index, "", call
        self.id = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind] + "_" + new_id("x")[2:26]

    def body(self, status: str) -> dict:
        if self.kind == "reasoning":
            return {"id": self.id, "type": "reasoning", "summary": [], "status": status,
                    "content": [{"type": "reasoning_text", "text": self.text}]}
        if self.kind == "message":
            return {"id": self.id, "type": "message", "role": "assistant", "status": status,
                    "content": [{"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}]}
        return {"id": self.id, "type": "function_call", "status": status, "call_id": self.call.id,
                "name": self.call.name, "arguments": self.call.arguments if status == "completed" else ""}


class ResponsesFormat:
    """Builds ``response`` objects and stream events from one request's engine chunks.

    Args:
        model: the served model name.
        body: the Responses request (echoed in the response object).
        encoding: openai-harmony's encoding for harmony models (None: the chunks' text is the answer).
        declared_tools: function names the harmony prompt declared.
    """

    def __init__(self, model: str, body: ResponsesRequest, encoding=None, declared_tools=None):
        self.model, self.body = model, body
        self.id, self.created = new_id("resp"), now()
        self.parser = HarmonyOutputParser(encoding, declared_tools) if encoding is not None else None
        self.items: list[_Item] = []
        self.prompt_tokens = self.output_tokens = 0
        self.finish: str | None = None
        self.seq = 0

    # ---- the response object ---------------------------------------------------------------
    def response(self, status: str) -> dict:
        b = self.body
        fmt = {"type": "text"}
        if b.text and b.text.format and b.text.format.type != "text":
            fmt = b.text.format.model_dump(by_alias=True, exclude_none=True)
        reasoning_tokens = self.parser.reasoning_tokens if self.parser is not None else 0
        done = status != "in_progress"
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "error": None,
            "incomplete_details": {"reason": self._incomplete_reason()} if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "metadata": b.metadata or {},
            "output": [it.body("completed" if done else "in_progress") for it in self.items] if done else [],
            "parallel_tool_calls": b.parallel_tool_calls if b.parallel_tool_calls is not None else True,
            "previous_response_id": None,
            "reasoning": {"effort": b.reasoning.effort if b.reasoning else None, "summary": None},
            "store": False, "temperature": b.temperature if b.temperature is not None else 1.0,
            "text": {"format": fmt},
            "tool_choice": (b.tool_choice.model_dump() if isinstance(b.tool_choice, BaseModel)
                            else b.tool_choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or ()],
            "top_p": b.top_p if b.top_p is not None else 1.0, "truncation": "disabled",
            "usage": {
                "input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": self.output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": self.prompt_tokens + self.output_tokens,
            } if done else None,
            "user": None,
            **({"harmony_errors": list(self.parser.errors)} if done and self.parser is not None and self.parser.errors
               else {}),
        }

    def _no_answer(self) -> bool:
        return self.parser is not None and NO_FINAL_MESSAGE in self.parser.errors

    def _incomplete_reason(self) -> str:
        return "no_final_message" if self.finish != "length" and self._no_answer() else "max_output_tokens"

    def _status(self) -> str:
        return "incomplete" if self.finish == "length" or self._no_answer() else "completed"

    # ---- folding engine chunks into items, as events ------------------------------------------
    def _delta(self, item) -> Delta:
        self.prompt_tokens = max(self.prompt_tokens, item.num_prompt_tokens)
        self.output_tokens = max(self.output_tokens, item.num_output_tokens)
        if self.parser is None:
            d = Delta(content=item.text)
        else:
            d = self.parser.feed(item.token_ids)
            if item.finish_reason:
                d.extend(self.parser.finish(item.finish_reason))
        if item.finish_reason:
            self.finish = item.finish_reason
        return d

    def _event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def _close(self, it: _Item) -> list[dict]:
        ev = []
        if it.kind == "reasoning":
            ev.append(self._event("response.reasoning_text.done", item_id=it.id, output_index=it.index,
                                  content_index=0, text=it.text))
        elif it.kind == "message":
            ev.append(self._event("response.output_text.done", item_id=it.id, output_index=it.index,
                                  content_index=0, text=it.text, logprobs=[]))
            ev.append(self._event("response.content_part.done", item_id=it.id, output_index=it.index,
                                  content_index=0, part=it.body("completed")["content"][0]))
        ev.append(self._event("response.output_item.done", output_index=it.index, item=it.body("completed")))
        return ev

    def _open(self, kind: str, call=None) -> tuple[_Item, list[dict]]:
        ev = []
        if self.items and self.items[-1].kind != "function_call":
            ev.extend(self._close(self.items[-1]))
        it = _Item(kind, len(self.items), call)
        self.items.append(it)
        ev.append(self._event("response.output_item.added", output_index=it.index, item=it.body("in_progress")))
        if kind == "message":
            ev.append(self._event("response.content_part.added", item_id=it.id, output_index=it.index,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                         "logprobs": []}))
        return it, ev

    def _apply(self, d: Delta) -> list[dict]:
        ev: list[dict] = []
        for kind, text in (("reasoning", d.reasoning), ("message", d.content)):
            if not text:
                continue
            it = self.items[-1] if self.items and self.items[-1].kind == kind else None
            if it is None:
                it, opened = self._open(kind)
                ev.extend(opened)
            it.text += text
            name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            extra = {} if kind == "reasoning" else {"logprobs": []}
            ev.append(self._event(name, item_id=it.id, output_index=it.index, content_index=0, delta=text, **extra))
        for call in d.tool_calls:
            it, opened = self._open("function_call", call)
            ev.extend(opened)
            ev.append(self._event("response.function_call_arguments.delta", item_id=it.id, output_index=it.index,
                                  delta=call.arguments))
            ev.append(self._event("response.function_call_arguments.done", item_id=it.id, output_index=it.index,
                                  name=call.name, arguments=call.arguments))
            ev.append(self._event("response.output_item.done", output_index=it.index, item=it.body("completed")))
        return ev

    # ---- the two response modes (the ingress calls these) -----------------------------------
    async def collect(self, first, rest, n: int = 1) -> dict:
        async for item in _chain(first, rest):
            if isinstance(item, GenerationError):
                raise to_http(item)
            self._apply(self._delta(item))
        return self.response(self._status())

    async def sse(self, first, rest, n: int = 1, include_usage: bool = False) -> AsyncIterator[str]:
        def out(event: dict) -> str:
            return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

        try:
            yield out(self._event("response.created", response=self.response("in_progress")))
            yield out(self._event("response.in_progress", response=self.response("in_progress")))
            async for item in _chain(first, rest):
                if isinstance(item, GenerationError):
                    err = to_http(item)
                    yield out(self._event("error", code=err.code, message=err.message, param=err.param))
                    return
                for event in self._apply(self._delta(item)):
                    yield out(event)
            if self.items and self.items[-1].kind != "function_call":
                for event in self._close(self.items[-1]):
                    yield out(event)
            status = self._status()
            yield out(self._event(f"response.{status}", response=self.response(status)))
        finally:
            await rest.aclose()


async def serve_responses(ingress, body: ResponsesRequest, http):
    """Answer ``POST /v1/responses`` through the ingress's chat path (one call from the ingress)."""
    ingress._check_model(body.model)
    chat = to_chat_request(body, ingress.model_name)
    ingress.guard.check_request(chat)  # request limits (deployments/security.py)
    plan = await asyncio.to_thread(ingress.chat_planner.plan, chat)  # off the event loop
    planner = ingress.chat_planner
    fmt = ResponsesFormat(ingress.model_name, body, planner.encoding if plan.declared_tools is not None else None,
                          plan.declared_tools)
    return await ingress._serve(chat, plan.token_ids, chat=True, http=http, plan=plan, fmt=fmt)

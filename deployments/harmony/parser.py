"""Harmony output parsing on token ids: one stateful parser per request and choice.

The model's reply is a run of messages ``<|channel|>C<|message|>TEXT<|end|>``
(each after the first opened by ``<|start|>assistant``), the last one ended by
``<|return|>`` or, for a tool call, ``<|call|>``. The parser follows that state
on token ids (``EXPECT_START → HEADER → CONTENT``), token by token, so how the
ids are split into chunks (one token on the standard lane, a quantum of up to 8
on the persistent lane) never changes what it produces. Each :meth:`feed` returns
the new :class:`Delta`; the deltas concatenate to :meth:`HarmonyOutputParser.result`.

Routing (as vLLM's harmony path): ``analysis`` → reasoning; ``final`` and
``commentary`` without a recipient (a preamble) → content; a message addressed
``to=functions.NAME`` (on any channel) → a tool call, emitted whole when its
message ends so that its arguments can be checked first.

Malformed output never raises: a call to an undeclared function, arguments that
are not JSON, a call cut off, a header that never reaches ``<|message|>``, text
outside any message, an unexpected special token or a turn that ended without a
final message (only reasoning) is recorded in
:attr:`HarmonyOutputParser.errors` (and the text that could be kept is kept).
"""

from __future__ import annotations

import codecs
import json
import re
import uuid
from dataclasses import dataclass, field

# Special tokens of the o200k_harmony vocabulary (openai-harmony's HarmonyGptOss encoding).
RETURN = 200002
CONSTRAIN = 200003
CHANNEL = 200005
START = 200006
END = 200007
MESSAGE = 200008
CALL = 200012
ASSISTANT_STOP_TOKENS = (RETURN, CALL)
"""``stop_tokens_for_assistant_actions()``: what ends the assistant's turn."""

NO_FINAL_MESSAGE = "the reply ended without a final message (no answer and no tool call)"
"""The error of a turn that ended (not cut by ``max_tokens``) with neither content nor a call, e.g.
``<|channel|>analysis<|message|>...<|return|>``: the response's content is then null."""

_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


@dataclass
class ToolCall:
    """One parsed function call (OpenAI's ``tool_calls[i]``: ``id``, ``type``, ``function``)."""

    id: str
    name: str
    arguments: str

    def to_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass
class Delta:
    """What one :meth:`HarmonyOutputParser.feed` added: reasoning text, content text, whole tool calls."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def extend(self, other: Delta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)


@dataclass
class _Header:
    channel: str | None
    recipient: str | None
    content_type: str | None


def parse_header(text: str) -> _Header:
    """Channel, recipient (``to=...``) and content type of a decoded header such as
    ``assistant to=functions.f<|channel|>commentary <|constrain|>json``."""
    channel = _CHANNEL.search(text)
    recipient = _RECIPIENT.search(text)
    ctype = None
    if channel is not None:
        rest = text[channel.end():]
        rest = _RECIPIENT.sub("", rest).replace("<|constrain|>", " ").split()
        ctype = rest[0] if rest else None
    return _Header(channel.group(1) if channel else None, recipient.group(1) if recipient else None, ctype)


class HarmonyOutputParser:
    """Turns the assistant's harmony token ids into reasoning, content and tool calls.

    Args:
        encoding: openai-harmony's ``HarmonyGptOss`` encoding (``decode_bytes`` of plain tokens).
        declared_tools: function names the prompt declared; a call to any other is an error.
            None accepts any name.
        in_header: the prompt ended with ``<|start|>assistant`` (the usual case), so the first
            tokens are the first message's header.
    """

    def __init__(self, encoding, declared_tools: frozenset[str] | set[str] | None = None, in_header: bool = True):
        self.enc = encoding
        self.declared = None if declared_tools is None else frozenset(declared_tools)
        self.state = "HEADER" if in_header else "EXPECT_START"
        self._header: list[int] = []
        self._route: str | None = None  # reasoning | content | call | None while no message
        self._call_name = ""
        self._body: list[int] = []  # the current call's argument tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.reasoning = ""
        self.content = ""
        self.tool_calls: list[ToolCall] = []
        self.errors: list[str] = []
        self.ended_with: int | None = None  # RETURN / CALL once the turn ended
        self.num_tokens = 0
        self.reasoning_tokens = 0  # tokens of analysis-channel text (the Responses API's usage)

    # ---- public --------------------------------------------------------------------------
    def feed(self, token_ids) -> Delta:
        """Consume the next output tokens (any split); return what they added."""
        out = Delta()
        for t in token_ids:
            self.num_tokens += 1
            self._token(int(t), out)
        return out

    def finish(self, finish_reason: str | None = None) -> Delta:
        """The output ended (``finish_reason`` from the engine): flush what is pending and note a
        message that was never closed, or (:data:`NO_FINAL_MESSAGE`) a turn that ended with neither
        content nor a tool call and no other error. Returns the last delta."""
        out = Delta()
        if self.state == "CONTENT":
            where = {"reasoning": "the analysis channel", "content": "the final answer",
                     "call": f"the call to {self._call_name}"}.get(self._route or "", "a message")
            why = "max_tokens was reached" if finish_reason == "length" else "the output ended"
            self.errors.append(f"{why} inside {where} (the message was never closed)")
            if self._route == "call":
                self._body = []
            else:
                self._flush_text(out, final=True)
        elif self.state == "HEADER" and self._header and CHANNEL not in self._header:
            self._header_as_content(out)
        elif self.state == "HEADER" and self._header:
            self.errors.append("the output ended inside a message header")
        if finish_reason != "length" and not self.content and not self.tool_calls and not self.errors:
            self.errors.append(NO_FINAL_MESSAGE)
        self.state = "DONE"
        self._route = None
        return out

    @property
    def finish_reason_override(self) -> str | None:
        """``tool_calls`` when the turn made a valid call (OpenAI's finish reason for it), else None."""
        return "tool_calls" if self.tool_calls else None

    # ---- the state machine -----------------------------------------------------------------
    def _token(self, t: int, out: Delta) -> None:
        if self.state == "DONE":
            if not self.errors or not self.errors[-1].startswith("tokens after"):
                self.errors.append("tokens after the end of the turn were ignored")
            return
        if self.state == "EXPECT_START":
            if t == START:
                if self._route == "stray":
                    self._flush_text(out, final=True)
                    self._route = None
                self.state, self._header = "HEADER", []
            elif t in (RETURN, CALL):
                self.ended_with, self.state = t, "DONE"
            elif self.enc.is_special_token(t):
                self._unexpected(t, "between messages")
            else:  # text outside any message: keep it as content
                if self._route != "stray":
                    self.errors.append("text outside a harmony message (kept as content)")
                    self._route = "stray"
                self.content_piece(t, out)
            return
        if self.state == "HEADER":
            if t == MESSAGE:
                self._open(out)
            elif t == START:
                self._unexpected(t, "inside a message header (the header was dropped)")
                self._header = []
            elif t in (END, RETURN, CALL):
                if self._header and CHANNEL not in self._header:  # plain text where a header belongs
                    self._header_as_content(out)
                else:
                    self._unexpected(t, "inside a message header (the header was dropped)")
                self._header = []
                self.state = "DONE" if t in (RETURN, CALL) else "EXPECT_START"
            else:
                self._header.append(t)
            return
        # CONTENT
        if t in (END, RETURN, CALL):
            self._close(out)
            if t == END:
                self.state = "EXPECT_START"
            else:
                self.ended_with, self.state = t, "DONE"
        elif t == START:
            self._unexpected(t, "inside a message (the message was closed there)")
            self._close(out)
            self.state, self._header = "HEADER", []
        elif self.enc.is_special_token(t):
            self._unexpected(t, "inside a message (ignored)")
        elif self._route == "call":
            self._body.append(t)
        else:
            if self._route == "reasoning":
                self.reasoning_tokens += 1
            self.content_piece(t, out)

    def _header_as_content(self, out: Delta) -> None:
        self.errors.append("text outside a harmony message (kept as content)")
        self._route = "content"
        for h in self._header:
            self.content_piece(h, out)
        self._flush_text(out, final=True)
        self._route, self._header = None, []

    def content_piece(self, t: int, out: Delta) -> None:
        # the token's raw bytes (the public decode() replaces a partial UTF-8 character per call)
        text = self._utf8.decode(bytes(self.enc._inner.decode_bytes([t])))
        self._add_text(text, out)

    def _add_text(self, text: str, out: Delta) -> None:
        if not text:
            return
        if self._route == "reasoning":
            self.reasoning += text
            out.reasoning += text
        else:
            self.content += text
            out.content += text

    def _flush_text(self, out: Delta, final: bool) -> None:
        self._add_text(self._utf8.decode(b"", final=final), out)
        self._utf8.reset()

    def _open(self, out: Delta) -> None:
        header = parse_header(self.enc.decode(self._header))
        self._header, self.state = [], "CONTENT"
        if header.recipient and header.recipient != "assistant":
            self._route, self._call_name, self._body = "call", header.recipient, []
        elif header.channel == "analysis":
            self._route = "reasoning"
        else:
            if header.channel not in ("final", "commentary"):
                self.errors.append(f"a message on the unknown channel {header.channel!r} (kept as content)")
            self._route = "content"

    def _close(self, out: Delta) -> None:
        if self._route == "call":
            self._close_call(out)
        else:
            self._flush_text(out, final=True)
        self._route = None

    def _close_call(self, out: Delta) -> None:
        recipient, body, self._body = self._call_name, self._body, []
        arguments = self.enc.decode(body).strip()
        if not recipient.startswith("functions."):
            self.errors.append(f"a call to {recipient!r}, which is not a function tool (dropped)")
            return
        name = recipient[len("functions."):]
        if self.declared is not None and name not in self.declared:
            self.errors.append(f"a call to the undeclared function {name!r} with arguments {arguments!r} (dropped)")
            return
        try:
            json.loads(arguments)
        except ValueError as exc:
            self.errors.append(f"the call to {name!r} has arguments that are not JSON ({exc}): {arguments!r} (dropped)")
            return
        call = ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=name, arguments=arguments)
        self.tool_calls.append(call)
        out.tool_calls.append(call)

    def _unexpected(self, t: int, where: str) -> None:
        self.errors.append(f"unexpected token {t} ({self.enc.decode([t])}) {where}")

"""Chat messages → harmony prompt token ids (``openai-harmony`` renders).

What goes where (GPT-OSS's harmony format; the roles' rules follow the gpt-oss chat
template and vLLM):

* a **system** message (``SystemContent``): model identity, knowledge cutoff, the
  conversation start date, ``Reasoning: low|medium|high`` and the valid channels
  (``commentary`` only when function tools are declared, as vLLM does);
* the request's ``system`` and ``developer`` messages become the **developer**
  message's ``# Instructions`` (joined in order), followed by the ``functions``
  namespace of the declared tools and, for ``response_format: json_schema``, a
  ``# Response Formats`` section naming the schema;
* ``user`` messages as they are; ``assistant`` messages as an ``analysis`` message
  (their ``reasoning_content``/``reasoning``/``thinking``), then either one
  ``commentary`` call per tool call (``to=functions.NAME``, content type ``json``) or
  their ``content`` on ``final``; the library drops the analysis of turns that ended
  in a final answer;
* ``tool`` messages as ``functions.NAME to=assistant`` on ``commentary``; the name
  comes from the assistant tool call that ``tool_call_id`` answers (or ``name``).

The prompt ends with ``<|start|>assistant`` and the model's actions end with
``<|return|>`` (200002) or ``<|call|>`` (200012): :data:`HarmonyPrompt.stop_token_ids`.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass, field

from deployments.harmony.vocab import harmony_encoding

EFFORTS = ("low", "medium", "high")
"""``reasoning_effort`` values (vLLM's request field; the system line ``Reasoning: ...``)."""


class RenderError(ValueError):
    """A conversation that cannot be rendered (the message says which message and why)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class FunctionTool:
    """One declared function: ``name``, ``description`` and its JSON-schema ``parameters``."""

    name: str
    description: str = ""
    parameters: dict | None = None


@dataclass
class HarmonyPrompt:
    """A rendered harmony prompt.

    Attributes:
        token_ids: the prompt, ending with ``<|start|>assistant``.
        stop_token_ids: the tokens that end the assistant's turn (``<|return|>``, ``<|call|>``).
        declared_tools: names of the functions the developer message declares (calls to others
            are reported as errors by the output parser).
        text: the prompt decoded (special tokens spelled out), for debugging and ``/tokenize``.
    """

    token_ids: list[int]
    stop_token_ids: tuple[int, ...]
    declared_tools: frozenset[str] = field(default_factory=frozenset)
    text: str = ""


def start_date(setting: str | None) -> str | None:
    """The ``Current date:`` for a start-date setting: ``today`` (local date, as vLLM), ``none``, or a date."""
    if setting is None or setting == "none":
        return None
    if setting == "today":
        return datetime.date.today().isoformat()
    return setting


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)


def _reasoning(msg: dict) -> str:
    for key in ("reasoning_content", "reasoning", "thinking"):
        if msg.get(key):
            return str(msg[key])
    return ""


def response_format_section(name: str, schema: dict, description: str | None = None) -> str:
    """The developer message's ``# Response Formats`` section for one JSON schema (harmony's layout)."""
    desc = f"// {description}\n" if description else ""
    return f"# Response Formats\n\n## {name}\n\n{desc}{json.dumps(schema, separators=(',', ':'))}"


def render_chat(
    messages: list[dict],
    *,
    tools: list[FunctionTool] | None = None,
    reasoning_effort: str | None = None,
    conversation_start_date: str | None = None,
    response_format: tuple[str, dict, str | None] | None = None,
    encoding=None,
) -> HarmonyPrompt:
    """Render an OpenAI chat conversation as a harmony prompt for the assistant's next turn.

    Args:
        messages: chat messages as dicts (``role``, ``content``, and for assistants
            ``tool_calls`` / ``reasoning_content``; for tools ``tool_call_id`` / ``name``).
        tools: the functions to declare (None or empty: none; the caller leaves them out for
            ``tool_choice: none``).
        reasoning_effort: ``low``, ``medium`` or ``high`` (None: the library's default, medium).
        conversation_start_date: the ``Current date:`` line (None: no line).
        response_format: ``(name, schema, description)`` of a ``json_schema`` response format.
        encoding: a harmony encoding (default: :func:`~deployments.harmony.vocab.harmony_encoding`).

    Raises:
        RenderError: an unknown role or effort, or a tool message that answers no known call.
    """
    from openai_harmony import (
        Author,
        ChannelConfig,
        Conversation,
        DeveloperContent,
        Message,
        ReasoningEffort,
        Role,
        SystemContent,
        ToolDescription,
    )

    enc = encoding or harmony_encoding()
    system = SystemContent.new()
    if reasoning_effort is not None:
        if reasoning_effort not in EFFORTS:
            raise RenderError(f"reasoning_effort must be one of {', '.join(EFFORTS)}; got {reasoning_effort!r}",
                              param="reasoning_effort")
        system = system.with_reasoning_effort(ReasoningEffort[reasoning_effort.upper()])
    if conversation_start_date:
        system = system.with_conversation_start_date(conversation_start_date)
    if not tools:
        system = system.with_channel_config(ChannelConfig.require_channels(["analysis", "final"]))
    out = [Message.from_role_and_content(Role.SYSTEM, system)]

    instructions = [_text(m.get("content")) for m in messages if m.get("role") in ("system", "developer")]
    instructions = [t for t in instructions if t]
    if response_format is not None:
        instructions.append(response_format_section(*response_format))
    if instructions or tools:
        dev = DeveloperContent.new()
        if instructions:
            dev = dev.with_instructions("\n\n".join(instructions))
        if tools:
            dev = dev.with_function_tools(
                [ToolDescription.new(t.name, t.description or "", t.parameters) for t in tools])
        out.append(Message.from_role_and_content(Role.DEVELOPER, dev))

    call_names: dict[str, str] = {}
    for i, m in enumerate(messages):
        role = m.get("role")
        if role in ("system", "developer"):
            continue
        if role == "user":
            out.append(Message.from_role_and_content(Role.USER, _text(m.get("content"))))
        elif role == "assistant":
            reasoning = _reasoning(m)
            if reasoning:
                out.append(Message.from_role_and_content(Role.ASSISTANT, reasoning).with_channel("analysis"))
            calls = m.get("tool_calls") or []
            text = _text(m.get("content"))
            if calls:
                if text:  # a preamble before the calls goes on commentary, as the model writes it
                    out.append(Message.from_role_and_content(Role.ASSISTANT, text).with_channel("commentary"))
                for call in calls:
                    fn = call.get("function") or {}
                    name = fn.get("name") or ""
                    if call.get("id"):
                        call_names[call["id"]] = name
                    out.append(Message.from_role_and_content(Role.ASSISTANT, fn.get("arguments") or "{}")
                               .with_channel("commentary").with_recipient(f"functions.{name}")
                               .with_content_type("json"))
            elif text or not reasoning:
                out.append(Message.from_role_and_content(Role.ASSISTANT, text).with_channel("final"))
        elif role == "tool":
            name = call_names.get(m.get("tool_call_id") or "") or m.get("name")
            if not name:
                raise RenderError(
                    f"messages[{i}] (role tool) answers tool_call_id {m.get('tool_call_id')!r}, which no earlier "
                    "assistant message's tool_calls has; give the call or the tool's `name`",
                    param=f"messages.{i}.tool_call_id")
            out.append(Message.from_author_and_content(Author.new(Role.TOOL, f"functions.{name}"),
                                                       _text(m.get("content")))
                       .with_channel("commentary").with_recipient("assistant"))
        else:
            raise RenderError(f"messages[{i}]: unknown role {role!r}", param=f"messages.{i}.role")
    ids = enc.render_conversation_for_completion(Conversation.from_messages(out), Role.ASSISTANT)
    return HarmonyPrompt(
        token_ids=list(ids), stop_token_ids=tuple(enc.stop_tokens_for_assistant_actions()),
        declared_tools=frozenset(t.name for t in tools or ()), text=enc.decode(ids),
    )


def without_generation_prompt(token_ids: list[int]) -> list[int]:
    """A rendered prompt (:attr:`HarmonyPrompt.token_ids`, ending with the assistant's ``<|start|>assistant``
    header) without that header: the ids before the last ``<|start|>`` (``/tokenize`` with
    ``add_generation_prompt: false``, as vLLM's)."""
    from deployments.harmony.parser import START

    last = max((i for i, t in enumerate(token_ids) if t == START), default=len(token_ids))
    return token_ids[:last]


def required_call_grammar(tools: list[FunctionTool]) -> str:
    """An llguidance Lark grammar for a harmony reply that must end in a call to one of ``tools``
    (``tool_choice`` ``required`` or a named function): optional reasoning on ``analysis``, then
    ``<|start|>assistant to=functions.NAME<|channel|>commentary <|constrain|>json<|message|>``,
    arguments matching the function's ``parameters`` schema, ``<|call|>``.

    Raises:
        RenderError: no tools.
    """
    if not tools:
        raise RenderError("tool_choice needs at least one tool", param="tool_choice")
    calls = []
    rules = []
    for i, t in enumerate(tools):
        schema = t.parameters if t.parameters else {"type": "object"}
        calls.append(f"call_{i}")
        rules.append(f'call_{i}: " to=functions.{t.name}" <|channel|> "commentary " <|constrain|> "json" '
                     f"<|message|> args_{i} <|call|>")
        rules.append(f"args_{i}: %json {json.dumps(schema)}")
    return "\n".join(["start: analysis? call", *_ANALYSIS, "call: " + " | ".join(calls), *rules]) + "\n"


_ANALYSIS = ('analysis: <|channel|> "analysis" <|message|> TEXT <|end|> <|start|> "assistant"', r"TEXT: /(.|\n)*/")
"""Lark rules of an optional reasoning message before the one the grammar requires (special tokens by name)."""


def final_answer_grammar(schema_json: str) -> str:
    """An llguidance Lark grammar for a harmony reply whose answer must match a JSON schema
    (``response_format``): optional reasoning on ``analysis``, then
    ``<|channel|>final<|message|>``, JSON matching ``schema_json`` (the schema as JSON text), ``<|return|>``.
    So the reply cannot end inside its reasoning, and what follows it is the answer.
    """
    return "\n".join(["start: analysis? final", *_ANALYSIS,
                      'final: <|channel|> "final" <|message|> answer <|return|>',
                      f"answer: %json {schema_json}"]) + "\n"

"""How a chat request becomes a prompt, engine parameters and a response format.

The chat format is resolved once per ingress from the tokenizer: ``harmony`` when its
vocabulary is GPT-OSS's (``<|start|>`` = 200006, ``<|channel|>`` = 200005, ...), else
the checkpoint's chat template. ``/debug/stats`` shows it (``chat_format``).

* harmony: the prompt is rendered by :mod:`deployments.harmony.render` (tools,
  ``reasoning_effort``, the conversation start date from ``harmony_start_date``),
  ``<|return|>`` and ``<|call|>`` are added to the stop tokens, and the answer is
  parsed from token ids (:class:`~deployments.harmony.chat_format.HarmonyChatFormat`);
* chat template: as before; ``tools`` are refused (400: no tool-call format for it).

``response_format`` (``json_object`` / ``json_schema``) becomes a
:class:`~replicas.structured_output.StructuredOutput` for the standard lane's sampler on
either format; for harmony it is a grammar over the whole reply (optional reasoning, then a
``final`` message whose text matches the schema, then ``<|return|>``:
:func:`~deployments.harmony.render.final_answer_grammar`), so the reply cannot end inside
its reasoning, and a ``json_schema`` is also named in the developer message.
``tool_choice``: ``none`` declares no tools; ``auto`` declares them all and the model decides;
``required`` (all declared) and a named function (only it declared) are enforced by a grammar
over the whole reply (optional reasoning, then a call whose arguments match the function's
schema), so they run on the standard lane like other structured outputs.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from deployments.openai_format import ChatFormat
from deployments.protocol import OpenAIError
from deployments.tokenize_api import encode_chat
from replicas.request import SamplingParams
from replicas.structured_output import GrammarError, StructuredOutput, structured_output

logger = logging.getLogger(__name__)

TEMPLATE_PROBES = (
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Bonjour", "reasoning_content": "Greet back."}, {"role": "user", "content": "Bye"}],
)
"""Conversations (no tools) on which a harmony checkpoint's own chat template must give our ids."""

HARMONY_TOKENS = {"<|start|>": 200006, "<|channel|>": 200005, "<|message|>": 200008, "<|end|>": 200007,
                  "<|return|>": 200002, "<|call|>": 200012}
"""Harmony's special tokens in the o200k_harmony vocabulary: a tokenizer with all of them speaks harmony."""


def is_harmony_tokenizer(tokenizer) -> bool:
    """True when ``tokenizer`` has GPT-OSS's harmony special tokens at their ids."""
    try:
        return all(tokenizer.convert_tokens_to_ids(t) == i for t, i in HARMONY_TOKENS.items())
    except Exception:  # noqa: BLE001 - a tokenizer without these tokens
        return False


@dataclass
class ChatPlan:
    """One chat request, ready for the engine.

    Attributes:
        token_ids: the prompt.
        stop_token_ids: token ids to add to the request's own (harmony: ``<|return|>``, ``<|call|>``).
        structured_output: the grammar for ``response_format``, or None.
        declared_tools: function names the harmony prompt declared (None: not harmony).
        include_reasoning: return the reasoning (harmony).
    """

    token_ids: list[int]
    stop_token_ids: tuple[int, ...] = ()
    structured_output: StructuredOutput | None = None
    declared_tools: frozenset[str] | None = None
    include_reasoning: bool = True

    def apply(self, params: SamplingParams) -> SamplingParams:
        """``params`` with this plan's stop tokens and grammar."""
        stops = tuple(dict.fromkeys((*params.stop_token_ids, *self.stop_token_ids)))
        return replace(params, stop_token_ids=stops, structured_output=self.structured_output)


class ChatPlanner:
    """Per ingress: the chat format of the served model and the plan of each chat request.

    Args:
        tokenizer: the model's HF tokenizer.
        model_dir: the checkpoint directory (its ``tokenizer.json`` supplies harmony's vocabulary file).
        start_date: harmony's ``Current date:`` setting (``today``, ``none`` or ``YYYY-MM-DD``).
        encoder: how client text is tokenized (:class:`~deployments.client_text.ClientTextEncoder`: special-token
            strings in it stay text unless the app allows them); default: text only.
    """

    def __init__(self, tokenizer, model_dir: str | Path | None = None, start_date: str = "today", encoder=None):
        self.tokenizer = tokenizer
        self.encoder = encoder
        self.harmony = is_harmony_tokenizer(tokenizer)
        self.start_date = start_date
        self.encoding = None
        if self.harmony:
            from deployments.harmony import harmony_encoding

            tj = Path(model_dir) / "tokenizer.json" if model_dir else None
            self.encoding = harmony_encoding(str(tj) if tj and tj.is_file() else None)
        self.template_check = self.check_checkpoint_template() if self.harmony else None

    def describe(self) -> dict:
        """For ``/debug/stats``."""
        return {"chat_format": "harmony" if self.harmony else "chat_template",
                **({"harmony_start_date": self.start_date, "checkpoint_chat_template": self.template_check}
                   if self.harmony else {})}

    def check_checkpoint_template(self, template: str | None = None) -> str:
        """Whether the checkpoint's own chat template gives the harmony renderer's ids on
        :data:`TEMPLATE_PROBES` at each reasoning effort: ``agrees``, ``differs: ...`` (logged as a
        warning; prompts are rendered by openai-harmony either way) or ``none`` (no template).

        ``template`` replaces the tokenizer's (tests). The template gets ``reasoning_effort`` and
        ``conversation_start_date`` (today, which is also what a template's ``strftime_now`` gives).
        """
        from deployments.harmony import render_chat

        template = template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            return "none"
        today = datetime.date.today().isoformat()
        for conversation in TEMPLATE_PROBES:
            for effort in ("low", "medium", "high"):
                want = render_chat(conversation, reasoning_effort=effort, conversation_start_date=today,
                                   encoding=self.encoding).token_ids
                try:
                    text = self.tokenizer.apply_chat_template(
                        conversation, chat_template=template, add_generation_prompt=True, tokenize=False,
                        reasoning_effort=effort, conversation_start_date=today)
                    got = list(self.tokenizer.encode(text, add_special_tokens=False))
                except Exception as exc:  # noqa: BLE001 - a template that cannot render the probe
                    got, text = None, f"error: {exc}"
                if got != want:
                    result = (f"differs: on {len(conversation)} messages at effort {effort} it renders "
                              f"{text[:200]!r}")
                    logger.warning("the checkpoint's chat template %s", result)
                    return result
        return "agrees"

    def _structured(self, body) -> StructuredOutput | None:
        fmt = body.response_format
        if fmt is None or fmt.type == "text":
            return None
        try:
            spec = structured_output(fmt.schema_or_none())
        except GrammarError as exc:
            raise OpenAIError(str(exc), param="response_format") from exc
        if self.harmony:  # the whole reply: optional reasoning, then a final message that is the answer
            from deployments.harmony.render import final_answer_grammar

            return StructuredOutput(lark=final_answer_grammar(spec.schema))
        return spec

    def plan(self, body) -> ChatPlan:
        """The plan of a :class:`~deployments.protocol.ChatCompletionRequest`.

        Raises:
            OpenAIError: 400 for tools on a model without a tool format, a schema that does not
                compile, or a conversation harmony cannot render.
        """
        structured = self._structured(body)
        if not self.harmony:
            if body.tools and body.tool_choice != "none":
                raise OpenAIError("tools are supported for models that use the harmony format (GPT-OSS); this "
                                  "model's chat template has no tool-call format", param="tools",
                                  code="unsupported_parameter")
            return ChatPlan(encode_chat(self.encoder or self.tokenizer, body.messages), structured_output=structured)
        return self.plan_harmony([m.model_dump(exclude_none=True) for m in body.messages], body.tools,
                                 body.tool_choice, body.reasoning_effort, body.response_format, structured,
                                 body.include_reasoning)

    def plan_harmony(self, messages: list[dict], tools, tool_choice, reasoning_effort, response_format,
                     structured: StructuredOutput | None, include_reasoning: bool = True) -> ChatPlan:
        """The harmony plan of already-validated fields (also used by the Responses API)."""
        from deployments.harmony import FunctionTool, RenderError, render_chat, start_date
        from deployments.harmony.render import required_call_grammar

        declared = list(tools or ())
        if tool_choice == "none":
            declared = []
        elif tool_choice is not None and not isinstance(tool_choice, str):
            declared = [t for t in declared if t.function.name == tool_choice.function.name]
        fmt = None
        if response_format is not None and response_format.type == "json_schema" and response_format.json_schema:
            js = response_format.json_schema
            fmt = (js.name, js.schema_, js.description)
        for i, m in enumerate(messages):
            for key in ("content", "reasoning_content", "reasoning"):
                if isinstance(m.get(key), str):
                    try:
                        m[key].encode("utf-8")
                    except UnicodeEncodeError as exc:
                        raise OpenAIError(f"messages[{i}].{key} is not valid Unicode text ({exc.reason})",
                                          param=f"messages.{i}.{key}") from exc
        functions = [FunctionTool(t.function.name, t.function.description or "", t.function.parameters)
                     for t in declared]
        if tool_choice == "required" or (tool_choice is not None and not isinstance(tool_choice, str)):
            if structured is not None:
                raise OpenAIError("response_format cannot be combined with tool_choice 'required' or a named "
                                  "function (the reply must be a call)", param="response_format")
            for t in functions:  # the arguments' schemas must compile
                try:
                    structured_output(t.parameters or None)
                except GrammarError as exc:
                    raise OpenAIError(f"tools: the parameters of {t.name!r}: {exc}", param="tools") from exc
            structured = StructuredOutput(lark=required_call_grammar(functions))
        try:
            prompt = render_chat(
                messages,
                tools=functions,
                reasoning_effort=reasoning_effort, conversation_start_date=start_date(self.start_date),
                response_format=fmt, encoding=self.encoding)
        except RenderError as exc:
            raise OpenAIError(str(exc), param=exc.param or "messages") from exc
        return ChatPlan(prompt.token_ids, prompt.stop_token_ids, structured, prompt.declared_tools, include_reasoning)

    def formatter(self, plan: ChatPlan, model: str, tokens, logprobs: bool):
        """The response formatter for ``plan``."""
        if plan.declared_tools is None:
            return ChatFormat(model, tokens, logprobs)
        from deployments.harmony.chat_format import HarmonyChatFormat

        return HarmonyChatFormat(model, tokens, logprobs, self.encoding, plan.declared_tools, plan.include_reasoning)

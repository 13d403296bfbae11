"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` in vLLM's shapes, plus the
prompt encoding the chat and completions endpoints share (so ``/tokenize`` gives the ids they count
as prompt tokens).

The encoding functions take a tokenizer or a :class:`~deployments.client_text.ClientTextEncoder`
(the ingress passes its own, which carries the ``allow-special-tokens`` setting); given a bare
tokenizer they use a cached encoder that keeps special-token strings in client text as text.
"""

from __future__ import annotations

import weakref
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from deployments.chat_extensions import ResponseFormat, ToolChoice, ToolParam
from deployments.client_text import ClientTextEncoder
from deployments.protocol import ChatMessage, OpenAIError

_ENCODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def client_encoder(tokenizer_or_encoder) -> ClientTextEncoder:
    """``tokenizer_or_encoder`` itself if it is an encoder, else the (cached) text-only encoder of the tokenizer."""
    if isinstance(tokenizer_or_encoder, ClientTextEncoder):
        return tokenizer_or_encoder
    enc = _ENCODERS.get(tokenizer_or_encoder)
    if enc is None:
        enc = _ENCODERS[tokenizer_or_encoder] = ClientTextEncoder(tokenizer_or_encoder)
    return enc


CHAT_FIELDS = ("tools", "tool_choice", "reasoning_effort", "response_format")
"""Chat fields that change a harmony prompt; ``/tokenize`` takes them with ``messages`` (as vLLM takes ``tools``)."""


class TokenizeRequest(BaseModel):
    """``{"model", "prompt"}`` or ``{"model", "messages", "add_generation_prompt"}``, plus for messages the
    chat request's ``tools``, ``tool_choice``, ``reasoning_effort`` and ``response_format`` (a harmony prompt
    declares the tools, states the effort and names a ``json_schema``: the ids are then the chat endpoint's
    ``prompt_tokens``; the chat template of other models ignores them, and ``tools`` get the chat endpoint's 400).

    ``add_special_tokens`` defaults as in vLLM: true for a prompt, false for
    messages (the chat template already has them). Unknown fields are refused (400 naming the field).
    """

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None
    return_token_strs: bool = False
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    response_format: ResponseFormat | None = None

    def chat_request(self):
        """The chat request whose prompt ids these messages and chat fields give (checked as the chat endpoint
        checks it).

        Raises:
            OpenAIError: 400 for a tool_choice naming no tool, or a json_schema without a schema.
        """
        from deployments.protocol import ChatCompletionRequest

        chat = ChatCompletionRequest(messages=self.messages, **{k: getattr(self, k) for k in CHAT_FIELDS
                                                                if getattr(self, k) is not None})
        chat.check()
        return chat


class DetokenizeRequest(BaseModel):
    """``{"model", "tokens"}``; unknown fields are refused (400 naming the field)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


def _hf(tokenizer_or_encoder):
    """The Hugging Face tokenizer of an encoder, or the tokenizer itself."""
    if isinstance(tokenizer_or_encoder, ClientTextEncoder):
        return tokenizer_or_encoder.tokenizer
    return tokenizer_or_encoder


def encode_prompt(tokenizer, prompt: str, add_special_tokens: bool = True) -> list[int]:
    """The prompt ids of a completions request (special-token strings in it as the encoder decides)."""
    try:
        return client_encoder(tokenizer).encode_text(prompt, add_special_tokens=add_special_tokens)
    except Exception as exc:  # noqa: BLE001 - e.g. lone surrogates: the client's input
        raise OpenAIError(f"could not tokenize the prompt: {exc}", param="prompt") from exc


def encode_chat(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True,
                add_special_tokens: bool = False) -> list[int]:
    """The prompt ids of a chat request (chat template applied)."""
    conversation = [{"role": m.role, "content": m.text()} for m in messages]
    for i, turn in enumerate(conversation):
        try:
            turn["content"].encode("utf-8")
        except UnicodeEncodeError as exc:  # e.g. a lone UTF-16 surrogate escaped in the JSON
            raise OpenAIError(f"messages[{i}].content is not valid Unicode text ({exc.reason} at "
                              f"position {exc.start})", param=f"messages.{i}.content") from exc
    try:
        return client_encoder(tokenizer).encode_chat(conversation, add_generation_prompt, add_special_tokens)
    except OpenAIError:
        raise
    except Exception as exc:  # noqa: BLE001 - template errors are the client's input
        raise OpenAIError(f"could not apply the chat template: {exc}", param="messages") from exc


def check_token_ids(tokenizer, ids: list[int], param: str) -> None:
    vocab = len(_hf(tokenizer))
    bad = next((t for t in ids if t < 0 or t >= vocab), None)
    if bad is not None:
        raise OpenAIError(f"token id {bad} is out of range: ids must be in [0, {vocab})", param=param)


def check_shape(req: TokenizeRequest) -> None:
    """Exactly one of ``prompt`` and ``messages``; the chat fields only with ``messages``.

    Raises:
        OpenAIError: 400 naming the field.
    """
    if (req.prompt is None) == (req.messages is None):
        raise OpenAIError("send exactly one of `prompt` and `messages`", param="prompt")
    if req.prompt is not None:
        for name in CHAT_FIELDS:
            if getattr(req, name) is not None:
                raise OpenAIError(f"{name} applies to `messages`, not to a `prompt`", param=name)


def tokenize_result(tokenizer, ids: list[int], max_model_len: int, token_strs: bool) -> dict:
    """``{"tokens", "count", "max_model_len"}`` (+ ``token_strs`` when asked)."""
    out = {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}
    if token_strs:
        out["token_strs"] = _hf(tokenizer).convert_ids_to_tokens(ids)
    return out


def tokenize(tokenizer, req: TokenizeRequest, max_model_len: int) -> dict:
    """``{"tokens", "count", "max_model_len"}`` (+ ``token_strs`` when asked)."""
    check_shape(req)
    if req.messages is not None:
        ids = encode_chat(tokenizer, req.messages, req.add_generation_prompt, bool(req.add_special_tokens))
    else:
        ids = encode_prompt(tokenizer, req.prompt, req.add_special_tokens is not False)
    return tokenize_result(tokenizer, ids, max_model_len, req.return_token_strs)


def detokenize(tokenizer, req: DetokenizeRequest) -> dict:
    """``{"prompt": text}`` for ``req.tokens`` (400 naming ``tokens`` for ids outside the vocabulary)."""
    check_token_ids(tokenizer, req.tokens, "tokens")
    return {"prompt": _hf(tokenizer).decode(req.tokens)}


_LOCAL_FIELDS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path", "is_local", "local_files_only")
"""Tokenizer settings that describe this server's files, not the tokenizer: left out of ``/tokenizer_info``."""


def _json_safe(value):
    """A tokenizer setting as JSON: special-token objects become their text (``AddedToken.content``)."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def tokenizer_info(tokenizer, max_model_len: int) -> dict:
    """vLLM's ``GET /tokenizer_info``: the tokenizer's configuration as in its ``tokenizer_config.json``.

    The tokenizer's own settings (``init_kwargs``, JSON-safe, without paths of
    this server's files), plus ``tokenizer_class``, the special tokens as text
    (``eos_token``, ``bos_token``, ``pad_token``, ``unk_token``; null when the
    tokenizer has none) and ``chat_template`` (the one ``/v1/chat/completions``
    applies). lm-eval's remote tokenizer reads the special tokens and the
    template from it (then ``/tokenize`` and ``/detokenize`` for the ids), so an
    evaluation needs no tokenizer download. ``max_model_len`` is this server's
    context limit (also in ``/v1/models``).
    """
    info = {k: _json_safe(v) for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
            if k not in _LOCAL_FIELDS}
    for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
        info[name] = _json_safe(getattr(tokenizer, name, None))
    template = getattr(tokenizer, "chat_template", None)
    if template:
        info["chat_template"] = template
    info["tokenizer_class"] = type(tokenizer).__name__
    info["max_model_len"] = max_model_len
    return info

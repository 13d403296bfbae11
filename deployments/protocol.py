"""OpenAI-compatible request models and error bodies (pydantic).

Only what the serving path honours is accepted; parameters we do not support
yet are rejected with a 400 naming them rather than silently ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class OpenAIError(Exception):
    """An error to return as an OpenAI-style JSON body with an HTTP status."""

    def __init__(self, message: str, status: int = 400, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def validation_error(errors: list[dict]) -> OpenAIError:
    """Turn FastAPI/pydantic validation errors into one OpenAI-style 400 naming the first problem."""
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    kind = first.get("type", "")
    if kind == "json_invalid":
        pos = loc[0] if loc else "?"
        return OpenAIError(f"the request body is not valid JSON (error at character {pos})")
    if not loc and kind in ("model_attributes_type", "dict_type"):
        return OpenAIError("the request body must be a JSON object (send Content-Type: application/json)")
    where = ".".join(loc)
    return OpenAIError(f"{where or 'body'}: {first.get('msg', 'invalid request')}", param=where or None)


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


UNSUPPORTED_EXTRAS = (
    "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "response_format",
    "logit_bias", "top_logprobs", "echo", "suffix", "repetition_penalty", "min_p", "min_tokens",
)
"""OpenAI/vLLM parameters we do not honour yet: a request that sets one gets a 400 naming it."""


class _SamplingFields(BaseModel):
    """Fields chat and completions share (OpenAI names; ``top_k``/``ignore_eos``/``stop_token_ids`` as in vLLM).

    Unknown fields are kept (``model_extra``) so that :meth:`unsupported` can name
    the ones we cannot honour; other unknown fields (``store``, ``metadata``) are ignored.
    """

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    n: int = Field(1, ge=1, le=16)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if v is None:
            return []
        stops = [v] if isinstance(v, str) else v
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return stops

    def unsupported(self) -> list[str]:
        """Names of parameters set to values this build cannot honour yet (rejected with a 400)."""
        bad = []
        if self.logprobs is not None and self.logprobs is not False:
            bad.append("logprobs")
        if self.presence_penalty:
            bad.append("presence_penalty")
        if self.frequency_penalty:
            bad.append("frequency_penalty")
        extra = self.model_extra or {}
        for name in UNSUPPORTED_EXTRAS:
            value = extra.get(name)
            if value not in (None, [], {}, False) and not (name == "response_format" and value == {"type": "text"}):
                bad.append(name)
        if extra.get("best_of") not in (None, 1):
            bad.append("best_of")
        return bad


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("batched prompts are not supported; send one prompt per request")
            return v[0]
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return v

    def output_limit(self) -> int | None:
        return self.max_tokens


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())

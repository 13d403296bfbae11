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


class _SamplingFields(BaseModel):
    """Fields chat and completions share (OpenAI names; ``top_k``/``ignore_eos``/``stop_token_ids`` as in vLLM)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    n: int = Field(1, ge=1, le=16)
    seed: int | None = None
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
        """Names of parameters set to values this build cannot honour yet."""
        bad = []
        if self.logprobs not in (None, False):
            bad.append("logprobs")
        if self.presence_penalty:
            bad.append("presence_penalty")
        if self.frequency_penalty:
            bad.append("frequency_penalty")
        return bad


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = None

    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str]
    echo: bool = False

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

"""OpenAI-compatible request models and error bodies (pydantic).

Only what the serving path honours is accepted; parameters we do not support
yet are rejected with a 400 naming them rather than silently ignored. Each request
maps itself to the engine's :class:`~replicas.request.SamplingParams`.
"""

from __future__ import annotations

import time
import uuid
from typing import ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)

from deployments.chat_extensions import ResponseFormat, ToolChoice, ToolParam
from replicas.request import SamplingParams


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
    name: str | None = None
    tool_calls: list[dict] | None = None
    """Assistant messages: the calls it made (``id``, ``type``, ``function.name``, ``function.arguments``)."""
    tool_call_id: str | None = None
    """Tool messages: the call they answer."""
    reasoning_content: str | None = None
    """Assistant messages: their reasoning (vLLM's field; ``reasoning`` is the newer name)."""
    reasoning: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


UNSUPPORTED_EXTRAS = (
    "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "response_format",
    "logit_bias", "suffix", "prompt_logprobs",
)
"""OpenAI/vLLM parameters we do not honour yet: a request that sets one gets a 400 naming it."""


def _is_set(name: str, value) -> bool:
    """Whether an unsupported parameter asks for something (empty or default values are fine)."""
    if name == "prompt_logprobs":  # 0 asks for the prompt tokens' own logprobs
        return value is not None
    if name == "response_format":
        return value not in (None, {"type": "text"})
    return value not in (None, "", [], {}, False)


class _SamplingFields(BaseModel):
    """Fields chat and completions share (OpenAI names; vLLM's extensions ``top_k``, ``min_p``,
    ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``).

    Unknown fields are kept (``model_extra``) so that :meth:`check` can name
    the ones we cannot honour; other unknown fields (``store``, ``metadata``) are ignored.
    """

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=16)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    unsupported_extras: ClassVar[tuple[str, ...]] = UNSUPPORTED_EXTRAS

    @model_validator(mode="before")
    @classmethod
    def _nulls_mean_default(cls, data):
        """OpenAI clients may send ``null`` for any optional field: it means "use the default"."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if v is None:
            return []
        stops = [v] if isinstance(v, str) else v
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return [x for x in stops if x]  # an empty stop string can never match

    def check(self) -> None:
        """Raise a 400 :class:`OpenAIError` naming the first parameter we cannot honour."""
        bad = self.unsupported()
        if bad:
            raise OpenAIError(f"not supported yet: {', '.join(bad)}", param=bad[0], code="unsupported_parameter")

    def unsupported(self) -> list[str]:
        """Names of parameters set to values this build cannot honour yet (rejected with a 400)."""
        bad = []
        extra = self.model_extra or {}
        for name in self.unsupported_extras:
            if _is_set(name, extra.get(name)):
                bad.append(name)
        if extra.get("best_of") not in (None, 1):
            bad.append("best_of")
        return bad

    def logprobs_k(self) -> int | None:
        """``SamplingParams.logprobs``: None for none, else how many top alternatives per token."""
        raise NotImplementedError

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's parameters for this request, ``max_tokens`` already fitted to the context.

        Raises:
            OpenAIError: ``min_tokens`` above the output limit.
        """
        if self.min_tokens > max_tokens:
            raise OpenAIError(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({max_tokens}, "
                              "after fitting the context)", param="min_tokens")
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k if self.top_k and self.top_k > 0 else None, seed=self.seed,
            stop=tuple(self.stop or ()), stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, n=self.n, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens,
            logprobs=self.logprobs_k(),
        )


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    include_reasoning: bool = True

    unsupported_extras: ClassVar[tuple[str, ...]] = (*UNSUPPORTED_EXTRAS, "echo")  # vLLM's chat ``echo`` (prepend the last message)

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        names = [t.function.name for t in self.tools or ()]
        if self.tool_choice is not None and not isinstance(self.tool_choice, str):
            if self.tool_choice.function.name not in names:
                raise OpenAIError(f"tool_choice names the function {self.tool_choice.function.name!r}, which is not "
                                  "in tools", param="tool_choice")
        elif self.tool_choice == "required" and not names:
            raise OpenAIError("tool_choice 'required' needs at least one tool in tools", param="tool_choice")
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_schema" and (fmt.json_schema is None or fmt.json_schema.schema_ is None):
            raise OpenAIError("response_format json_schema needs json_schema.schema", param="response_format")

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str]
    logprobs: StrictInt | None = Field(None, ge=0, le=5)
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

    def check(self) -> None:
        super().check()
        if self.echo and self.logprobs is not None:
            # with echo, OpenAI/vLLM return the prompt's logprobs too; the engine does not compute them
            raise OpenAIError("not supported: echo together with logprobs (prompt logprobs)",
                              param="echo", code="unsupported_parameter")

    def logprobs_k(self) -> int | None:
        return self.logprobs

    def output_limit(self) -> int | None:
        return self.max_tokens


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())

"""Request models for tools and structured outputs (OpenAI's chat-completions shapes).

``tools`` / ``tool_choice`` (function tools; ``auto``, ``none``, ``required`` or a named
function) and ``response_format`` (``text``, ``json_object``, ``json_schema``). What the
server does with them: :mod:`deployments.chat_plan`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolParam(BaseModel):
    """``{"type": "function", "function": {"name", "description", "parameters", "strict"}}``."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """``{"type": "function", "function": {"name": ...}}``: the model must call this function."""

    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str = Field("response", min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``{"type": "text" | "json_object"}`` or ``{"type": "json_schema", "json_schema": {...}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def schema_or_none(self) -> dict | None:
        """The JSON schema to enforce (None for json_object: any object)."""
        return self.json_schema.schema_ if self.json_schema is not None else None

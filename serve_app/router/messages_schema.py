"""Strict bodies of Anthropic's ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

The same policy as ``request_schema``: types without coercion, Anthropic's ranges and enums, and a
failing field named with its path. vLLM's Anthropic request model coerces and ignores fields it
does not know; here, what it would silently mishandle is refused with a clear 400 instead:
server tools (``web_search_…``: there is no tool server), more ``stop_sequences`` than vLLM takes,
a ``thinking`` budget outside what vLLM accepts.
"""

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from serve_app.router.json_body import shown
from serve_app.router.strict import INT64, MAX_TOOLS, Body, Closed, FieldError, StopSequences, Strict

# Anthropic's own floor for an extended-thinking budget.
MIN_THINKING_BUDGET = 1024
# Anthropic's limit on metadata.user_id (its only metadata field).
MAX_USER_ID_CHARS = 256


class AnthropicContentBlock(Strict):
    """One block of a message: each kind needs the fields Anthropic requires of it; images and
    documents are the engine's to check against what the model accepts."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None

    @model_validator(mode="after")
    def _fields_of_kind(self) -> "AnthropicContentBlock":
        needed = {"text": ("text",), "tool_use": ("id", "name", "input"), "tool_result": ("tool_use_id",)}
        missing = [name for name in needed.get(self.type, ()) if getattr(self, name) is None]
        if missing:
            raise ValueError(f"a {self.type} block needs {', '.join(repr(m) for m in missing)}")
        return self


class AnthropicTextBlock(Strict):
    type: Literal["text"]
    text: str


class AnthropicMessage(Strict):
    role: Literal["user", "assistant"]
    content: str | list[AnthropicContentBlock]


class AnthropicTool(Strict):
    """A client tool. Anthropic's server tools (``type: web_search_20250305`` …) need a tool
    server this deployment does not run."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None

    @field_validator("input_schema")
    @classmethod
    def _an_object(cls, schema: dict[str, Any]) -> dict[str, Any]:
        """Anthropic's rule: a tool's input is an object. vLLM would generate arguments of any
        other type, then fail to shape them into a ``tool_use`` block (a 400 after the work)."""
        if schema.get("type") != "object":
            raise ValueError("input_schema must be a JSON schema of type 'object' (a tool's input is an object)")
        return schema


class AnthropicToolChoice(Closed):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_for_tool(self) -> "AnthropicToolChoice":
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice type 'tool' needs a 'name', and only it takes one")
        return self


class AnthropicThinking(Closed):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=MIN_THINKING_BUDGET)
    display: str | None = None

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> "AnthropicThinking":
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("thinking type 'enabled' needs 'budget_tokens'")
        return self


class AnthropicMetadata(Closed):
    user_id: str | None = Field(None, max_length=MAX_USER_ID_CHARS)


class _Prompt(Body):
    """What both routes render: the conversation, its system prompt and tools."""

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[AnthropicTextBlock] | None = None
    tools: list[AnthropicTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None

    @field_validator("tool_choice")
    @classmethod
    def _a_forced_tool_is_one_given(cls, choice: AnthropicToolChoice | None, info: ValidationInfo):
        """``any`` and ``tool`` force a call of the request's tools: without them vLLM would drop
        the choice and answer in text, against what the client asked for."""
        if choice is None or choice.type in ("auto", "none") or "tools" not in info.data:  # tools failed: said
            return choice
        names = {tool.name for tool in info.data["tools"] or ()}
        if not names:
            raise ValueError(f"tool_choice type '{choice.type}' forces a tool call: it needs 'tools'")
        if choice.type == "tool" and choice.name not in names:
            raise FieldError("name", f"tool_choice names {shown(str(choice.name))!r}, which is not one of 'tools'")
        return choice


class MessagesBody(_Prompt):
    max_tokens: int = Field(ge=1)
    stream: bool | None = None
    stop_sequences: StopSequences | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    metadata: AnthropicMetadata | None = None
    # Lower runs first; the router clamps it to the key's tier (docs/api.md, "Priority").
    priority: int | None = Field(None, ge=0, le=INT64)

    @model_validator(mode="after")
    def _budget_under_max_tokens(self) -> "MessagesBody":
        budget = self.thinking.budget_tokens if self.thinking else None
        if budget is not None and budget >= self.max_tokens:
            raise ValueError("thinking.budget_tokens must be less than max_tokens")
        return self

class CountTokensBody(_Prompt):
    pass

"""The strict body of OpenAI's ``POST /v1/responses``.

The same policy as ``request_schema``. Beyond types and ranges, the input items are checked for
what vLLM's Responses layer would get wrong: an item kind it cannot render (``item_reference``,
built-in tool calls) is a 400 naming the item, and an assistant message without content (a 500
inside vLLM) is a 400 too. ``background`` is refused: a background response outlives its
request, and this deployment keeps no request running without its client (docs/api.md). Like
every body, a client's ``request_id`` is refused (``strict.Body``): a Response's id is the server's.
"""

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from serve_app.router.json_body import shown
from serve_app.router.strict import (INT64, MAX_TOOLS, MAX_TOP_LOGPROBS, Body, Closed, FieldError, Metadata, Stop,
                                     Strict)

# OpenAI's limit on a safety identifier; a prompt cache key's is ours (OpenAI states none): both
# are echoed in every response object and stored with it.
MAX_SAFETY_IDENTIFIER_CHARS, MAX_PROMPT_CACHE_KEY_CHARS = 64, 1024

# The input item kinds vLLM's Responses layer renders into a chat.
INPUT_ITEM_TYPES = (
    "message", "function_call", "function_call_output", "reasoning", "custom_tool_call", "custom_tool_call_output",
)


# The content part types of a Responses message: OpenAI's input and output parts.
MESSAGE_PART_TYPES = ("input_text", "input_image", "input_file", "output_text", "refusal")


class ResponsesInputItem(Strict):
    type: str | None = None  # a bare {role, content} is a message
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[dict[str, Any]] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _fields_of_kind(self) -> "ResponsesInputItem":
        kind = self.type or "message"
        if kind not in INPUT_ITEM_TYPES:
            raise ValueError(f"input items of type {kind!r} are not supported here; send {', '.join(INPUT_ITEM_TYPES)}")
        needed = {
            "message": ("role", "content"),
            "function_call": ("call_id", "name", "arguments"),
            "function_call_output": ("call_id", "output"),
        }
        missing = [name for name in needed.get(kind, ()) if getattr(self, name) is None]
        if missing:
            raise ValueError(f"a {kind} item needs {', '.join(repr(m) for m in missing)}")
        if kind == "message" and self.content == []:
            raise ValueError("a message item needs at least one content part")
        if kind == "message" and isinstance(self.content, list):
            for index, part in enumerate(self.content):
                _check_message_part(index, part)
        return self


def _check_message_part(index: int, part: dict[str, Any]) -> None:
    """A message's content part: a type OpenAI's Responses API has, and the text of a text part.
    (What media may be sent is the region's media policy's, ``router/media.py``.)"""
    kind = part.get("type")
    if kind not in MESSAGE_PART_TYPES:
        what = "a content part needs a 'type'"
        if isinstance(kind, str):
            what = f"content parts of type {shown(kind)!r} do not exist"
        raise FieldError(("content", index, "type"), f"{what}: send one of {', '.join(MESSAGE_PART_TYPES)}")
    field = "refusal" if kind == "refusal" else "text" if kind in ("input_text", "output_text") else None
    if field is not None and not isinstance(part.get(field), str):
        raise FieldError(("content", index, field), f"a {kind} part needs a string {field!r}")


class ResponsesFunctionTool(Strict):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesNamedToolChoice(Closed):
    type: Literal["function"]
    name: str


class ResponsesTextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> "ResponsesTextFormat":
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            missing = "name" if self.name is None else "schema"
            raise FieldError(missing, "format type json_schema needs a 'name' and a 'schema'")
        return self


class ResponsesText(Strict):
    format: ResponsesTextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesReasoning(Strict):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesBody(Body):
    model: str
    input: str | list[ResponsesInputItem]
    instructions: str | None = None
    previous_response_id: str | None = Field(None, min_length=1)  # "" names no response: not taken as none
    store: bool | None = None
    stream: bool | None = None
    background: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    stop: Stop | None = None  # a vLLM extra
    tools: list[ResponsesFunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: ResponsesText | None = None
    reasoning: ResponsesReasoning | None = None
    metadata: Metadata | None = None  # stored with the response: OpenAI's limits (strict.py)
    user: str | None = None
    # Echoed in the response (Open Responses requires both fields there). The prompt cache key is
    # no cache partition here: every owner's prompts are cached apart (router/isolation.py).
    safety_identifier: str | None = Field(None, max_length=MAX_SAFETY_IDENTIFIER_CHARS)
    prompt_cache_key: str | None = Field(None, max_length=MAX_PROMPT_CACHE_KEY_CHARS)
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    # Lower runs first; the router clamps it to the key's tier (docs/api.md, "Priority").
    priority: int | None = Field(None, ge=0, le=INT64)
    # vLLM's extension, as on chat: generate to the limit whatever the model says (benchmarks,
    # and the fault suite's full-length streams).
    ignore_eos: bool | None = None

    @model_validator(mode="after")
    def _something_to_answer(self) -> "ResponsesBody":
        if self.input == [] and not self.previous_response_id and not self.instructions:
            raise FieldError("input", "input is empty: give text or items (an empty list only continues a "
                                      "previous_response_id, or answers the instructions alone)")
        return self

    @field_validator("background")
    @classmethod
    def _no_background(cls, background: bool | None) -> bool | None:
        if background:
            raise ValueError("background responses are not supported: a response runs while its client waits")
        return background

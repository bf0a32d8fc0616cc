"""Strict validation of inference bodies at the router, before any token is charged or anything sent.

vLLM's request models coerce (``"max_tokens": "10"`` becomes 10, ``"stream": "yes"`` is true) and
accept roles and values OpenAI refuses, so the router checks the fields of the OpenAI spec, and
the vLLM sampling extras it documents, strictly: types without coercion, the spec's ranges and
enums, ``n`` capped at 128 as OpenAI caps it. A failing field is named in ``param`` with its path
(``messages[0].role``). Fields not listed here pass through unchanged: vLLM validates its own
extras, and refusing them would break clients that use them.

The models only validate; the body the router forwards is the dict it parsed (no re-encode). The
same models are published as the request bodies of ``/openapi.json``, so contract fuzzers test
what the router enforces. The parse itself (``parse_json_object``, re-exported here for the
routes) is ``json_body``'s.
"""

import functools
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from serve_app.errors import APIError
from serve_app.router.json_body import MAX_JSON_DEPTH, parse_json_object  # noqa: F401 (the routes' import)
from serve_app.router.strict import INT64, MAX_TOOLS, MAX_TOP_LOGPROBS, Body, FieldError, Metadata, Stop
from serve_app.router.strict import Closed as _Closed
from serve_app.router.strict import Strict as _Strict

# OpenAI's cap on choices per request.
MAX_N = 128
_INT64 = INT64


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(_Strict):
    """One part of a message's content: ``text`` needs its text; other kinds (images, audio,
    files) are the engine's to check against what the model accepts."""

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_has_text(self) -> "ContentPart":
        if self.type == "text" and self.text is None:
            raise ValueError("a text content part needs a string 'text'")
        return self


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_where_required(self) -> "Message":
        if self.content is None and self.role not in ("assistant", "function"):
            raise ValueError(f"a {self.role} message needs 'content'")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the 'tool_call_id' it answers")
        return self


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Closed):
    name: str


class NamedToolChoice(_Closed):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise FieldError("json_schema", "type json_schema needs a 'json_schema' object")
        return self


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _Sampling(Body):
    """Fields chat and completions share. ``model`` is resolved (aliases) by the router itself."""

    model: str
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=-_INT64 - 1, le=_INT64)
    stop: Stop | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's sampling extras (docs/api.md, "Sampling").
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    # Lower runs first; the router clamps it to the key's tier (docs/api.md, "Priority").
    priority: int | None = Field(None, ge=0, le=_INT64)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_range(cls, logit_bias: dict[str, float] | None) -> dict[str, float] | None:
        if logit_bias and any(not -100 <= bias <= 100 for bias in logit_bias.values()):
            raise ValueError("logit_bias values must be between -100 and 100")
        return logit_bias

    @model_validator(mode="after")
    def _min_tokens_within_the_limit(self) -> "_Sampling":
        # vLLM's limit: max_completion_tokens where the body has it and it is given (chat), else
        # max_tokens. (Completions has no such field: a client's extra of that name is not read.)
        field = "max_tokens"
        if "max_completion_tokens" in type(self).model_fields and getattr(self, "max_completion_tokens") is not None:
            field = "max_completion_tokens"
        limit = getattr(self, field)
        if self.min_tokens is not None and limit is not None and self.min_tokens > limit:
            raise FieldError("min_tokens", f"min_tokens ({self.min_tokens}) cannot exceed {field} ({limit})")
        return self


class ChatCompletionBody(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    metadata: Metadata | None = None  # OpenAI's chat takes it (vLLM ignores it): OpenAI's limits
    enable_thinking: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# A completions prompt: text, texts, token ids or lists of them; no list empty (vLLM would divide
# the request into no prompt at all), no token id negative (as embeddings and /detokenize).
_TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
_Prompt = str | Annotated[list[str], Field(min_length=1)] | _TokenIds | Annotated[list[_TokenIds], Field(min_length=1)]


class CompletionBody(_Sampling):
    prompt: _Prompt
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: score the prompt only
    suffix: str | None = None
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("prompt", mode="before")
    @classmethod
    def _no_empty_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and (not prompt or any(isinstance(entry, list) and not entry for entry in prompt)):
            raise ValueError("an empty list is no prompt: give text, texts, token ids or lists of token ids, "
                             "none empty")
        return prompt


# Fields of /tokenize that only mean something with `messages` (they shape the chat template).
_CHAT_TOKENIZE_FIELDS = (
    "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools", "enable_thinking",
)


class TokenizeBody(Body):
    """``POST /tokenize``: ``prompt`` (text, as completions sees it) or ``messages`` (rendered
    with the chat template, as chat sees it), never both. vLLM's own request models."""

    model: str
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    enable_thinking: bool | None = None

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> "TokenizeBody":
        if self.prompt is None and self.messages is None:  # no one field to name
            raise ValueError("give either 'prompt' (text) or 'messages' (a chat)")
        if self.prompt is not None and self.messages is not None:
            raise FieldError("messages", "give either 'prompt' (text) or 'messages' (a chat), not both")
        if self.prompt is not None:
            stray = [name for name in _CHAT_TOKENIZE_FIELDS if getattr(self, name) is not None]
            if stray:
                raise FieldError(stray[0], f"only with 'messages', not with 'prompt': {', '.join(stray)}")
        if self.add_generation_prompt and self.continue_final_message:
            raise FieldError("continue_final_message",
                             "add_generation_prompt and continue_final_message cannot both be true")
        return self


class DetokenizeBody(Body):
    """``POST /detokenize``: token ids back to text."""

    model: str
    tokens: list[Annotated[int, Field(ge=0, le=_INT64)]]


def _bodies() -> tuple[type[BaseModel], ...]:
    """Every surface's body model, from its row (``serve_app/surfaces``, which imports this
    module's bodies: read when first needed, not at import)."""
    from serve_app.surfaces import SURFACES

    return tuple(surface.body for surface in SURFACES)


def validate_body(method: str, body: dict[str, Any]) -> None:
    """400 with ``param`` naming the first failing field (every problem listed, up to five);
    ``method``: the surface whose body model it must be."""
    from serve_app.surfaces import BY_NAME

    try:
        BY_NAME[method].body.model_validate(body)
    except ValidationError as err:
        raise describe_validation_errors(err.errors(include_url=False, include_input=False)) from None


def describe_validation_errors(errors: list[dict[str, Any]]) -> APIError:
    """Pydantic's errors as one 400: each problem with its path, the first one's in ``param``."""
    errors = _without_branch_noise(errors)
    details = "; ".join(f"{_param_of(e) or 'body'}: {_message(e)}" for e in errors[:5])
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return APIError(400, f"invalid request: {details}{more}", param=_param_of(errors[0]))


def _param_of(error: dict[str, Any]) -> str | None:
    """The error's field path; a ``FieldError`` of a check across fields adds the path it names."""
    param = _param(error["loc"], error["type"]) or ""
    named = (error.get("ctx") or {}).get("error")
    for part in named.path if isinstance(named, FieldError) else ():
        param += f"[{part}]" if isinstance(part, int) else f".{part}" if param else part
    return param or None


def _without_branch_noise(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop a union's "not this branch" errors when another branch says what is wrong inside:
    ``content: [{"type": "text"}]`` fails as "not a string" and as "text part without text";
    only the second helps."""
    params = [_param(e["loc"]) or "" for e in errors]

    def noise(error: dict[str, Any], param: str) -> bool:
        mismatch = error["type"].endswith("_type") or error["type"] == "literal_error"
        return mismatch and any(other.startswith(param) and other != param for other in params)

    kept = [e for e, param in zip(errors, params) if not noise(e, param)]
    return kept or errors


@functools.cache
def _field_names() -> frozenset[str]:
    """Every field name any surface's body (or a model inside one) has."""
    names: set[str] = set()
    pending: list[type[BaseModel]] = list(_bodies())
    while pending:
        model = pending.pop()
        for name, field in model.model_fields.items():
            names.add(field.alias or name)
            for kind in (field.annotation, *getattr(field.annotation, "__args__", ())):
                for inner in (kind, *getattr(kind, "__args__", ())):
                    if isinstance(inner, type) and issubclass(inner, BaseModel) and inner not in pending:
                        pending.append(inner)
    return frozenset(names)


def _param(loc: tuple, error_type: str = "") -> str | None:
    """``('messages', 0, 'role')`` → ``messages[0].role``; pydantic's union-branch markers
    (``str``, ``list[ContentPart]``, ``literal['none','auto']``) are dropped. A top-level field
    that a closed body does not define (``extra_forbidden``) is named as sent."""
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in _field_names() or (error_type == "extra_forbidden" and len(loc) == 1):
            param += f".{part}" if param else part
    return param or None


def _message(error: dict[str, Any]) -> str:
    return error["msg"].removeprefix("Value error, ")

"""The pydantic bases and shared limits every request schema of the router builds on
(``request_schema``, ``messages_schema``, ``responses_schema``)."""

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

# OpenAI's own caps: tools per request, top logprobs.
MAX_TOOLS = 128
MAX_TOP_LOGPROBS = 20  # also vLLM's default --max-logprobs
INT64 = 2**63 - 1
# vLLM's VLLM_MAX_STOP_STRINGS: a fifth stop sequence is a validation error deep in the engine,
# after the request was admitted and queued (a region cannot change it: ``config.model.Resources``).
MAX_STOP_SEQUENCES = 4


def _no_empty_stop(stop: str | list[str]) -> str | list[str]:
    if stop == "" or (isinstance(stop, list) and "" in stop):
        raise ValueError("a stop sequence cannot be empty (it would end the answer before it starts)")
    return stop


# ``stop`` of chat, completions and Responses (a vLLM extra there), and Messages' ``stop_sequences``:
# what vLLM takes, checked before the request is charged.
StopSequences = Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES), AfterValidator(_no_empty_stop)]
Stop = Annotated[str, AfterValidator(_no_empty_stop)] | StopSequences
# OpenAI's limits on ``metadata`` (Responses, chat): pairs, and characters per key and per value.
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512


class FieldError(ValueError):
    """A check across fields (a model validator) that names the field the client should change:
    the 400's ``param`` is that field, under the object checked (``describe_validation_errors``);
    ``field`` a name, or a path into the object (``("content", 0, "text")``)."""

    def __init__(self, field: str | tuple[str | int, ...], message: str):
        super().__init__(message)
        self.path = field if isinstance(field, tuple) else (field,)


class Strict(BaseModel):
    """Types without coercion; fields the schema does not list pass through to the engine."""

    model_config = ConfigDict(strict=True, extra="allow")


class Closed(BaseModel):
    """Small objects whose every field the spec defines."""

    model_config = ConfigDict(strict=True, extra="forbid")


# Body fields the router sets itself, with why a client's value is refused (never overwritten in
# silence). Published as "never valid", so contract fuzzers expect the 400.
SERVER_FIELDS = {
    # router/isolation.py: each owner's prompts are cached apart from every other owner's.
    "cache_salt": "set by the server, not the client: each owner's prompts are cached apart from every "
    "other owner's (docs/api.md, \"Prompt caching\"); remove the field",
    # vLLM takes it on chat, completions and Responses as the engine's request id, and a Response's
    # id is that id: a client choosing it could collide with another owner's stored response.
    "request_id": "request ids are made by the server, never by the client; to follow a request, send a "
    "W3C traceparent header (its trace id comes back in pg_metadata)",
}
_ServerSet = Annotated[Any, WithJsonSchema({"not": {}, "description": "Set by the server; refused from clients."})]


def _no_default(schema: dict[str, Any]) -> None:
    schema.pop("default", None)


class Body(Strict):
    """A whole request body, on every route: the fields the server sets are refused from clients,
    one rule for every body, so no route is the exception."""

    cache_salt: _ServerSet = Field(None, exclude=True, json_schema_extra=_no_default)
    request_id: _ServerSet = Field(None, exclude=True, json_schema_extra=_no_default)

    @field_validator(*SERVER_FIELDS, mode="before")
    @classmethod
    def _set_by_the_server(cls, value: Any, info) -> Any:
        # Runs only when the client sent the field (defaults are not validated).
        raise ValueError(SERVER_FIELDS[info.field_name])


def _openai_metadata(metadata: dict[str, str]) -> dict[str, str]:
    """OpenAI's limits, with a message naming what broke them. Keys and values must be valid
    Unicode too: a lone surrogate cannot be encoded for the store or the response."""
    if len(metadata) > MAX_METADATA_PAIRS:
        raise ValueError(f"at most {MAX_METADATA_PAIRS} key-value pairs, not {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise ValueError(f"key {key[:16]!r}… has {len(key)} characters; at most {MAX_METADATA_KEY_CHARS}")
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise ValueError(f"the value of {key!r} has {len(value)} characters; at most {MAX_METADATA_VALUE_CHARS}")
        try:
            key.encode(), value.encode()
        except UnicodeEncodeError:
            raise ValueError(f"key {key!r} or its value is not valid Unicode (a lone surrogate)") from None
    return metadata


Metadata = Annotated[
    dict[str, str],
    AfterValidator(_openai_metadata),
    WithJsonSchema({
        "type": "object",
        "maxProperties": MAX_METADATA_PAIRS,
        "propertyNames": {"maxLength": MAX_METADATA_KEY_CHARS},
        "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE_CHARS},
    }),
]

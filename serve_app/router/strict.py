"""The pydantic bases and shared limits every request schema of the router builds on
(``request_schema``, ``messages_schema``, ``responses_schema``)."""

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

# OpenAI's own caps: tools per request, top logprobs.
MAX_TOOLS = 128
MAX_TOP_LOGPROBS = 20  # also vLLM's default --max-logprobs
INT64 = 2**63 - 1


class Strict(BaseModel):
    """Types without coercion; fields the schema does not list pass through to the engine."""

    model_config = ConfigDict(strict=True, extra="allow")


class Closed(BaseModel):
    """Small objects whose every field the spec defines."""

    model_config = ConfigDict(strict=True, extra="forbid")


# Body fields the router sets itself (router/isolation.py): a client's value is refused, never
# overwritten in silence. Published as "never valid", so contract fuzzers expect the 400.
SERVER_FIELDS = ("cache_salt",)
_ServerSet = Annotated[Any, WithJsonSchema({"not": {}, "description": "Set by the server; refused from clients."})]


class Body(Strict):
    """The top level of a request body."""

    cache_salt: _ServerSet = Field(None, exclude=True, json_schema_extra=lambda schema: schema.pop("default"))

    @field_validator(*SERVER_FIELDS, mode="before")
    @classmethod
    def _set_by_the_server(cls, value: Any) -> Any:
        # Runs only when the client sent the field (defaults are not validated).
        raise ValueError(
            "set by the server, not the client: each owner's prompts are cached apart from every "
            "other owner's (docs/api.md, \"Prompt caching\"); remove the field"
        )

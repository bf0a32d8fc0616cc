"""The pydantic bases and shared limits every request schema of the router builds on
(``request_schema``, ``messages_schema``, ``responses_schema``)."""

from pydantic import BaseModel, ConfigDict

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

"""The strict body of ``POST /v1/embeddings``: OpenAI's ``CreateEmbeddingRequest``.

OpenAI's schema is closed (``additionalProperties: false``) and so is this one: a field OpenAI
does not define is a 400 naming it, where vLLM's own request model would take it — `messages`
(a chat to embed), `encoding_format: bytes` (a binary body), `use_activation` (vectors left
unnormalised), a client's chat template. Two vLLM fields are kept, documented in docs/api.md:
``priority`` (lower only, as on every route: the router clamps it to the key's tier) and
``truncate_prompt_tokens`` (embed only the first N tokens of each input — vLLM truncates a pooling
model's inputs on the right — instead of a 400 for an input longer than the model's context).

OpenAI's rules, each a 400 with ``param`` ``input`` and a message naming the entry: ``input`` is
a string, a list of strings, a list of token ids or a list of token-id lists (never a mix); no
string is empty, no list is empty or longer than 2048 entries; token ids are non-negative
integers (the engine refuses one its vocabulary lacks), at most 300,000 of them in one request
(OpenAI's cap on a request's tokens; text, which only the tokenizer can count, is held to it by
the replica: ``engine/rendered.install_request_cap``). ``encoding_format`` is ``float`` or ``base64``;
``dimensions`` a positive integer (the engine refuses it for a model that cannot shorten its
vectors, or past the model's size).
"""

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, WithJsonSchema, field_validator

from serve_app.errors import APIError
from serve_app.router.strict import INT64, Body

MAX_INPUTS = 2048  # OpenAI: "any array must be 2048 dimensions or less"
MAX_REQUEST_TOKENS = 300_000  # OpenAI: summed across all inputs of one request

_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
_INPUT_SCHEMA = {
    "oneOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS, "items": {"type": "string", "minLength": 1}},
        {**_TOKEN_IDS, "maxItems": MAX_INPUTS},
        {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS, "items": _TOKEN_IDS},
    ]
}
_SHAPE = "a non-empty string, or a list of strings, of token ids or of token-id lists"


class EmbeddingsBody(Body):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    input: Annotated[Any, WithJsonSchema(_INPUT_SCHEMA)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=INT64)
    user: str | None = None
    # vLLM's, kept (docs/api.md, "Embeddings").
    priority: int | None = Field(None, ge=0, le=INT64)
    truncate_prompt_tokens: int | None = Field(None, ge=1, le=INT64)

    @field_validator("input", mode="before")
    @classmethod
    def _openai_input(cls, value: Any) -> Any:
        check_input(value)
        return value


def check_input(value: Any) -> None:
    """ValueError naming the first entry of ``value`` that OpenAI's ``input`` rules refuse."""
    if isinstance(value, str):
        if not value:
            raise ValueError("an empty string has no embedding")
        return
    if not isinstance(value, list) or not value:
        raise ValueError(f"must be {_SHAPE}")
    if len(value) > MAX_INPUTS:
        if _is_token_id(value[0]):  # one input: a list of token ids, held to the same length
            raise ValueError(f"{len(value)} token ids in one input; at most {MAX_INPUTS} in a list of token ids")
        raise ValueError(f"{len(value)} inputs; at most {MAX_INPUTS} in one request")
    first = value[0]
    for index, entry in enumerate(value):
        if _is_token_id(first):
            _check_token_id(entry, f"entry {index}")
        elif isinstance(first, str):
            if not isinstance(entry, str):
                raise ValueError(f"entry {index}: every entry of a list of strings is a string")
            if not entry:
                raise ValueError(f"entry {index} is an empty string, which has no embedding")
        elif isinstance(first, list):
            if not isinstance(entry, list) or not entry:
                raise ValueError(f"entry {index}: every entry of a list of token-id lists is a non-empty list")
            for position, token in enumerate(entry):
                _check_token_id(token, f"entry {index}, token {position}")
        else:
            raise ValueError(f"entry {index}: input must be {_SHAPE}")
    if (ids := token_ids_in(value)) > MAX_REQUEST_TOKENS:
        raise ValueError(f"{ids} token ids in one request; at most {MAX_REQUEST_TOKENS} across all inputs")


def beyond_the_model(body: dict[str, Any], *, context_len: int, dimensions: int | None) -> APIError | None:
    """What the engine refuses of a valid body only once the request is admitted (vLLM's
    ``_validate_request``; its dimensions check), refused before that, naming the field: a
    ``truncate_prompt_tokens`` past the model's context, ``dimensions`` past its vector size
    (``dimensions``: the catalog's; None: not known here, the engine decides)."""
    truncate = body.get("truncate_prompt_tokens")
    if isinstance(truncate, int) and truncate > context_len:
        return APIError(400, f"truncate_prompt_tokens is {truncate}, past the model's context of {context_len} tokens",
                        param="truncate_prompt_tokens")
    asked = body.get("dimensions")
    if dimensions is not None and isinstance(asked, int) and asked > dimensions:
        return APIError(400, f"dimensions is {asked}, past the model's {dimensions}; it may only shorten the vectors",
                        param="dimensions")
    return None


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_token_id(value: Any, where: str) -> None:
    if not _is_token_id(value) or not 0 <= value <= INT64:
        raise ValueError(f"{where}: a token id is a non-negative integer, not {str(value)[:40]!r}")


def token_ids_in(value: Any) -> int:
    """How many token ids an ``input`` carries (0 for text): exact, so it prices the prompt."""
    if not isinstance(value, list) or not value:
        return 0
    if _is_token_id(value[0]):
        return len(value)
    return sum(len(entry) for entry in value if isinstance(entry, list))

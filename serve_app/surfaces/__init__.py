"""The API surfaces: one row of plain data per endpoint that runs on a model replica.

A *surface* is one such endpoint — chat, completions, Responses, Messages, count_tokens,
embeddings, tokenize, detokenize. Its row says everything that differs between them, and the
router (its pipeline, its OpenAPI document), the replica (its methods) and the telemetry (route,
operation name) all read it here:

- ``name``: the surface, and the replica method the router calls for it;
- ``route``: the HTTP path; ``body``: the strict body model the router validates with;
- ``dialect``: the API it speaks (``dialects.py``): how its errors look, how a stream ends,
  whether Anthropic's ``x-api-key`` is a credential;
- ``task``: what the model must do to serve it (``catalog.CatalogModel.task``, vLLM's task
  names): ``generate`` or ``embed``; None: any model (tokenizing). A model of another task is a
  400 naming ``model``;
- ``limit``: for a surface that generates, the completion limit its vLLM request model obeys
  (``Limit``): the one field the router prices, writes and refuses the others for
  (``router/pricing.py``); ``generates`` is whether it has one. A surface without one is priced
  by its prompt alone;
- ``billed``: the engine computes for it (generation, or embeddings), for the caller: its price
  is held against the key's token budget, its usage recorded in the ledger, with the tier's
  priority and the owner's prefix-cache salt, and a non-stream request is under way on the
  replica before its answer (its socket is the hang-up line: a client that leaves is billed
  what the engine did); else (counting tokens) only the rate limit charges it;
- ``stores``: Responses: ``previous_response_id`` continues a stored conversation, and the
  answer is stored;
- ``streams``: it may answer with a stream (``"stream": true``);
- ``operation``: OpenTelemetry's ``gen_ai.operation.name`` (GenAI semantic conventions;
  Responses and Messages are chats in their terms: a conversation in, a turn out);
- ``chunk_object``: the ``object`` of its stream chunks (what the openai SDK's chunk types expect);
- ``counts``: a counting surface's answer field that holds the tokens the engine counted: what
  its price estimated from size is reconciled with (the key's rate limit is charged the rest).

Adding a surface is its row here, its body model and its vLLM call (``engine/vllm_engine.py``):
the router's route is made from the row (``router/ingress.py``).
"""

from dataclasses import dataclass

from pydantic import BaseModel

from serve_app.router.embeddings_schema import EmbeddingsBody
from serve_app.router.messages_schema import CountTokensBody, MessagesBody
from serve_app.router.request_schema import ChatCompletionBody, CompletionBody, DetokenizeBody, TokenizeBody
from serve_app.router.responses_schema import ResponsesBody
from serve_app.surfaces import dialects
from serve_app.surfaces.dialects import Dialect


# /v1/completions without max_tokens: OpenAI's documented default, and vLLM's
# (CompletionRequest.max_tokens = 16). Kept, so the route means what clients expect of it.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class Limit:
    """The completion limit a generating surface's vLLM request model obeys (vLLM 0.32;
    ``tests/unit/test_pricing.py`` checks each against vLLM's own models)."""

    field: str  # the field the engine obeys, and the one the router writes
    also_read: str | None = None  # chat's deprecated max_tokens: read when ``field`` is unset
    default_cap: int | None = None  # the route's own default limit, below the model's


@dataclass(frozen=True)
class Surface:
    name: str
    route: str
    body: type[BaseModel]
    dialect: Dialect
    operation: str
    task: str | None = "generate"
    limit: Limit | None = None
    billed: bool = True
    stores: bool = False
    streams: bool = True
    chunk_object: str = "chat.completion.chunk"
    counts: str | None = None
    prompt: str = "messages"  # the field its input is in (``/tokenize``: or ``messages``)

    @property
    def generates(self) -> bool:
        return self.limit is not None

    def size_param(self, body: dict) -> str:
        """The field to name when a request is too big for its key's tier (``param``): the
        completion limit as the client set it, for a surface that generates; else its input."""
        if self.limit is None:
            return "messages" if self.name == "tokenize" and "messages" in body else self.prompt
        also = self.limit.also_read
        return also if also is not None and also in body and self.limit.field not in body else self.limit.field

    def __str__(self) -> str:
        return self.name


CHAT = Surface(
    "chat", "/v1/chat/completions", ChatCompletionBody, dialects.OPENAI, "chat",
    limit=Limit("max_completion_tokens", also_read="max_tokens"),
)
COMPLETIONS = Surface(
    "completions", "/v1/completions", CompletionBody, dialects.OPENAI, "text_completion",
    limit=Limit("max_tokens", default_cap=COMPLETIONS_DEFAULT_MAX_TOKENS), chunk_object="text_completion",
    prompt="prompt",
)
RESPONSES = Surface(
    "responses", "/v1/responses", ResponsesBody, dialects.RESPONSES, "chat", limit=Limit("max_output_tokens"),
    stores=True, prompt="input",
)
MESSAGES = Surface("messages", "/v1/messages", MessagesBody, dialects.ANTHROPIC, "chat", limit=Limit("max_tokens"))
COUNT_TOKENS = Surface(
    "count_tokens", "/v1/messages/count_tokens", CountTokensBody, dialects.ANTHROPIC, "count_tokens",
    billed=False, streams=False, counts="input_tokens",
)
# Embeddings generate nothing, but the engine computes them: billed by their input tokens.
EMBEDDINGS = Surface(
    "embeddings", "/v1/embeddings", EmbeddingsBody, dialects.OPENAI, "embeddings", task="embed",
    streams=False, prompt="input",
)
TOKENIZE = Surface(
    "tokenize", "/tokenize", TokenizeBody, dialects.OPENAI, "tokenize", task=None, billed=False, streams=False,
    counts="count", prompt="prompt",
)
DETOKENIZE = Surface(
    "detokenize", "/detokenize", DetokenizeBody, dialects.OPENAI, "detokenize", task=None, billed=False,
    streams=False, prompt="tokens",
)

SURFACES: tuple[Surface, ...] = (
    CHAT, COMPLETIONS, RESPONSES, MESSAGES, COUNT_TOKENS, EMBEDDINGS, TOKENIZE, DETOKENIZE,
)
BY_NAME: dict[str, Surface] = {surface.name: surface for surface in SURFACES}
BY_ROUTE: dict[str, Surface] = {surface.route: surface for surface in SURFACES}

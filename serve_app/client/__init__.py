"""A Python client for this server: ``await AsyncClient.create(api_key=..., base_url=...)``.

Importing it needs only httpx and pydantic (``pip install serve_app[client]``'s two packages): it
imports nothing from the server side of this package (Ray, vLLM, the router), so it installs on a
laptop. Usage, auth, retries, failover and timing: docs/client.md.
"""

from serve_app.client.client import AsyncClient, PolarGrid
from serve_app.client.errors import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    InternalServerError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    RequestTooLargeError,
    ServeAppError,
    ServiceUnavailableError,
)
from serve_app.client.streams import AsyncStream
from serve_app.client.sync import Client, Stream
from serve_app.client.timing import ServerTiming
from serve_app.client.types import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    CreateEmbeddingResponse,
    Embedding,
    Message,
    MessageStreamEvent,
    MessageTokensCount,
    Model,
    ModelList,
    Response,
    ResponseDeleted,
    ResponseStreamEvent,
)

__all__ = [
    "APIConnectionError",
    "APIStatusError",
    "APITimeoutError",
    "AsyncClient",
    "AsyncStream",
    "AuthenticationError",
    "BadRequestError",
    "ChatCompletion",
    "ChatCompletionChunk",
    "Client",
    "Completion",
    "CompletionChunk",
    "CreateEmbeddingResponse",
    "Embedding",
    "InternalServerError",
    "Message",
    "MessageStreamEvent",
    "MessageTokensCount",
    "Model",
    "ModelList",
    "NotFoundError",
    "PermissionDeniedError",
    "PolarGrid",
    "RateLimitError",
    "RequestTooLargeError",
    "Response",
    "ResponseDeleted",
    "ResponseStreamEvent",
    "ServeAppError",
    "ServerTiming",
    "ServiceUnavailableError",
    "Stream",
]

"""``AsyncClient``: the model card's client (``PolarGrid.create(api_key=...)``) for this server.

    client = await AsyncClient.create(api_key="pgk_...", base_url="http://127.0.0.1:8000")
    async for chunk in client.chat_completion_stream({"model": "qwen-3.6-35b-a3b", "messages": [...]}):
        print(chunk.choices[0].delta.content or "", end="")

Each call takes the request as a dict (as in the model card), as keyword arguments, or both
(keywords win). The body is sent as given — any field vLLM accepts passes through — except
``stream``, which the method decides. Three keywords are the client's, never sent in the body:
``timeout`` (this call's httpx timeout), ``traceparent`` (join the caller's own trace) and
``extra_headers``.

Served surfaces: chat completions, completions, embeddings (``client.embeddings.create``,
``embeddings.py``), models; OpenAI's Responses API as ``client.responses`` (create, stream,
retrieve, delete) and Anthropic's Messages API as ``client.messages`` (create, stream,
count_tokens), in ``resources.py`` (docs/client.md).
"""

import os
from typing import Any
from urllib.parse import quote

import httpx

from serve_app.client import resources
from serve_app.client.auth import DEFAULT_REFRESH_MARGIN_S, Auth
from serve_app.client.embeddings import AsyncEmbeddings
from serve_app.client.calls import Calls
from serve_app.client.streams import AsyncStream
from serve_app.client.transport import (
    DEFAULT_LIMITS,
    DEFAULT_STREAM_READ_TIMEOUT_S,
    DEFAULT_TIMEOUT,
    RetryPolicy,
    Transport,
    json_object,
)
from serve_app.client import types

API_KEY_ENV, BASE_URL_ENV = "SERVE_APP_API_KEY", "SERVE_APP_BASE_URL"
DEFAULT_BASE_URL = "http://127.0.0.1:8000"  # `make run`
CHAT_PATH, COMPLETIONS_PATH, MODELS_PATH = "/v1/chat/completions", "/v1/completions", "/v1/models"


def _base_urls(base_url: str | None, base_urls: list[str] | None) -> list[str]:
    if base_url and base_urls:
        raise ValueError("pass base_url or base_urls, not both")
    if base_urls:
        return list(base_urls)
    if base_url:
        return [base_url]
    from_env = [u for u in os.environ.get(BASE_URL_ENV, "").split(",") if u.strip()]
    return from_env or [DEFAULT_BASE_URL]


class AsyncClient:
    """One connection pool, one credential, one or more regions. See the module docstring."""

    def __init__(
        self,
        api_key: str | None = None,
        *,
        base_url: str | None = None,
        base_urls: list[str] | None = None,
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        max_retries: int = 2,
        max_retry_time_s: float = 30.0,
        region_hold_s: float = 30.0,
        refresh_margin_s: float = DEFAULT_REFRESH_MARGIN_S,
        trace_sample_ratio: float = 0.1,
        http_transport: httpx.AsyncBaseTransport | None = None,
        stream_read_timeout_s: float | None = DEFAULT_STREAM_READ_TIMEOUT_S,
        limits: httpx.Limits = DEFAULT_LIMITS,
    ):
        """No network here: the token is minted on the first request. ``create`` mints it at once."""
        api_key = api_key or os.environ.get(API_KEY_ENV)
        if not api_key:
            raise ValueError(f"pass api_key or set {API_KEY_ENV}")
        self._auth = Auth(api_key, refresh_margin_s=refresh_margin_s)
        self._transport = Transport(
            _base_urls(base_url, base_urls),
            self._auth,
            timeout=timeout,
            retry=RetryPolicy(max_retries=max_retries, max_retry_time_s=max_retry_time_s, region_hold_s=region_hold_s),
            trace_sample_ratio=trace_sample_ratio,
            http_transport=http_transport,
            stream_read_timeout_s=stream_read_timeout_s,
            limits=limits,
        )
        self._calls = Calls(self._transport)
        self.responses = resources.Responses(self._calls)
        self.messages = resources.Messages(self._calls)
        self.embeddings = AsyncEmbeddings(self._calls)

    @classmethod
    async def create(cls, api_key: str | None = None, **options: Any) -> "AsyncClient":
        """A client whose API key has been exchanged for a token (or found to need none): a wrong
        key or an unreachable server fails here, not on the first completion."""
        client = cls(api_key, **options)
        try:
            await client._auth.ensure(client._transport.exchange)
        except BaseException:
            await client.close()
            raise
        return client

    def __repr__(self) -> str:
        return f"AsyncClient(base_urls={self.base_urls!r}, auth_mode={self.auth_mode!r})"

    @property
    def base_urls(self) -> list[str]:
        return list(self._transport.base_urls)

    @property
    def auth_mode(self) -> str | None:
        """``"token"`` (a minted JWT is sent), ``"api_key"`` (the fallback) or None (not decided yet)."""
        return self._auth.mode

    @property
    def token_expires_in(self) -> float | None:
        """Seconds left on the current token by this client's clock (None without a token)."""
        return self._auth.expires_in()

    # --- the API -------------------------------------------------------------------------------
    async def chat_completion(self, request: dict[str, Any] | None = None, /, **params: Any) -> types.ChatCompletion:
        return await self._calls.create(CHAT_PATH, types.ChatCompletion, request, params)

    def chat_completion_stream(
        self, request: dict[str, Any] | None = None, /, **params: Any
    ) -> AsyncStream[types.ChatCompletionChunk]:
        return self._calls.stream(CHAT_PATH, types.ChatCompletionChunk, request, params)

    async def completion(self, request: dict[str, Any] | None = None, /, **params: Any) -> types.Completion:
        return await self._calls.create(COMPLETIONS_PATH, types.Completion, request, params)

    def completion_stream(self, request: dict[str, Any] | None = None, /, **params: Any) -> AsyncStream[types.CompletionChunk]:
        return self._calls.stream(COMPLETIONS_PATH, types.CompletionChunk, request, params)

    async def models(self, *, timeout: httpx.Timeout | float | None = None) -> types.ModelList:
        """The models this region serves that the caller may use, with their hot-load state."""
        sent = await self._transport.send("GET", MODELS_PATH, timeout=timeout)
        return types.ModelList.model_validate(json_object(sent.response))

    async def model(self, name: str, *, timeout: httpx.Timeout | float | None = None) -> types.Model:
        """One model card; ``name`` may be an alias or the HF repo id (``Qwen/...``)."""
        sent = await self._transport.send("GET", f"{MODELS_PATH}/{quote(name, safe='/')}", timeout=timeout)
        return types.Model.model_validate(json_object(sent.response))

    async def close(self) -> None:
        """Close open streams and the connection pool."""
        await self._calls.close_streams()
        await self._auth.aclose()
        await self._transport.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# The model card's name for it: ``client = await PolarGrid.create(api_key="pg_...")``.
PolarGrid = AsyncClient

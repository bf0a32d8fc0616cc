"""The client's API groups beside chat: ``client.responses`` and ``client.messages``, named as the
openai and anthropic SDKs name them, each method one route of the server.

Each is a thin layer over the client's ``Calls`` (``calls.py``: ``create``, ``stream``,
``fetch``), so a call here is authenticated, retried, failed over and timed exactly as
``chat_completion`` is (``transport.py``); only the route, the result type and, for a stream, how
it ends (``streams.Protocol``) differ. Another group is one more class here and one attribute on
the client (and its sync twin, ``sync.py``).
"""

from typing import Any
from urllib.parse import quote

import httpx

from serve_app.client import streams, types
from serve_app.client.calls import Calls
from serve_app.client.streams import AsyncStream

RESPONSES_PATH = "/v1/responses"
MESSAGES_PATH, COUNT_TOKENS_PATH = "/v1/messages", "/v1/messages/count_tokens"

Timeout = httpx.Timeout | float | None


class Responses:
    """OpenAI's Responses API. ``stream`` yields ``ResponseStreamEvent``s up to the terminal one
    (``response.completed`` / ``.incomplete`` / ``.failed``); then ``stream.response`` is the final
    ``Response`` and ``stream.timing`` the server's timing."""

    def __init__(self, calls: Calls):
        self._calls = calls

    async def create(self, request: dict[str, Any] | None = None, /, **params: Any) -> types.Response:
        return await self._calls.create(RESPONSES_PATH, types.Response, request, params)

    def stream(self, request: dict[str, Any] | None = None, /, **params: Any) -> AsyncStream[types.ResponseStreamEvent]:
        return self._calls.stream(RESPONSES_PATH, types.ResponseStreamEvent, request, params, streams.RESPONSES)

    async def retrieve(self, response_id: str, *, timeout: Timeout = None) -> types.Response:
        """A stored response (``store`` was not false), the caller's own only."""
        return await self._calls.fetch("GET", _stored(response_id), types.Response, timeout=timeout)

    async def delete(self, response_id: str, *, timeout: Timeout = None) -> types.ResponseDeleted:
        return await self._calls.fetch("DELETE", _stored(response_id), types.ResponseDeleted, timeout=timeout)


class Messages:
    """Anthropic's Messages API. ``stream`` yields ``MessageStreamEvent``s up to ``message_stop``;
    then ``stream.timing`` is the server's timing."""

    def __init__(self, calls: Calls):
        self._calls = calls

    async def create(self, request: dict[str, Any] | None = None, /, **params: Any) -> types.Message:
        return await self._calls.create(MESSAGES_PATH, types.Message, request, params)

    def stream(self, request: dict[str, Any] | None = None, /, **params: Any) -> AsyncStream[types.MessageStreamEvent]:
        return self._calls.stream(MESSAGES_PATH, types.MessageStreamEvent, request, params, streams.MESSAGES)

    async def count_tokens(self, request: dict[str, Any] | None = None, /, **params: Any) -> types.MessageTokensCount:
        """The prompt's tokens as ``create`` would render it; nothing is generated."""
        return await self._calls.create(COUNT_TOKENS_PATH, types.MessageTokensCount, request, params)


def _stored(response_id: str) -> str:
    return f"{RESPONSES_PATH}/{quote(response_id, safe='')}"

"""The seam between the model replica (``deployment.ModelServer``: Serve, the wire, the byte
socket) and the engine that answers requests (``vllm_engine.VLLMEngine``; a fake in the unit
tests). Nothing here imports vLLM.

An engine takes one request — its surface's name (``serve_app/surfaces``) and the router's
``wire.Call`` — and answers with:

- an ``Answer`` (``wire/messages.py``): a whole JSON body with its status (a non-stream success,
  or any error the engine reports before a stream starts), and for a success its ``trailer``
  (engine timing, usage, finish reasons; the replica adds its own tag and the token count);
- a ``Stream``: the engine's events, already under way, and a ``watcher`` that turns each event
  into the SSE bytes the client gets (or None: drop it) and makes the stream's trailer. A stream
  the engine refused as it took the request (its first event says so, or its generator raised)
  is answered as a 4xx ``Answer`` instead.

An engine raises only for its own failures (``dead`` says whether the engine itself is gone); a
client's mistake is an ``Answer`` with a 4xx.
"""

from collections.abc import AsyncIterator
from typing import Any, NamedTuple, Protocol

from serve_app.wire.messages import Answer, Call, Trailer


class Watcher(Protocol):
    def pass_on(self, event: Any) -> str | None: ...
    def trailer(self) -> Trailer: ...

    def refusal(self, first: Any) -> dict[str, Any] | None:
        """vLLM's error object (``code``: its 4xx status) when the stream's first event, made as
        the engine took the request, is the engine refusing the client's input: the replica
        answers that with a 4xx before any head is out. None otherwise."""


class Stream(NamedTuple):
    events: AsyncIterator[Any]  # closing it ends the engine request (frees its KV cache)
    watcher: Watcher


class Engine(Protocol):
    @property
    def dead(self) -> bool:
        """The engine itself failed (its core died): every request fails until it is replaced."""

    async def start(self) -> None: ...

    async def answer(self, surface: str, call: Call) -> Answer | Stream: ...

    async def check_health(self) -> None:
        """Raise when the engine cannot serve (Serve replaces the replica)."""

    def unfinished_requests(self) -> int: ...

    def shutdown(self) -> None: ...

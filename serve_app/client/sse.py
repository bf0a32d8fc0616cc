"""Server-sent events, read from an httpx response line by line (the WHATWG event-stream format).

Only what this server sends needs to work, but the parser follows the format rather than the
server's exact bytes: an event is the lines up to a blank line; ``data:`` lines join with a newline;
``event:`` names it; a line starting with ``:`` is a comment; one space after the colon is dropped.
The server relays the replica's bytes per socket read, so one read may hold many events or part of
one: httpx's ``aiter_lines`` reassembles lines across reads.
"""

from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx


@dataclass(frozen=True)
class Event:
    data: str
    event: str = "message"


# A comment line, passed on as itself: no event, but proof that the connection is alive. The
# server writes one into any open stream silent for a second (a long prefill, a queue in the
# engine, a stream resumed on another replica); a reader that bounds silence must see it.
KEEP_ALIVE = Event("", ":")


async def events(response: httpx.Response) -> AsyncIterator[Event]:
    """Every event of ``response``'s body, in order, and ``KEEP_ALIVE`` for each comment line; a
    last event without its blank line counts.

    The response is closed however the iteration ends: httpx closes a body read to its end, not
    one left part-read, and a stream its caller walked away from (a ``break`` with no ``async
    with``) would hold its pooled connection — and the server's engine — until the client closed.
    Dropping this generator runs its ``finally`` (asyncio's finalizer hook)."""
    data: list[str] = []
    name = "message"
    try:
        async for line in response.aiter_lines():
            if not line:
                if data:
                    yield Event("\n".join(data), name)
                data, name = [], "message"
                continue
            if line.startswith(":"):
                yield KEEP_ALIVE
                continue
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "data":
                data.append(value)
            elif field == "event":
                name = value or "message"
            # "id" and "retry" steer browser reconnection, which a completion stream never does.
        if data:
            yield Event("\n".join(data), name)
    finally:
        await response.aclose()

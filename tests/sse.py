"""Reading a raw SSE stream in tests: what the SDKs parse, before they parse it."""

import json

import httpx


def named_events(response: httpx.Response) -> list[tuple[str | None, dict]]:
    """Each ``data:`` JSON object of a streamed ``response`` with the ``event:`` name before it
    (``data: [DONE]``, the end of an OpenAI chat or completions stream, is not an object)."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: ") and line != "data: [DONE]":
            events.append((name, json.loads(line[len("data: "):])))
    return events

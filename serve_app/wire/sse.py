"""Server-sent events, as every part of the service writes and reads them.

Written: compact JSON (no spaces, as vLLM writes its own chunks), ``data:`` alone or after an
``event:`` name, one blank line after. Read: the JSON object of one event's ``data:`` lines.
"""

import json
from typing import Any

DONE = "data: [DONE]\n\n"  # the end of an OpenAI chat or completions stream
DONE_BYTES = DONE.encode()
EVENT_END = b"\n\n"


def compact(payload: Any) -> str:
    return json.dumps(payload, separators=(",", ":"))


def data_event(payload: Any) -> str:
    return f"data: {compact(payload)}\n\n"


def named_event(name: str, payload: Any) -> str:
    return f"event: {name}\ndata: {compact(payload)}\n\n"


def data_of(event: str) -> dict[str, Any] | None:
    """The JSON object of one event's ``data:`` lines, or None (``[DONE]``, comments, non-JSON)."""
    payload = [line[5:].removeprefix(" ") for line in event.splitlines() if line.startswith("data:")]
    if not payload:
        return None
    text = "\n".join(payload)
    if not text.startswith("{"):
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


def first_event(opening: bytes) -> dict[str, Any] | None:
    """The first event's object once ``opening`` (a stream's first bytes) holds it whole, else None."""
    end = opening.find(EVENT_END)
    if end < 0:
        return None
    return data_of(opening[:end].decode("utf-8", "replace")) or {}

"""Server-sent events, as every part of the service writes and reads them.

Written: compact JSON (no spaces, as vLLM writes its own chunks), ``data:`` alone or after an
``event:`` name, one blank line after. Read: the JSON object of one event's ``data:`` lines —
``data_of`` for any client's frames (several lines, comments, ``[DONE]``), and on the replica's
per-token path, for the frames vLLM writes (one ``data:`` line each), ``name_of`` and
``json_of``: a prefix test and one ``json.loads``, no split.
"""

import json
from typing import Any

DONE = "data: [DONE]\n\n"  # the end of an OpenAI chat or completions stream
DONE_BYTES = DONE.encode()
EVENT_END = b"\n\n"
_NAME = "event: "
_DATA = "data:"
_DATA_BYTES = _DATA.encode()


def compact(payload: Any) -> str:
    return json.dumps(payload, separators=(",", ":"))


def data_event(payload: Any) -> str:
    return f"data: {compact(payload)}\n\n"


def named_event(name: str, payload: Any) -> str:
    return named_frame(name, compact(payload))


def named_frame(name: str, data: str) -> str:
    """A named event around JSON already encoded (a pydantic object's ``model_dump_json``)."""
    return f"event: {name}\ndata: {data}\n\n"


def name_of(frame: str) -> str | None:
    """The ``event:`` name a frame starts with (Anthropic's and Responses' frames), else None."""
    if not frame.startswith(_NAME):
        return None
    end = frame.find("\n")
    return frame[len(_NAME):end if end >= 0 else None]


def json_of(frame: str | bytes) -> Any:
    """The JSON of a frame's one ``data:`` line (vLLM writes one a frame, and so do our peers'
    routers: ``bytes`` as read off the wire). ValueError when it has none or it is not JSON."""
    start = frame.find(_DATA if isinstance(frame, str) else _DATA_BYTES)
    if start < 0:
        raise ValueError("an SSE frame without data")
    return json.loads(frame[start + len(_DATA):])


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

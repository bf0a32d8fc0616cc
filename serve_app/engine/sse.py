"""Server-sent events as every surface writes them: compact JSON (no spaces, as vLLM writes its
own chunks), ``data:`` alone or after an ``event:`` name, one blank line after."""

import json
from typing import Any


def compact(payload: Any) -> str:
    return json.dumps(payload, separators=(",", ":"))


def data_event(payload: Any) -> str:
    return f"data: {compact(payload)}\n\n"


def named_event(name: str, payload: Any) -> str:
    return f"event: {name}\ndata: {compact(payload)}\n\n"

"""``client.embeddings.create(...)``: ``POST /v1/embeddings``, as the openai SDK spells it.

    reply = await client.embeddings.create(model="qwen-3-embedding-0.6b", input=["a text", "another"])
    vectors = [item.embedding for item in reply.data]

As the openai SDK does, a call that names no ``encoding_format`` asks the server for base64 (a
float32 vector in ~5.3 bytes a dimension instead of ~20 as JSON text) and hands back floats: the
caller sees ``list[float]`` either way. ``encoding_format="base64"`` returns the server's strings
as they came; ``"float"`` asks for JSON numbers. The request, retries, failover and timing are the
client's own (``Calls.create``, ``calls.py``: a 503 moves to the next region, a 429 waits its
``Retry-After``), and ``reply.timing`` carries the server's (docs/client.md).
"""

import base64
import struct
from typing import Any

from serve_app.client import types
from serve_app.client.calls import Calls

EMBEDDINGS_PATH = "/v1/embeddings"


class AsyncEmbeddings:
    def __init__(self, calls: Calls):
        self._calls = calls

    async def create(self, request: dict[str, Any] | None = None, /, **params: Any) -> types.CreateEmbeddingResponse:
        decode = "encoding_format" not in {**(request or {}), **params}
        if decode:
            params["encoding_format"] = "base64"
        reply = await self._calls.create(EMBEDDINGS_PATH, types.CreateEmbeddingResponse, request, params)
        if decode:
            for item in reply.data:
                item.embedding = floats(item.embedding)
        return reply


def floats(encoded: str | list[float]) -> list[float]:
    """A base64 embedding (little-endian float32, as OpenAI and vLLM send it) as floats."""
    if not isinstance(encoded, str):
        return encoded
    raw = base64.b64decode(encoded)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))

"""Reading a request's body at the router: never more than ``MAX_REQUEST_BODY_BYTES`` buffered."""

from fastapi import Request

from serve_app.errors import APIError
from serve_app.router.json_body import shown

# A full 8192-token prompt is ~32 KiB of text; tools and schemas add some. Anything near this is
# abuse or a client bug, and reading it would cost router memory for nothing.
MAX_REQUEST_BODY_BYTES = 2 * 1024 * 1024
# The content codings of HTTP's registry that compress.
_COMPRESSIONS = frozenset({"gzip", "x-gzip", "deflate", "br", "zstd", "compress", "x-compress"})


def declared_length(request: Request) -> int | None:
    """The body's Content-Length, if it declares one of ASCII digits (``str.isdigit`` also takes
    "²", which ``int`` refuses, and ``int`` refuses 4,301 digits or more: each a 500 had a proxy
    ever let such a header through). Past 19 digits it is past any limit: 2**63."""
    declared = request.headers.get("content-length", "")
    if not (declared.isascii() and declared.isdigit()):
        return None
    return int(declared) if len(declared) <= 19 else 2**63


async def read_body(request: Request, *, refuse_past: tuple[int, APIError] | None = None) -> bytes:
    """The body, refusing (413) before buffering more than ``MAX_REQUEST_BODY_BYTES`` — or, with
    ``refuse_past`` (a size and its error), before buffering more than that size."""
    encoding = request.headers.get("content-encoding", "").lower()
    if _COMPRESSIONS.intersection(coding.strip() for coding in encoding.split(",")):
        # Decoding would let a few KiB of gzip stand for gigabytes past the size limit; and the
        # body read as JSON would be a misleading "invalid JSON". (A value that names no
        # compression, such as "utf-8", which some clients send, leaves the body as it is.)
        raise APIError(415, f"request bodies are read uncompressed; send the JSON without Content-Encoding "
                            f"({shown(encoding)})", code="unsupported_content_encoding")
    limit, too_large = MAX_REQUEST_BODY_BYTES, APIError(
        413, f"request body exceeds {MAX_REQUEST_BODY_BYTES} bytes", code="request_too_large"
    )
    if refuse_past is not None and refuse_past[0] < limit:
        limit, too_large = refuse_past
    declared = declared_length(request)
    if declared is not None and declared > limit:
        raise too_large
    received = bytearray()
    async for chunk in request.stream():  # chunked uploads carry no content-length
        received += chunk
        if len(received) > limit:
            raise too_large
    return bytes(received)


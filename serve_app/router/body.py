"""Reading a request's body at the router: never more than ``MAX_REQUEST_BODY_BYTES`` buffered."""

from fastapi import Request

from serve_app.errors import APIError

# A full 8192-token prompt is ~32 KiB of text; tools and schemas add some. Anything near this is
# abuse or a client bug, and reading it would cost router memory for nothing.
MAX_REQUEST_BODY_BYTES = 2 * 1024 * 1024


async def read_body(request: Request, *, refuse_past: tuple[int, APIError] | None = None) -> bytes:
    """The body, refusing (413) before buffering more than ``MAX_REQUEST_BODY_BYTES`` — or, with
    ``refuse_past`` (a size and its error), before buffering more than that size."""
    limit, too_large = MAX_REQUEST_BODY_BYTES, APIError(
        413, f"request body exceeds {MAX_REQUEST_BODY_BYTES} bytes", code="request_too_large"
    )
    if refuse_past is not None and refuse_past[0] < limit:
        limit, too_large = refuse_past
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    received = bytearray()
    async for chunk in request.stream():  # chunked uploads carry no content-length
        received += chunk
        if len(received) > limit:
            raise too_large
    return bytes(received)

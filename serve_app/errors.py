"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``.

The router and the model replica both answer with these, so a client sees one error shape whatever
failed. ``type`` follows OpenAI's vocabulary for the status; ``code`` is a short machine-readable
reason (``model_not_found``) or None.
"""

from typing import Any

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    501: "server_error",
    503: "service_unavailable",
}


# Retry hint for load shedding: long enough for autoscaling to react, short for an SDK retry loop.
OVERLOADED_RETRY_AFTER_S = 2


class APIError(Exception):
    """An error that becomes an HTTP response with an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def retry_later(
    reason: str, code: str, retry_after_s: int = OVERLOADED_RETRY_AFTER_S, param: str | None = None
) -> APIError:
    """A 503 that tells the client when to come back (the openai SDK honours ``Retry-After``);
    the router may still fail it over to a peer region first."""
    when = "shortly" if retry_after_s <= OVERLOADED_RETRY_AFTER_S else "later"
    return APIError(
        503, f"{reason}; retry {when}", param=param, code=code, headers={"Retry-After": str(retry_after_s)}
    )


def engine_failed_mid_stream() -> dict[str, Any]:
    """The error event a stream ends with when its engine dies, wherever that is noticed: in
    vLLM's own error event (the replica rewrites it) or in a trailer cut short (the router)."""
    return error_body(503, "the model engine failed during this stream; retry the request", code="engine_unavailable")

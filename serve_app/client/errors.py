"""Exceptions the client raises: one class per status the server documents (docs/api.md, "Errors").

Every HTTP error carries what the server's body and headers said (``status``, ``type``, ``code``,
``param``, ``retry_after``, ``request_id``; the response's ``headers`` and its ``body`` text, a
proxy's page too) plus where it happened (``region``, ``trace_id``), so a caller can branch on
``code`` and quote the request and trace ids to an operator. Every error pickles (a worker pool
hands it to its parent). The class names mirror the openai SDK's, so code
written against it reads the same; they are our own classes, not subclasses of openai's (the client
must not need the openai package).

A stream that fails after its ``200`` status line ends with an error event in the same shape; it is
raised as the class its ``type`` stands for, with ``during_stream=True``: never retried, since the
caller has already consumed part of the answer.
"""

import email.utils
import math
import time
from collections.abc import Mapping
from typing import Any

import httpx

BODY_KEPT_CHARS = 8192  # of an error's body text (a proxy's page can be large)

# The status an error event stands for when there is no status line to read it from (a stream's
# error event, after its 200). By code first: these two codes have their own statuses.
_STATUS_BY_CODE = {"peer_stream_failed": 502, "engine_unavailable": 503}
_STATUS_BY_TYPE = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "rate_limit_error": 429,
    "service_unavailable": 503,
    "server_error": 500,
    # Anthropic's error types (on /v1/messages), where they differ from OpenAI's.
    "billing_error": 402,
    "not_found_error": 404,
    "overloaded_error": 503,
    "timeout_error": 504,
    "api_error": 500,
}


class ServeAppError(Exception):
    """Base of every error this client raises."""

    def __reduce__(self):
        # Exception pickles as cls(*args): keyword-only fields would be lost (and required ones
        # fail to unpickle). Rebuilt from the message, with every field as it was.
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls: type, args: tuple, fields: dict[str, Any]) -> ServeAppError:
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(fields)
    return err


class APIConnectionError(ServeAppError):
    """No response: the connection failed, or a stream broke off without an error event."""

    def __init__(self, message: str, *, region: str | None = None, trace_id: str | None = None):
        super().__init__(message)
        self.message, self.region, self.trace_id = message, region, trace_id


class APITimeoutError(APIConnectionError):
    """The server did not answer (or stopped sending) within the configured timeout."""


class APIStatusError(ServeAppError):
    """The server answered with an error: an HTTP status >= 400, or an error event mid-stream."""

    def __init__(
        self,
        message: str,
        *,
        status: int,
        type: str | None = None,
        code: str | None = None,
        param: str | None = None,
        retry_after: float | None = None,
        region: str | None = None,
        trace_id: str | None = None,
        during_stream: bool = False,
        json_body: bool = True,
        request_id: str | None = None,
        headers: Mapping[str, str] | None = None,
        body: str | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.type, self.code, self.param = message, status, type, code, param
        self.retry_after, self.region, self.trace_id, self.during_stream = retry_after, region, trace_id, during_stream
        self.json_body = json_body  # False: a page or plain text, from a proxy rather than an application
        # The id the server logged the request under (``x-request-id``; an Anthropic body's
        # ``request_id``): quote it with the trace id when reporting a failure.
        self.request_id = request_id
        self.headers = dict(headers or {})  # the response's (lower-case names), none for a stream's event
        self.body = body  # the response's text, at most BODY_KEPT_CHARS

    @property
    def status_code(self) -> int:  # the openai SDK's name for it
        return self.status

    def __str__(self) -> str:
        detail = ", ".join(f"{k}={v}" for k, v in (("type", self.type), ("code", self.code), ("param", self.param)) if v)
        return f"{self.status} {self.message}" + (f" ({detail})" if detail else "")


class BadRequestError(APIStatusError): ...


class AuthenticationError(APIStatusError): ...


class PermissionDeniedError(APIStatusError): ...


class NotFoundError(APIStatusError): ...


class RequestTooLargeError(APIStatusError): ...


class RateLimitError(APIStatusError): ...


class InternalServerError(APIStatusError): ...


class ServiceUnavailableError(InternalServerError): ...


_CLASS_BY_STATUS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    413: RequestTooLargeError,
    429: RateLimitError,
    503: ServiceUnavailableError,
}


def _class_for(status: int) -> type[APIStatusError]:
    if status in _CLASS_BY_STATUS:
        return _CLASS_BY_STATUS[status]
    return InternalServerError if status >= 500 else APIStatusError


def described(err: ServeAppError) -> str:
    """A log line's word for an error: its status and code, or its class."""
    if isinstance(err, APIStatusError):
        return f"{err.status} {err.code or err.type or ''}".strip()
    return type(err).__name__


def retry_after_s(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """Seconds to wait, from ``retry-after-ms`` (finer, sent with 429s) or ``Retry-After``: in
    seconds, as the server sends it, or as an HTTP date (a CDN's or a load balancer's 429 or 503,
    read against this host's clock; a date past is 0). ``inf``, ``nan`` or a negative say nothing.
    ``now``: the wall clock, for a date (tests)."""
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) * scale
        except ValueError:
            seconds = _seconds_until(value, now) if scale == 1.0 else None
        if seconds is not None and math.isfinite(seconds) and seconds >= 0:
            return seconds
    return None


def _seconds_until(date: str, now: float | None) -> float | None:
    try:
        when = email.utils.parsedate_to_datetime(date)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:  # RFC 9110 dates are GMT; one without a zone is read as such
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def _error_fields(body: Any) -> dict[str, Any]:
    """The error object of an error body or event: ``{"error": {...}}`` (OpenAI's, Anthropic's, and a
    Responses error event's), or a Responses error event's own top-level fields."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return error
    return body if isinstance(body, dict) and body.get("type") == "error" else {}


def from_response(response: httpx.Response, *, region: str | None, trace_id: str | None) -> APIStatusError:
    """The exception for an error response (its body must have been read)."""
    json_body, payload = True, None
    try:
        payload = response.json()
        fields = _error_fields(payload)
    except (ValueError, httpx.StreamError):  # not JSON (a proxy's HTML page), or a body that broke off
        fields, json_body = {}, False
    try:
        text = response.text[:BODY_KEPT_CHARS]
    except (httpx.StreamError, UnicodeDecodeError):
        text = None
    request_id = response.headers.get("x-request-id")
    if request_id is None and isinstance(payload, dict) and isinstance(payload.get("request_id"), str):
        request_id = payload["request_id"]  # Anthropic's shape
    message = str(fields.get("message") or response.reason_phrase or "error")
    return _class_for(response.status_code)(
        message,
        status=response.status_code,
        type=fields.get("type"),
        code=fields.get("code") if isinstance(fields.get("code"), str) else None,
        param=fields.get("param"),
        retry_after=retry_after_s(response.headers),
        region=response.headers.get("x-pg-region") or region,
        trace_id=trace_id,
        json_body=json_body,
        request_id=request_id,
        headers=response.headers,
        body=text,
    )


def from_stream_event(payload: dict[str, Any], *, region: str | None, trace_id: str | None) -> APIStatusError:
    """The exception for a stream's error event (docs/api.md, "Errors"): chat's
    ``data: {"error": {...}}``, Responses' and Anthropic's ``event: error``."""
    fields = _error_fields(payload)
    code = fields.get("code") if isinstance(fields.get("code"), str) else None
    status = _STATUS_BY_CODE.get(code or "") or _STATUS_BY_TYPE.get(fields.get("type") or "", 500)
    return _class_for(status)(
        str(fields.get("message") or "the stream failed"),
        status=status,
        type=fields.get("type"),
        code=code,
        param=fields.get("param"),
        region=region,
        trace_id=trace_id,
        during_stream=True,
    )

"""HAProxy's own answers in the API's JSON error shape, not HTML.

HAProxy answers a few requests itself, before any router sees them: a request it cannot parse
(400: a malformed request line or header), one not sent in time (408), a transfer coding it does
not know (501), and, where no router can take a request, 502/503/504, which Ray's template turns
into a text/plain 500 (``errorfile`` lines naming its ``500.http``, "per Serve's default
behavior"). HAProxy's defaults are HTML pages an SDK can only show as text. Here each is a whole
HTTP response in a file beside the config (HAProxy's ``errorfile``), with the body every route but
``/v1/messages`` uses (HAProxy cannot tell the routes apart before it has parsed the request); the
statuses stay as Ray chose them.

HAProxy 2.8 (the one Ray bundles) still answers a request its HTTP/1 parser refuses with its
built-in HTML 400, whatever ``errorfile 400`` says (haproxy/haproxy#3032, fixed in 3.2); the 400,
408 and 501 pages serve what HAProxy answers once a request is parsed, and every error of a
HAProxy with that fix.
"""

import json
from pathlib import Path

from serve_app.errors import error_body

# HAProxy's status → the status sent, its reason phrase, the message and the code. The 5xx keep
# Ray's 500 (its HAProxy config's choice, which the routers' failover is built around).
_PAGES = {
    400: (400, "Bad Request", "the request is not valid HTTP/1.1 (a malformed request line or header); "
                              "nothing was served", "bad_http_request"),
    408: (408, "Request Timeout", "the request was not received in time; nothing was served", "request_timeout"),
    501: (501, "Not Implemented", "the request uses an HTTP feature this gateway does not implement "
                                  "(a transfer coding other than chunked)", "http_not_implemented"),
    # The router's connection broke off: the request may have run (and been billed).
    502: (500, "Internal Server Error", "the router failed while answering this request", "gateway_failed"),
    # No router took the request (none up, or every connect refused): nothing ran.
    503: (500, "Internal Server Error", "no router could take this request; retry", "gateway_unavailable"),
    504: (500, "Internal Server Error", "no router answered this request in time", "gateway_timeout"),
}
# The pages after which HAProxy closes the connection itself (the request was not read whole).
_CLOSES = frozenset({400, 408, 501})
_PREFIX = "serve-app-error-"


def page(haproxy_status: int) -> bytes:
    """The whole HTTP response HAProxy sends for ``haproxy_status``."""
    status, reason, message, code = _PAGES[haproxy_status]
    body = json.dumps(error_body(status, message, code=code), separators=(",", ":")).encode()
    close = "Connection: close\r\n" if haproxy_status in _CLOSES else ""  # a 5xx keeps the client's connection
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Cache-Control: no-cache\r\n{close}\r\n")
    return head.encode() + body


def write_pages(directory: Path) -> dict[int, Path]:
    """Each page in ``directory`` (replaced whole: a reloading HAProxy never reads half a file)."""
    paths = {}
    for status in _PAGES:
        path = directory / f"{_PREFIX}{status}.http"
        partial = path.with_suffix(".partial")
        partial.write_bytes(page(status))
        partial.replace(path)
        paths[status] = path
    return paths


def with_pages(config: str, paths: dict[int, Path]) -> str:
    """``config`` with its ``defaults`` section's ``errorfile`` lines replaced by ``paths``': where
    Ray's first one was, else at the section's end."""
    out, section, placed = [], None, False
    for line in config.splitlines(keepends=True):
        if line.strip() and not line[0].isspace() and not line.startswith("#"):
            if section == "defaults" and not placed:
                out, placed = out + _lines(paths), True
            section = line.split()[0]
        if section == "defaults" and line.split()[:1] == ["errorfile"]:
            if not placed:
                out, placed = out + _lines(paths), True
            continue
        out.append(line)
    if section == "defaults" and not placed:
        out += _lines(paths)
    return "".join(out)


def _lines(paths: dict[int, Path]) -> list[str]:
    return [f"    errorfile {status} {path}\n" for status, path in sorted(paths.items())]

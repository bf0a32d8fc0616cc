"""One benchmark request, timed on the client's clock (``time.perf_counter``).

``stream_once`` runs one streaming chat completion and returns a ``Run``; ``call_once`` one plain
request (router capacity). Neither raises for a failed request: the reason goes into
``Run.error`` (``HTTP 503``, ``broken stream: ReadError``, ``no token``…) so a run counts its
errors instead of dying on the first one.
"""

import ipaddress
import json
import secrets
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from serve_app.surfaces.dialects import PG_METADATA_EVENT
from serve_app.wire.sse import data_of

PROMPT = "Say hi in one short sentence."  # the model card's prompt
DEFAULT_MODEL = "qwen-3.6-35b-a3b"
ROUTE_CHAT = "/v1/chat/completions"
ROUTE_MODELS = "/v1/models"
# An answer's header prefix -> the admission step it shows (docs/api.md, "Rate limits", "Budgets").
ADMISSION_HEADERS = {"x-ratelimit-": "rate_limit", "x-budget-": "budget"}


@dataclass
class Run:
    ok: bool
    trace_id: str | None = None  # the W3C trace id this request sent (find it in the traces)
    status: int | None = None
    ttft_ms: float | None = None  # request start → first token chunk
    total_ms: float | None = None  # request start → end of the response
    completion_tokens: int = 0
    decode_tokens_per_s: float | None = None  # (tokens − 1) / (last token − first token)
    server: dict[str, Any] = field(default_factory=dict)  # the pg_metadata event, if any
    # Which admission the answer's headers show it went through (``ADMISSION_HEADERS``): a run
    # with the dev key, or a key without a budget, does not measure the budget's path.
    admission: list[str] = field(default_factory=list)
    error: str | None = None  # short reason, the key errors are counted by
    detail: str | None = None  # the start of an error body, for the raw runs
    # For the sustained window (``serve_app.bench.stats.sustained``): which worker of the batch
    # sent it, when it started and ended, and when each token chunk came (perf_counter).
    worker: int | None = None
    started_at: float | None = None
    ended_at: float | None = None
    token_times: list[float] = field(default_factory=list, repr=False)

    def record(self) -> dict[str, Any]:
        """The raw run as the JSON keeps it (the token times stay out: 64 floats a stream)."""
        out = asdict(self)
        del out["token_times"]
        return out


@dataclass(frozen=True)
class Side:
    """One server under test: ``ours`` (the Serve app) or ``baseline`` (e.g. bare vLLM)."""

    name: str
    url: str
    model: str
    api_key: str | None = None


@asynccontextmanager
async def side_clients(
    sides: Sequence[Side], concurrency: int, transport: httpx.AsyncBaseTransport | None = None
) -> AsyncIterator[dict[str, httpx.AsyncClient]]:
    """One client per side, its pool as large as the concurrency: a request waiting for a pooled
    connection would count the client's own queueing as the server's TTFT."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    # Generous: at concurrency 32 on two CPU cores a stream can take minutes, and a timeout
    # would turn a slow answer into an error instead of a measurement.
    timeout = httpx.Timeout(600, connect=10)
    async with AsyncExitStack() as stack:
        clients = {}
        for side in sides:
            headers = {"Authorization": f"Bearer {side.api_key}"} if side.api_key else {}
            client = httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout, transport=transport)
            clients[side.name] = await stack.enter_async_context(client)
        yield clients


def check_local(url: str) -> str:
    """``url`` without a trailing slash; ValueError unless it points at this machine.

    The benchmark loads its target hard (and starts nothing remote), so it refuses to aim at
    anything but loopback: a typo must not turn it into a load test of a production region.
    """
    parsed = httpx.URL(url)
    host = parsed.host
    if host == "localhost":
        local = True
    else:
        try:
            local = ipaddress.ip_address(host).is_loopback
        except ValueError:
            local = False
    if parsed.scheme not in ("http", "https") or not local:
        raise ValueError(f"{url}: the benchmark only targets 127.0.0.1 / localhost (http or https)")
    return url.rstrip("/")


def new_traceparent() -> tuple[str, str]:
    """A fresh W3C ``traceparent`` (random trace and span ids, sampled) and its trace id."""
    trace_id = secrets.token_hex(16)
    return trace_id, f"00-{trace_id}-{secrets.token_hex(8)}-01"


def chat_body(model: str, max_tokens: int, *, ignore_eos: bool = False, stream: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}  # exact completion_tokens on the last chunk
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM extension: a random-weight model always runs to max_tokens
    return body


def _has_token(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta") or {}
    return bool(
        delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or choice.get("text")
    )


class StreamState:
    """What an SSE stream said so far; ``feed`` it every line with the time it arrived."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.token_times: list[float] = []
        self.token_chunks = 0
        self.usage_tokens: int | None = None
        self.server: dict[str, Any] = {}
        self.error: str | None = None
        self.done = False

    def feed(self, line: str, now: float) -> None:
        if line:
            self._lines.append(line)
        else:  # a blank line ends an SSE event
            self.flush(now)

    def flush(self, now: float) -> None:
        lines, self._lines = self._lines, []
        if not lines:
            return
        event_name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("event:")), None)
        if any(ln.startswith("data:") and ln[5:].strip() == "[DONE]" for ln in lines):
            self.done = True
            return
        payload = data_of("\n".join(lines))
        if payload is None:
            return
        if payload.get("error"):  # the router's mid-stream failure event
            self.error = "stream error"
            return
        if event_name == PG_METADATA_EVENT or "pg_metadata" in payload:
            self.server = dict(payload.get("pg_metadata") or {})
        usage = payload.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.usage_tokens = usage["completion_tokens"]
        if any(_has_token(c) for c in (payload.get("choices") or []) if isinstance(c, dict)):
            self.token_chunks += 1
            self.token_times.append(now)
            self.last_token_at = now
            if self.first_token_at is None:
                self.first_token_at = now

    def run(self, trace_id: str, started: float, ended: float) -> Run:
        base = Run(ok=False, trace_id=trace_id, status=200, total_ms=(ended - started) * 1000, server=self.server,
                   started_at=started, ended_at=ended, token_times=self.token_times)
        if self.error or self.first_token_at is None or not self.done:
            base.error = self.error or ("no token" if self.first_token_at is None else "broken stream: no [DONE]")
            return base
        # Usage is exact; counting chunks is a fallback for a server that ignores include_usage.
        tokens = self.usage_tokens if self.usage_tokens is not None else self.token_chunks
        decode_s = (self.last_token_at or self.first_token_at) - self.first_token_at
        base.ok = True
        base.ttft_ms = (self.first_token_at - started) * 1000
        base.completion_tokens = tokens
        base.decode_tokens_per_s = (tokens - 1) / decode_s if tokens > 1 and decode_s > 0 else None
        return base


async def stream_once(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Run:
    """One streaming chat completion against ``url`` (a base URL)."""
    trace_id, traceparent = new_traceparent()
    state = StreamState()
    started = time.perf_counter()
    try:
        async with client.stream("POST", url + ROUTE_CHAT, json=body, headers={"traceparent": traceparent}) as response:
            if response.status_code != 200:
                detail = (await response.aread())[:200].decode(errors="replace")
                return Run(ok=False, trace_id=trace_id, status=response.status_code,
                           error=f"HTTP {response.status_code}", detail=detail,
                           started_at=started, ended_at=time.perf_counter())
            async for line in response.aiter_lines():
                state.feed(line, time.perf_counter())
    except httpx.HTTPError as err:
        return Run(ok=False, trace_id=trace_id, error=f"broken stream: {type(err).__name__}", detail=str(err)[:200],
                   started_at=started, ended_at=time.perf_counter())
    state.flush(time.perf_counter())
    run = state.run(trace_id, started, time.perf_counter())
    run.admission = admission_of(response.headers)
    return run


def admission_of(headers: Mapping[str, str]) -> list[str]:
    """The admission steps an answer's headers show (``ADMISSION_HEADERS``), sorted."""
    return sorted({step for name in headers for prefix, step in ADMISSION_HEADERS.items() if name.lower().startswith(prefix)})


async def call_once(client: httpx.AsyncClient, method: str, url: str, body: dict[str, Any] | None = None) -> Run:
    """One plain request; ``total_ms`` is its latency to the whole response body."""
    trace_id, traceparent = new_traceparent()
    started = time.perf_counter()
    try:
        response = await client.request(method, url, json=body, headers={"traceparent": traceparent})
    except httpx.HTTPError as err:
        return Run(ok=False, trace_id=trace_id, error=f"transport: {type(err).__name__}", detail=str(err)[:200])
    total_ms = (time.perf_counter() - started) * 1000
    if response.status_code != 200:
        return Run(ok=False, trace_id=trace_id, status=response.status_code, total_ms=total_ms,
                   error=f"HTTP {response.status_code}", detail=response.text[:200])
    try:
        server = json.loads(response.content).get("pg_metadata") or {}
    except (ValueError, AttributeError):
        server = {}
    return Run(ok=True, trace_id=trace_id, status=200, total_ms=total_ms, server=server)

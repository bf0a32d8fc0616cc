"""Requests the fault suite sends, and how each one ended, on the client's clock.

A stream *outcome* is what a client saw: the status, when the status line came, and how the body
ended — ``done`` (``[DONE]`` after our ``pg_metadata``), ``error_event`` (an error event, then
``[DONE]``: the code is kept), ``cut`` (the connection closed without ``[DONE]``) or ``hung``
(nothing for ``idle_timeout_s``). Nothing here raises for a failed request: the suite counts them.
"""

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx

from serve_app.bench.client import DEFAULT_MODEL
from serve_app.bench.client import chat_body as bench_chat_body

ROUTE_CHAT = "/v1/chat/completions"


@dataclass
class Outcome:
    status: int | None  # None: no status line (connection refused, hung before it)
    ended: str  # done | error_event | cut | hung | refused | json (a non-stream answer)
    status_s: float | None = None  # request start → status line
    total_s: float | None = None
    error_code: str | None = None  # from the error body or the stream's error event
    retry_after: str | None = None
    chunks: int = 0  # content chunks received
    completion_tokens: int | None = None  # the stream's usage chunk, when it asked for one
    text: str = ""  # their content, joined (the seam check of a resumed stream)
    reasoning: str = ""  # their reasoning, joined (the same check, for a stream that thinks)
    max_gap_s: float = 0.0  # the longest wait between two content chunks (a seam's pause)
    chunks_before_gap: int = 0  # content chunks received before that wait
    resumes: int = 0  # pg_metadata.resumes: the stream went on from another replica
    resumed_in: str | None = None  # pg_metadata.resumed_in: the peer region that continued it, if one did
    replica: str | None = None  # pg_metadata.replica: the model replica that served (or ended) it
    first_chunk_s: float | None = None  # request start → first content chunk (TTFT, client's clock)
    numbered: bool | None = None  # a Responses stream: its events numbered 0, 1, 2… (``stream_typed``)
    started_at: float = 0.0  # time.monotonic() when it was sent

    @property
    def label(self) -> str:
        return f"{self.status} {self.ended}" + (f" {self.error_code}" if self.error_code else "")


def chat_body(max_tokens: int, *, stream: bool = True) -> dict[str, Any]:
    """The benchmark's request (the model card's prompt), with ``ignore_eos``: every stream runs
    its full length, so scenarios are comparable and long enough to hit."""
    return bench_chat_body(DEFAULT_MODEL, max_tokens, ignore_eos=True, stream=stream)


async def stream_chat(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    *,
    idle_timeout_s: float = 60.0,
    first_chunk: asyncio.Event | None = None,
    leave_after_chunks: int | None = None,
) -> Outcome:
    """One streaming chat. ``first_chunk`` is set when content arrives; with
    ``leave_after_chunks`` the client disconnects after that many chunks (``ended='left'``)."""
    started = time.perf_counter()
    outcome = Outcome(status=None, ended="refused", started_at=time.monotonic())
    try:
        async with client.stream("POST", url + ROUTE_CHAT, json=body, timeout=idle_timeout_s) as response:
            outcome.status, outcome.status_s = response.status_code, time.perf_counter() - started
            outcome.retry_after = response.headers.get("retry-after")
            if response.status_code != 200:
                outcome.ended, outcome.error_code = "json", _error_code(await response.aread())
                return outcome
            outcome.ended = "cut"
            text, reasoning, last = [], [], None
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    outcome.ended = "error_event" if outcome.error_code else "done"
                    break
                payload = json.loads(line[6:])
                if "error" in payload:
                    outcome.error_code = payload["error"].get("code") or payload["error"].get("type")
                elif payload.get("usage") and not payload.get("choices"):
                    outcome.completion_tokens = payload["usage"].get("completion_tokens")
                elif "pg_metadata" in payload:
                    outcome.resumes = payload["pg_metadata"].get("resumes", 0)
                    outcome.resumed_in = payload["pg_metadata"].get("resumed_in")
                    outcome.replica = payload["pg_metadata"].get("replica")
                elif payload.get("choices"):
                    now = time.perf_counter()
                    if last is not None and now - last > outcome.max_gap_s:
                        outcome.max_gap_s, outcome.chunks_before_gap = now - last, outcome.chunks
                    last = now
                    delta = payload["choices"][0].get("delta") or {}
                    text.append(delta.get("content") or "")
                    reasoning.append(delta.get("reasoning") or "")
                    outcome.text, outcome.reasoning = "".join(text), "".join(reasoning)
                    outcome.chunks += 1
                    if outcome.first_chunk_s is None:
                        outcome.first_chunk_s = time.perf_counter() - started
                    if first_chunk is not None:
                        first_chunk.set()
                    if leave_after_chunks is not None and outcome.chunks >= leave_after_chunks:
                        outcome.ended = "left"
                        break
    except httpx.TimeoutException:
        outcome.ended = "hung"
    except httpx.TransportError:
        outcome.ended = "cut" if outcome.status is not None else "refused"
    outcome.total_s = time.perf_counter() - started
    return outcome


# The typed-event surfaces a stream may also run on: their route, and per event name what it
# carries (text, reasoning) or how it ends.
TYPED_ROUTES = {"responses": "/v1/responses", "messages": "/v1/messages"}
_TEXT_EVENTS = {"response.output_text.delta": "text", "response.reasoning_text.delta": "reasoning"}
_ANTHROPIC_DELTAS = {"text_delta": ("text", "text"), "thinking_delta": ("reasoning", "thinking")}
_TERMINAL_EVENTS = ("response.completed", "response.incomplete", "message_stop")


async def stream_typed(client: httpx.AsyncClient, url: str, surface: str, body: dict[str, Any], *,
                       idle_timeout_s: float = 60.0, first_chunk: asyncio.Event | None = None) -> Outcome:
    """One Responses or Messages stream, read as ``stream_chat`` reads a chat: its text and
    reasoning, the longest wait between two of their events, how it ended (``done``: its terminal
    event; ``error_event``: an error event), its resume and usage; ``numbered``: a Responses
    stream's events numbered 0, 1, 2… without a gap."""
    started = time.perf_counter()
    outcome = Outcome(status=None, ended="refused", started_at=time.monotonic())
    parts: dict[str, list[str]] = {"text": [], "reasoning": []}
    numbers: list[int] = []
    try:
        async with client.stream("POST", url + TYPED_ROUTES[surface], json=body, timeout=idle_timeout_s) as response:
            outcome.status, outcome.status_s = response.status_code, time.perf_counter() - started
            if response.status_code != 200:
                outcome.ended, outcome.error_code = "json", _error_code(await response.aread())
                return outcome
            outcome.ended, name, last = "cut", None, None
            async for line in response.aiter_lines():
                if line.startswith("event: "):
                    name = line[len("event: "):]
                if not line.startswith("data: "):
                    continue
                payload = json.loads(line[6:])
                if isinstance(payload.get("sequence_number"), int):
                    numbers.append(payload["sequence_number"])
                if (piece := _piece(name, payload)) is not None:
                    now = time.perf_counter()
                    if last is not None and now - last > outcome.max_gap_s:
                        outcome.max_gap_s, outcome.chunks_before_gap = now - last, outcome.chunks
                    last = now
                    parts[piece[0]].append(piece[1])
                    outcome.chunks += 1
                    if first_chunk is not None:
                        first_chunk.set()
                elif name == "message_delta":
                    outcome.completion_tokens = (payload.get("usage") or {}).get("output_tokens")
                elif name == "error":
                    outcome.error_code = payload.get("code") or (payload.get("error") or {}).get("type")
                    outcome.ended = "error_event"
                elif name in _TERMINAL_EVENTS:
                    metadata = payload.get("pg_metadata") or (payload.get("response") or {}).get("pg_metadata") or {}
                    outcome.resumes, outcome.resumed_in = metadata.get("resumes", 0), metadata.get("resumed_in")
                    outcome.replica, outcome.ended = metadata.get("replica"), "done"
                    if "response" in payload:
                        outcome.completion_tokens = (payload["response"].get("usage") or {}).get("output_tokens")
    except httpx.TimeoutException:
        outcome.ended = "hung"
    except httpx.TransportError:
        outcome.ended = "cut" if outcome.status is not None else "refused"
    outcome.text, outcome.reasoning = "".join(parts["text"]), "".join(parts["reasoning"])
    outcome.numbered = numbers == list(range(len(numbers))) if numbers else None
    outcome.total_s = time.perf_counter() - started
    return outcome


def _piece(name: str | None, payload: dict[str, Any]) -> tuple[str, str] | None:
    """The text or reasoning an event carries, if it carries some."""
    if name in _TEXT_EVENTS:
        return _TEXT_EVENTS[name], payload.get("delta") or ""
    delta = payload.get("delta")
    if name == "content_block_delta" and isinstance(delta, dict) and delta.get("type") in _ANTHROPIC_DELTAS:
        part, field = _ANTHROPIC_DELTAS[delta["type"]]
        return part, delta.get(field) or ""
    return None


async def post_chat(client: httpx.AsyncClient, url: str, body: dict[str, Any], timeout_s: float = 60.0) -> Outcome:
    started = time.perf_counter()
    try:
        response = await client.post(url + ROUTE_CHAT, json=body, timeout=timeout_s)
    except httpx.TimeoutException:
        return Outcome(status=None, ended="hung", total_s=time.perf_counter() - started)
    except httpx.TransportError:
        return Outcome(status=None, ended="refused", total_s=time.perf_counter() - started)
    elapsed = time.perf_counter() - started
    code = _error_code(response.content) if response.status_code >= 400 else None
    return Outcome(response.status_code, "json", elapsed, elapsed, code, response.headers.get("retry-after"))


class HealthProbe:
    """``GET /health`` every ``period_s`` until stopped: each answer's time, status and state."""

    def __init__(self, client: httpx.AsyncClient, url: str, period_s: float = 0.5, timeout_s: float = 5.0):
        self.client, self.url, self.period_s, self.timeout_s = client, url, period_s, timeout_s
        # (at, code, status, seconds, each model's state): a model's own recovery shows in its
        # state; the status is 503 only while a required model (or every model) serves nowhere.
        self.samples: list[tuple[float, int | None, str | None, float, dict[str, str]]] = []
        # Answers in which each model's slots were all taken: the region says "busy" only when
        # every serving model is (an idle embedding model beside a saturated LLM is "ok").
        self.busy_models: Counter[str] = Counter()
        self._task: asyncio.Task | None = None
        self._t0 = time.monotonic()

    def start(self) -> "HealthProbe":
        self._t0 = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            began = time.monotonic()
            try:
                response = await self.client.get(self.url + "/health", timeout=self.timeout_s)
                answer = response.json()
                code, status, states = response.status_code, answer.get("status"), answer.get("states") or {}
                self.busy_models.update(m for m, load in (answer.get("load") or {}).items() if load.get("busy"))
            except (httpx.HTTPError, ValueError, AttributeError):
                code, status, states = None, None, {}
            self.samples.append((round(began - self._t0, 2), code, status, round(time.monotonic() - began, 4), states))
            await asyncio.sleep(self.period_s)

    async def until_steady(self, code: int, *, in_a_row: int, timeout_s: float) -> bool:
        """Wait until the last ``in_a_row`` probes all answered ``code`` (True), or ``timeout_s``
        (False): with several router replicas behind the proxy, each answers from its own view, and
        the views agree only a refresh or two after Serve's status changed."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            last = [sample[1] for sample in self.samples[-in_a_row:]]
            if len(last) == in_a_row and set(last) == {code}:
                return True
            await asyncio.sleep(self.period_s)
        return False

    def summary(self) -> dict[str, Any]:
        seconds = sorted(s[3] for s in self.samples)
        return {
            "probes": len(self.samples),
            "by_answer": dict(Counter(f"{code} {status}" for _, code, status, _, _ in self.samples)),
            "busy_models": dict(self.busy_models),
            "max_s": seconds[-1] if seconds else None,
            "over_1s": sum(s > 1.0 for s in seconds),
        }

    def changes(self) -> list[dict[str, Any]]:
        """When the answer changed: a timeline an SRE can read."""
        samples = [
            {"at_s": at, "code": code, "status": status, "states": states} for at, code, status, _, states in self.samples
        ]
        return transitions(samples, ("code", "status", "states"))


def transitions(entries: list[dict[str, Any]], fields: tuple[str, ...]) -> list[dict[str, Any]]:
    """Only the entries whose ``fields`` differ from the entry before: when each kind began."""
    kept, last = [], None
    for entry in entries:
        kind = tuple(entry[name] for name in fields)
        if kind != last:
            kept.append(entry)
            last = kind
    return kept


def count(outcomes: list[Outcome]) -> dict[str, int]:
    return dict(Counter(o.label for o in outcomes))


def _error_code(raw: bytes) -> str | None:
    try:
        error = json.loads(raw).get("error") or {}
    except (ValueError, AttributeError):
        return "not_json"
    return error.get("code") or error.get("type")

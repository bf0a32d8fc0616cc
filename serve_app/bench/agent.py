"""``serve-app bench-agent``: the agent workload — long shared prefixes and conversations that grow
turn by turn, where TTFT on turn N depends on landing where turns 1…N−1 are cached.

**Workload.** ``--sessions`` S agents run at once, each ``--turns`` T turns. Every session of a
batch shares one context — a system prompt of repository notes and a tool schema (sent as
``tools``, ``tool_choice: none``), ``--system-tokens`` in all (default 2,000, at 4 characters a
token) — and starts with its own first user message (``--user-tokens``, default 100). Each turn
is a streaming chat completion (``stream_options.include_usage``); its answer (``--max-tokens``,
``ignore_eos`` by default so a random-weight model answers in full) and a new user message are
appended for the next turn. Sessions are interleaved as agents are: session i starts
``i × --stagger-s`` after the first, and each waits ``--think-s`` (its tool run) between turns, so
other sessions' turns land in between. Each request names its session in ``x-session-id``
(``--no-session-header`` leaves it to the prefix index alone) and carries a fresh
``traceparent``.

**Routing comparison** (``--routing``, ``serve_app.routing``): the deployment runs our request
router with ``compare_with_default`` on, which routes each session by our policy or by Serve's
default (power of two choices) according to ``serve_app.routing.session.compare_arm`` of its
key; the benchmark picks session ids for each arm. Rounds (``--rounds``) run the prefix arm's
batch and the default arm's batch in turn, never at once, the order flipping every round, with
``--quiet-s`` of idle before each batch; every batch starts from a fresh context (a nonce at its
start), so no batch inherits another's cache. Without ``--routing`` there is one arm, ``ours``.

Figures (``agent_stats.py``): TTFT p50/p95 by turn; cache-hit ratio = cached / prompt tokens
(``usage.prompt_tokens_details.cached_tokens``, else ``pg_metadata.cached_tokens``), overall, on
turns ≥ 2, and against the ideal (turn N reusing all of turn N−1's prompt); how many turns ≥ 2
ran on their previous turn's replica (``pg_metadata.replica``); aggregate completion tok/s
over the arm's wall time.
"""

import asyncio
import json
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from serve_app.bench.client import ROUTE_CHAT, StreamState, new_traceparent, side_clients
from serve_app.routing.session import SESSION_HEADER, compare_arm, session_key
from serve_app.wire.sse import data_of

CHARS_PER_TOKEN = 4  # the context's size in tokens, estimated as the router prices prompts
OURS, PREFIX, DEFAULT = "ours", "prefix", "default"  # arm names: one arm, or the two compared


@dataclass(frozen=True)
class AgentWorkload:
    model: str
    sessions: int = 8
    turns: int = 6
    system_tokens: int = 2000
    user_tokens: int = 100
    max_tokens: int = 64
    ignore_eos: bool = True
    think_s: float = 0.2
    stagger_s: float = 0.25
    session_header: bool = True
    # shared: every session of a batch starts with one context (a system prompt and tools, as
    # agents of one product do); own: each session its own (agents each on their own repository),
    # so a turn sent to the replica that did not serve its session prefills its whole context.
    context: str = "shared"


@dataclass
class TurnRun:
    """One turn of one session, measured on the client's clock."""

    arm: str
    round: int
    session: str
    turn: int  # 1-based
    ok: bool = False
    error: str | None = None
    status: int | None = None
    ttft_ms: float | None = None
    total_ms: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int = 0
    replica: str | None = None  # pg_metadata's model replica (None from a server that sends none)
    routing: dict[str, str] | None = None  # pg_metadata's routing: the request router's policy and reason
    trace_id: str | None = None
    server: dict[str, Any] = field(default_factory=dict)


# --- the workload's text -------------------------------------------------------------------------
def shared_context(nonce: str, tokens: int) -> tuple[str, list[dict[str, Any]]]:
    """A batch's system prompt and tool schema, ~``tokens`` together; ``nonce`` first, so two
    batches share no cached block."""
    tools = [
        {"type": "function", "function": {
            "name": name, "description": f"{name.replace('_', ' ')} in the repository; {hint}",
            "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": "repo-relative path"},
                                                            "text": {"type": "string"}}, "required": ["path"]},
        }}
        for name, hint in (("read_file", "returns its text"), ("edit_file", "replaces a span"),
                           ("run_tests", "runs pytest on a path"), ("search_code", "greps a pattern"))
    ]
    budget = tokens * CHARS_PER_TOKEN - len(json.dumps(tools))
    lines = [f"[{nonce}] You are a coding agent in the repository described below. Use the tools; answer tersely."]
    i = 0
    while sum(len(line) + 1 for line in lines) < budget:
        lines.append(f"src/pkg_{i % 17}/module_{i}.py defines Service{i}, which handles request kind {i * 7 % 101}; "
                     f"read it before editing, and run tests/test_module_{i}.py after.")
        i += 1
    return "\n".join(lines), tools


def user_message(session: str, turn: int, tokens: int) -> str:
    words = f"Session {session}, step {turn}: inspect the next module, fix what fails and report briefly."
    filler = " Keep the public interface stable and explain the change in one line."
    text = words
    while len(text) < tokens * CHARS_PER_TOKEN:
        text += filler
    return text


def session_ids(arm: str, count: int, tag: str) -> list[str]:
    """``count`` session ids of this batch; for a compared arm, ids that ``compare_arm`` gives it."""
    ids, n = [], 0
    while len(ids) < count:
        candidate = f"{tag}-{arm}-{n}"
        n += 1
        if arm == OURS or compare_arm(session_key({SESSION_HEADER: candidate}, {})) == arm:
            ids.append(candidate)
    return ids


# --- one turn ------------------------------------------------------------------------------------
class TurnState(StreamState):
    """``StreamState`` (TTFT, [DONE], errors, pg_metadata) plus the answer's text and the usage's
    prompt and cached tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.text: list[str] = []
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None

    def flush(self, now: float) -> None:
        payload = data_of("\n".join(self._lines)) if self._lines else None
        if payload is not None:
            for choice in payload.get("choices") or ():
                if isinstance(choice, dict) and (content := (choice.get("delta") or {}).get("content")):
                    self.text.append(content)
            if isinstance(usage := payload.get("usage"), dict):
                self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
                details = usage.get("prompt_tokens_details") or {}
                self.cached_tokens = details.get("cached_tokens", self.cached_tokens)
        super().flush(now)


async def run_turn(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str],
                   turn: TurnRun) -> str:
    """Stream one turn into ``turn``; the answer's text (what the next turn appends)."""
    turn.trace_id, traceparent = new_traceparent()
    state = TurnState()
    started = time.perf_counter()
    try:
        async with client.stream("POST", url + ROUTE_CHAT, json=body, headers={**headers, "traceparent": traceparent}) as response:
            turn.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                turn.error = f"HTTP {response.status_code}"
                return ""
            async for line in response.aiter_lines():
                state.feed(line, time.perf_counter())
    except httpx.HTTPError as err:
        turn.error = f"broken stream: {type(err).__name__}"
        return ""
    state.flush(time.perf_counter())
    run = state.run(turn.trace_id, started, time.perf_counter())
    turn.ok, turn.error, turn.ttft_ms, turn.total_ms = run.ok, run.error, run.ttft_ms, run.total_ms
    turn.completion_tokens, turn.server = run.completion_tokens, run.server
    turn.prompt_tokens = state.prompt_tokens
    turn.cached_tokens = state.cached_tokens if state.cached_tokens is not None else run.server.get("cached_tokens")
    turn.replica = run.server.get("replica")
    turn.routing = run.server.get("routing")
    return "".join(state.text)


async def run_session(client: httpx.AsyncClient, url: str, workload: AgentWorkload, context: tuple[str, list],
                      session: str, arm: str, round_: int, *, delay_s: float,
                      sleep: Callable[[float], Awaitable[None]]) -> list[TurnRun]:
    """One agent: T turns, each on the whole history so far."""
    system, tools = context
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user_message(session, 1, workload.user_tokens)}]
    headers = {SESSION_HEADER: session} if workload.session_header else {}
    turns = []
    await sleep(delay_s)
    for n in range(1, workload.turns + 1):
        body = {"model": workload.model, "messages": list(messages), "tools": tools, "tool_choice": "none",
                "max_tokens": workload.max_tokens, "stream": True, "stream_options": {"include_usage": True}}
        if workload.ignore_eos:
            body["ignore_eos"] = True
        turn = TurnRun(arm, round_, session, n)
        try:
            answer = await run_turn(client, url, body, headers, turn)
        except Exception as err:  # one odd answer costs one turn, not the run
            turn.error, answer = f"client error: {type(err).__name__}", ""
        turns.append(turn)
        messages += [{"role": "assistant", "content": answer or "(no answer)"},
                     {"role": "user", "content": user_message(session, n + 1, workload.user_tokens)}]
        if n < workload.turns:
            await sleep(workload.think_s)
    return turns


async def run_batch(client: httpx.AsyncClient, url: str, workload: AgentWorkload, arm: str, round_: int, tag: str,
                    *, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> tuple[list[TurnRun], float]:
    """One arm's S sessions, interleaved, from a fresh context (one for the batch, or one each:
    ``workload.context``); its turns and wall time."""
    ids = session_ids(arm, workload.sessions, f"{tag}-r{round_}")
    batch = f"{tag}-{arm}-{round_}"

    def context_of(sid: str) -> tuple[str, list]:
        return shared_context(batch if workload.context == "shared" else f"{batch}-{sid}", workload.system_tokens)

    started = time.perf_counter()
    sessions = await asyncio.gather(*(
        run_session(client, url, workload, context_of(sid), sid, arm, round_, delay_s=i * workload.stagger_s, sleep=sleep)
        for i, sid in enumerate(ids)
    ))
    return [turn for turns in sessions for turn in turns], time.perf_counter() - started


def arm_order(compare: bool, rounds: int) -> list[tuple[int, str]]:
    """(round, arm) batches in order: the two arms alternate, their order flipping each round."""
    if not compare:
        return [(r, OURS) for r in range(rounds)]
    return [(r, arm) for r in range(rounds) for arm in ((PREFIX, DEFAULT) if r % 2 == 0 else (DEFAULT, PREFIX))]


async def bench_agent(url: str, workload: AgentWorkload, *, api_key: str | None = None, rounds: int = 2,
                      compare: bool = False, quiet_s: float = 2.0, transport: httpx.AsyncBaseTransport | None = None,
                      sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                      on_batch: Callable[[int, str], None] | None = None) -> dict[str, Any]:
    """``{"batches": [{"round", "arm", "wall_s"}], "turns": [TurnRun…]}`` for the run."""
    from serve_app.bench.client import Side

    tag = secrets.token_hex(3)  # this run's ids and contexts: nothing cached by an earlier run
    batches, turns = [], []
    async with side_clients([Side("agent", url, workload.model, api_key)], workload.sessions, transport) as clients:
        for round_, arm in arm_order(compare, rounds):
            await sleep(quiet_s)
            if on_batch:
                on_batch(round_, arm)
            runs, wall_s = await run_batch(clients["agent"], url, workload, arm, round_, tag, sleep=sleep)
            batches.append({"round": round_, "arm": arm, "wall_s": wall_s})
            turns += runs
    return {"batches": batches, "turns": [asdict(turn) for turn in turns]}

"""Kill a model replica's vLLM engine core during streams, and time the way back.

``engine_kill`` (one replica): every in-flight stream ends with our ``engine_unavailable`` error
event and ``[DONE]`` (none hangs, none gets vLLM's own words; with no other replica to resume on,
the resume window ends first); new requests get a 503 with a short ``Retry-After``
(``engine_unavailable`` from the dead replica, then ``model_recovering``, or a wait in Serve's
queue) until the replacement replica serves; ``/health`` says ``recovering``, not ``failed``; the
routers never import vLLM.

``engine_kill_resumed``: 8 streams of one greedy prompt, in turn a chat, a chat thinking with a
tool list and a Responses stream (``KINDS``), run where an uninterrupted run of each
ran (the request router keeps a shared prefix on one replica), whose engine core is then killed;
they go on from another replica of the region, or — when that replica was the region's only one —
from a peer region (``router/resume.py``): every stream ends normally with its full length, its
text and reasoning the same as its kind's uninterrupted run's (no gap, no repeat at the seam), a
Responses stream's events numbered without a gap, and the pause at the seam is measured (the
longest wait between two chunks of each resumed stream), with where each resumed.
"""

import asyncio
from collections import Counter
import time
from typing import Any

from serve_app.faults import cluster
from serve_app.faults.scenarios import MODEL_DEPLOYMENT, _client, model_app
from serve_app.faults.traffic import HealthProbe, chat_body, count, post_chat, stream_chat, stream_typed, transitions

PROBE_TIMEOUT_S = 10.0
# The timeline ends after this many 200s in a row (3 s of probes), or this long after the first 200.
HEALTH_STEADY_PROBES, HEALTH_STEADY_TIMEOUT_S = 6, 30.0


async def engine_kill(
    url: str, key: str, app: str, *, streams: int = 8, max_tokens: int = 2000, recovery_timeout_s: float = 300
) -> dict[str, Any]:
    (replica, *_) = cluster.model_replicas(model_app(app), MODEL_DEPLOYMENT)
    routers = cluster.routers(app)
    async with _client(key, streams + 4) as client:
        probe = HealthProbe(client, url, period_s=0.5).start()
        started = asyncio.Event()
        running = [
            asyncio.create_task(stream_chat(client, url, chat_body(max_tokens), first_chunk=started, idle_timeout_s=60))
            for _ in range(streams)
        ]
        await asyncio.wait_for(started.wait(), 120)
        await asyncio.sleep(0.5)  # every stream is decoding
        killed_at = time.monotonic()
        killed_pid = cluster.kill_engine_core(replica)
        outcomes = await asyncio.gather(*running)
        streams_ended_s = time.monotonic() - killed_at
        answers: list[dict[str, Any]] = []
        back_after_s = None
        while time.monotonic() - killed_at < recovery_timeout_s:
            # A short timeout: what a new request gets now, not how long one can wait in a queue.
            sent_s = round(time.monotonic() - killed_at, 1)
            outcome = await post_chat(client, url, chat_body(4, stream=False), timeout_s=PROBE_TIMEOUT_S)
            answers.append({"sent_at_s": sent_s, "status": outcome.status,
                            "code": outcome.error_code or (outcome.ended if outcome.status is None else None),
                            "retry_after": outcome.retry_after})
            if outcome.status == 200:
                back_after_s = round(time.monotonic() - killed_at, 1)
                break
            await asyncio.sleep(1)
        # Each router replica (the integration session runs two) refreshes its own view of Serve's
        # status: the one that served the first 200 knew first, the others follow within a second.
        health_steady = await probe.until_steady(200, in_a_row=HEALTH_STEADY_PROBES, timeout_s=HEALTH_STEADY_TIMEOUT_S)
        await probe.stop()
    return {
        "engine_core_pid": killed_pid,
        "streams": streams,
        "streams_by_outcome": count(list(outcomes)),
        "streams_ended_after_s": round(streams_ended_s, 2),
        "first_200_after_s": back_after_s,
        "answers_meanwhile": transitions(answers, ("status", "code", "retry_after")),
        "health_timeline": probe.changes(),
        "health_steady": health_steady,  # /health back to 200 for every probe, after the first 200
        "routers_imported_vllm": any(r.imported_vllm() for r in routers),
    }


def greedy_body(max_tokens: int) -> dict[str, Any]:
    """A stream whose text is the same every run: greedy decoding (no seed: a CPU engine with
    prefix caching refuses seeds, and greedy needs none), its full length (and its usage)."""
    return {**chat_body(max_tokens), "temperature": 0}


def thinking_tools_body(max_tokens: int) -> dict[str, Any]:
    """A coding agent's stream: thinking on and a tool it may call; greedy, as ``greedy_body``."""
    tool = {"type": "function", "function": {"name": "edit_file", "description": "Replace a file's text.",
                                             "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}
    return {**greedy_body(max_tokens), "tools": [tool], "chat_template_kwargs": {"enable_thinking": True}}


def responses_body(max_tokens: int) -> dict[str, Any]:
    """The same prompt as a greedy Responses stream, to its full length (vLLM's ``ignore_eos``)."""
    chat = greedy_body(max_tokens)
    return {"model": chat["model"], "input": chat["messages"], "max_output_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}


# The kinds of stream the resume scenario runs, in turn: a plain chat, a chat that thinks with a
# tool list (its seam is in the reasoning), a Responses stream. Not Messages: Anthropic's API has
# no ignore_eos, and the local model ends every greedy answer after 3 tokens (its unit tests
# resume Messages streams on a fake engine, through vLLM's own Anthropic converter).
KINDS = ("chat", "chat thinking with tools", "responses")


def _kind_stream(client, url: str, kind: str, max_tokens: int, first: asyncio.Event | None = None):
    if kind == "responses":
        return stream_typed(client, url, kind, responses_body(max_tokens), first_chunk=first, idle_timeout_s=120)
    body = thinking_tools_body(max_tokens) if kind == "chat thinking with tools" else greedy_body(max_tokens)
    return stream_chat(client, url, body, first_chunk=first, idle_timeout_s=120)


async def engine_kill_resumed(url: str, key: str, app: str, *, streams: int = 8, max_tokens: int = 200) -> dict[str, Any]:
    """Each kind of stream (``KINDS``) in turn, each checked against an uninterrupted run of it."""
    running_replicas = cluster.model_replicas(model_app(app), MODEL_DEPLOYMENT)
    kinds = [KINDS[i % len(KINDS)] for i in range(streams)]
    async with _client(key, streams + 4) as client:
        references = {kind: await _kind_stream(client, url, kind, max_tokens) for kind in KINDS}  # uninterrupted
        # The replica the streams will run on: the one holding the prompt's prefix.
        (victim, *_) = [r for r in running_replicas if r.replica_id == references["chat"].replica] or running_replicas
        started = [asyncio.Event() for _ in range(streams)]
        running = [asyncio.create_task(_kind_stream(client, url, kind, max_tokens, first))
                   for kind, first in zip(kinds, started)]
        await asyncio.wait_for(asyncio.gather(*(first.wait() for first in started)), 120)
        await asyncio.sleep(0.5)  # every stream is decoding, with content on both sides of the seam
        killed_pid = cluster.kill_engine_core(victim)
        outcomes = await asyncio.gather(*running)
    resumed = [o for o in outcomes if o.resumes]
    pauses = sorted(o.max_gap_s * 1000 for o in resumed)
    same = [(o.text, o.reasoning) == (references[kind].text, references[kind].reasoning) for kind, o in zip(kinds, outcomes)]
    by_kind = {kind: {"streams": kinds.count(kind), "reference_tokens": references[kind].completion_tokens,
                      "reference_reasoning_chars": len(references[kind].reasoning),
                      "same_as_uninterrupted": sum(s for k, s in zip(kinds, same) if k == kind),
                      "seam_pause_ms_max": round(max((o.max_gap_s * 1000 for k, o in zip(kinds, outcomes)
                                                      if k == kind and o.resumes), default=0), 1)}
               for kind in KINDS}
    return {
        "engine_core_pid": killed_pid,
        "replicas": len(running_replicas),
        "killed_the_reference_replica": victim.replica_id == references["chat"].replica,
        "streams": streams,
        "streams_by_outcome": count(list(outcomes)),
        "resumed": len(resumed),
        "resumed_in": dict(Counter(o.resumed_in or "this region" for o in resumed)),
        # Killed half-way: each stream had content before the kill and after its seam.
        "killed_mid_stream": sum(0 < o.chunks_before_gap < o.chunks for o in resumed),
        # Every token, by the stream's own usage (each kind runs to its limit: ignore_eos).
        "full_length": sum(o.completion_tokens == max_tokens for o in outcomes),
        "same_text_as_uninterrupted": sum(same),
        # A Responses stream's events numbered without a gap or a repeat across the seam.
        "responses_numbered": sum(bool(o.numbered) for kind, o in zip(kinds, outcomes) if kind == "responses"),
        "by_kind": by_kind,
        "seam_pause_ms": {"p50": _rank(pauses, 50), "p95": _rank(pauses, 95), "max": pauses[-1] if pauses else None},
    }


def _rank(values: list[float], q: float) -> float | None:
    from serve_app.bench.stats import percentile

    return round(percentile(values, q), 1) if values else None

"""Kill a model replica's vLLM engine core during streams, and time the way back.

``engine_kill`` (one replica): every in-flight stream ends with our ``engine_unavailable`` error
event and ``[DONE]`` (none hangs, none gets vLLM's own words; with no other replica to resume on,
the resume window ends first); new requests get a 503 with a short ``Retry-After``
(``engine_unavailable`` from the dead replica, then ``model_recovering``, or a wait in Serve's
queue) until the replacement replica serves; ``/health`` says ``recovering``, not ``failed``; the
routers never import vLLM.

``engine_kill_resumed``: 8 streams of one greedy prompt run where an uninterrupted run of it ran
(the request router keeps a shared prefix on one replica), whose engine core is then killed; they
go on from another replica of the region, or — when that replica was the region's only one — from
a peer region (``router/resume.py``): every stream ends normally with its full length, its text the
same as the uninterrupted run's (no gap, no repeat at the seam), and the pause at the seam is
measured (the longest wait between two chunks of each resumed stream), with where each resumed.
"""

import asyncio
from collections import Counter
import time
from typing import Any

from serve_app.faults import cluster
from serve_app.faults.scenarios import MODEL_DEPLOYMENT, _client, model_app
from serve_app.faults.traffic import HealthProbe, chat_body, count, post_chat, stream_chat, transitions

PROBE_TIMEOUT_S = 10.0


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
        await asyncio.sleep(1)
        await probe.stop()
    return {
        "engine_core_pid": killed_pid,
        "streams": streams,
        "streams_by_outcome": count(list(outcomes)),
        "streams_ended_after_s": round(streams_ended_s, 2),
        "first_200_after_s": back_after_s,
        "answers_meanwhile": transitions(answers, ("status", "code", "retry_after")),
        "health_timeline": probe.changes(),
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


async def engine_kill_resumed(url: str, key: str, app: str, *, streams: int = 8, max_tokens: int = 200) -> dict[str, Any]:
    """Half the streams plain, half thinking with a tool list (their seam is in the reasoning)."""
    running_replicas = cluster.model_replicas(model_app(app), MODEL_DEPLOYMENT)
    bodies = [greedy_body(max_tokens), thinking_tools_body(max_tokens)]
    async with _client(key, streams + 4) as client:
        references = [await stream_chat(client, url, body, idle_timeout_s=120) for body in bodies]  # uninterrupted
        # The replica the streams will run on: the one holding the prompt's prefix.
        (victim, *_) = [r for r in running_replicas if r.replica_id == references[0].replica] or running_replicas
        started = [asyncio.Event() for _ in range(streams)]
        running = [
            asyncio.create_task(stream_chat(client, url, bodies[i % 2], first_chunk=first, idle_timeout_s=120))
            for i, first in enumerate(started)
        ]
        await asyncio.wait_for(asyncio.gather(*(first.wait() for first in started)), 120)
        await asyncio.sleep(0.5)  # every stream is decoding, with content on both sides of the seam
        killed_pid = cluster.kill_engine_core(victim)
        outcomes = await asyncio.gather(*running)
    resumed = [o for o in outcomes if o.resumes]
    pauses = sorted(o.max_gap_s * 1000 for o in resumed)
    thinking_pauses = sorted(o.max_gap_s * 1000 for o in outcomes[1::2] if o.resumes)
    same = [(o.text, o.reasoning) == (references[i % 2].text, references[i % 2].reasoning) for i, o in enumerate(outcomes)]
    return {
        "engine_core_pid": killed_pid,
        "replicas": len(running_replicas),
        "killed_the_reference_replica": victim.replica_id == references[0].replica,
        "streams": streams,
        "streams_by_outcome": count(list(outcomes)),
        "resumed": len(resumed),
        "resumed_in": dict(Counter(o.resumed_in or "this region" for o in resumed)),
        # Killed half-way: each stream had content before the kill and after its seam.
        "killed_mid_stream": sum(0 < o.chunks_before_gap < o.chunks for o in resumed),
        # Every token, by the stream's own usage (a seam's chunk may carry text the broken one owed).
        "full_length": sum(o.completion_tokens == max_tokens for o in outcomes),
        "reference_chunks": [r.chunks for r in references],
        # The thinking stream's reference: its answer is reasoning (random weights never close </think>).
        "reference_reasoning_chars": len(references[1].reasoning),
        "same_text_as_uninterrupted": sum(same),
        "thinking_same_as_uninterrupted": sum(same[1::2]),
        "seam_pause_ms": {"p50": _rank(pauses, 50), "p95": _rank(pauses, 95), "max": pauses[-1] if pauses else None},
        # The thinking streams' prompts are longer (the tool list in the template): a longer prefill.
        "thinking_seam_pause_ms": {"p50": _rank(thinking_pauses, 50), "max": thinking_pauses[-1] if thinking_pauses else None},
    }


def _rank(values: list[float], q: float) -> float | None:
    from serve_app.bench.stats import percentile

    return round(percentile(values, q), 1) if values else None

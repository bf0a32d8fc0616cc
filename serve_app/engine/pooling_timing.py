"""Engine timing of a pooling request (embeddings): its queue and its compute, from vLLM's own
per-request stats, as the trailer carries them for generation.

vLLM's per-request metrics (``--enable-per-request-metrics``) exist for generation only: its
``PoolingRequestOutput`` carries no timing, so an embedding's server time would all be
"network" in the trace. The engine does keep the numbers: the output processor's per-request
state holds a ``RequestStateStats`` (engine-core monotonic timestamps: queued, scheduled, first
"token", which for pooling is the finished forward pass), kept while stats are logged, as they
are by default. ``install`` wraps the output processor's ``add_request`` once per replica so
that each request added while a ``collect()`` is open hands over its stats object; the replica
reads it once vLLM has answered. Nothing is copied per step.

Several inputs in one request are several engine requests: the request's queue is from the
first input queued to the first scheduled, its inference from that to the last one finished.
"""

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from serve_app.wire.messages import EngineTiming

_COLLECTING: contextvars.ContextVar[list | None] = contextvars.ContextVar("serve_app_pooling_stats", default=None)


def install(engine: Any) -> None:
    """Wrap ``engine.output_processor.add_request`` (vLLM's ``AsyncLLM``) to hand each request's
    stats to the ``collect()`` open in the task that added it."""
    processor = engine.output_processor
    add_request = processor.add_request

    def collecting_add_request(request, *args, **kwargs):
        add_request(request, *args, **kwargs)
        collected = _COLLECTING.get()
        if collected is not None:
            state = processor.request_states.get(request.request_id)
            if state is not None and state.stats is not None:
                collected.append(state.stats)

    processor.add_request = collecting_add_request


@contextmanager
def collect() -> Iterator[list]:
    """The stats of every engine request added from this task (and tasks it starts) meanwhile."""
    collected: list = []
    token = _COLLECTING.set(collected)
    try:
        yield collected
    finally:
        _COLLECTING.reset(token)


def timing(stats: list) -> EngineTiming:
    """Queue (first queued → first scheduled) and inference (→ last finished) of the requests
    whose ``stats`` these are, in ms; unknown parts None (a timestamp vLLM did not set is 0)."""
    queued = [s.queued_ts for s in stats if s.queued_ts > 0]
    scheduled = [s.scheduled_ts for s in stats if s.scheduled_ts > 0]
    finished = [s.last_token_ts for s in stats if s.last_token_ts > 0]
    queue_ms = (min(scheduled) - min(queued)) * 1000 if queued and scheduled else None
    prefill_ms = (max(finished) - min(scheduled)) * 1000 if scheduled and finished else None
    return EngineTiming(queue_ms=queue_ms, prefill_ms=prefill_ms)

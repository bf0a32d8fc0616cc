"""One request's telemetry around the router's pipeline: its record, its SERVER span (and the
failover span when it is forwarded), closed exactly once, with the metrics.

It wraps the pipeline rather than running through it: the pipeline's loop runs each stage inside
``stage``, which times it and, once it ran (raised or not), reads what it learned off the
request's context into ``record`` (plain data: timings, model, routing). The rest comes from the
replica's trailer (``note_trailer``) and the relay, which needs the numbers for the response it
writes (``finish``, ``metadata``, ``server_timing``). The spans open when the request arrives and
are drawn, with the metrics, from the one ``Split`` when it is over (``close``), whatever way it
ended.
"""

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

from serve_app import routing
from serve_app.telemetry import tracing
from serve_app.telemetry.metrics import observe
from serve_app.telemetry.timing import RequestRecord, Split, pg_metadata, server_timing_header
from serve_app.wire.messages import ENGINE_UNAVAILABLE, Accepted, StreamOpen, Trailer

# Every JSON answer's trace id (an error's too: its body has no pg_metadata), to quote to an operator.
TRACE_ID_HEADER = "x-pg-trace-id"


class RequestTelemetry:
    def __init__(self, route: str, headers: Mapping[str, str], *, region: str, replica: str):
        self.record = RequestRecord.begin(route, region=region, replica=replica)
        self.trace = tracing.start_server_span(self.record, headers)
        self.split: Split | None = None
        self._failover_span = None

    @property
    def trace_id(self) -> str:
        return self.trace.trace_id

    @contextmanager
    def stage(self, name: str, ctx: Any) -> Iterator[None]:
        """Around one stage of the pipeline (``ctx``: its ``router.context.Context``)."""
        try:
            with self.record.measure_auth() if name == "authenticate" else nullcontext():
                yield
        finally:
            if (learned := _LEARNED.get(name)) is not None:
                learned(self.record, ctx)

    def note_trailer(self, trailer: Trailer | None, cached_tokens: int | None = None,
                     engine_ms: float | None = None) -> None:
        """What the replica reported once the engine was done with the request; ``cached_tokens``:
        of the customer's prompt (a resumed stream's first call's), else the replica's count;
        ``engine_ms``: the call's time since its head, counted as inference when its engine died
        (``engine_unavailable``) and reported no timing — not for a stream its client left (noted
        after the clock stopped) nor a peer's continuation (no head here)."""
        if trailer is not None:
            timing = trailer.timing
            # Only while the clock runs: noted after it stopped (the client left first), the call's
            # time since its head runs past the request's end and would raise its server time.
            if trailer.error_code == ENGINE_UNAVAILABLE and engine_ms is not None and self.record.server_ms is None \
                    and all(getattr(timing, name, None) is None for name in ("queue_ms", "prefill_ms", "decode_ms")):
                self.record.note_failed_engine(engine_ms)
            self.record.note_engine(
                trailer.timing, usage=trailer.usage, finish_reasons=list(trailer.finish_reasons),
                replica=trailer.replica,
            )
            self.record.cached_tokens = trailer.generated.cached_tokens if cached_tokens is None else cached_tokens

    def note_engine_untouched(self) -> None:
        """The replica answered with nothing handled by its engine (no trailer: vLLM refused the
        body after the replica's ``Accepted`` head, a prompt over the context, a grammar it
        cannot build): the replica's own work, network, as the same refusal of a stream (which
        comes before any head) is — not Serve's queue and "unreported" inference."""
        self.record.head_ms = None

    def finish(self, status: int, error_type: str | None = None) -> Split:
        """Stop the server clock (its first call only; a later one may still correct the status)."""
        self.split = self.record.finish(status, error_type)
        return self.split

    def metadata(self) -> dict[str, Any]:
        """The client-visible timing (``pg_metadata``) of a finished request."""
        return pg_metadata(self.record, self.split or self.record.finish(), self.trace_id)

    def server_timing(self) -> str:
        return server_timing_header(self.split or self.record.finish())

    def headers(self) -> dict[str, str]:
        """A finished JSON answer's timing and trace id, errors' too (``pg_metadata`` is on a
        success's body only): ``Server-Timing`` and ``TRACE_ID_HEADER``."""
        return {"Server-Timing": self.server_timing(), **self.trace_headers()}

    def trace_headers(self) -> dict[str, str]:
        """``TRACE_ID_HEADER`` alone: a stream's head, written before its timing is known (its
        ``pg_metadata`` comes last, and never when the stream fails)."""
        return {TRACE_ID_HEADER: self.trace_id}

    # --- failover ------------------------------------------------------------------------------
    def start_failover(self, reason: str) -> dict[str, str]:
        """Open the ``failover`` CLIENT span; the headers carry it to the peer (one trace)."""
        self.record.failover_reason = reason
        if self.record.head_ms is not None:  # the local engine's part ends here (``compute_split``)
            self.record.head_end_ms = self.record.elapsed_ms()
        self._failover_span = tracing.start_failover_span(self.trace, reason)
        return tracing.propagation_headers(self._failover_span)

    def note_failover(self, attempts: list, region: str | None) -> None:
        """What the forwarder did: every attempt, and the region that answered (if any)."""
        self.record.failover_region = region
        tracing.note_failover_attempts(self._failover_span, attempts, region)

    # --- resume --------------------------------------------------------------------------------
    def start_resume(self, cause: str, tokens: int):
        """The ``resume`` span of one seam: the engine failed after ``tokens`` tokens."""
        return tracing.start_resume_span(self.trace, cause, tokens)

    def resume_propagation(self, span) -> dict[str, str]:
        """The headers that make a peer region's continuation a child of the ``resume`` span."""
        return tracing.propagation_headers(span)

    def note_not_resumed(self) -> None:
        """The engine failed mid-stream and the stream was not resumed at all (a surface or body
        that cannot be, no tokens to continue from, its resumes spent): ``gave_up``, no span."""
        self.record.resumes_given_up += 1

    def end_resume(self, span, resumed: bool, region: str | None = None) -> None:
        """``region``: the peer region whose replica continued the stream (None: this region)."""
        if resumed:
            self.record.resumes += 1
            self.record.resumed_in = region or self.record.resumed_in
        else:
            self.record.resumes_given_up += 1
        tracing.end_resume_span(span, resumed, region)

    # --- the end -------------------------------------------------------------------------------
    def close(self, status: int, error_type: str | None = None) -> None:
        """End every span and record the metrics; only the first call does anything."""
        if self.trace.split is not None:
            return
        split = self.finish(status, error_type)
        if self._failover_span is not None and self._failover_span.is_recording():
            tracing.end_failover_span(self._failover_span, self.record, split)
        tracing.finish_request_spans(self.trace, split)
        observe(self.record, split)


# What a stage learned, read off the context once it ran.
def _parsed(record: RequestRecord, ctx: Any) -> None:
    record.note_request(ctx.body)  # alias, stream flag, sampling numbers; no text (before resolve renames)
    record.continuing = getattr(ctx, "taken_over", None) is not None


def _resolved(record: RequestRecord, ctx: Any) -> None:
    record.model = ctx.model


def _called(record: RequestRecord, ctx: Any) -> None:
    """How the request router chose the replica, the call's wait for its first item less the
    replica's own work before it (Serve's queue and its two hops), and when a head the engine
    works on after came (its time is inference even if the engine never reports it)."""
    record.note_routing(routing.take_decision(ctx.id))
    call = ctx.call
    if call is not None and call.head is not None and call.waited_ms is not None:
        record.note_router_queue(call.waited_ms - (call.head.replica_ms or 0.0))
    since_head = getattr(call, "since_head_ms", None)
    if isinstance(getattr(call, "head", None), (StreamOpen, Accepted)) and since_head is not None:
        record.note_head(record.elapsed_ms() - since_head)


_LEARNED: dict[str, Callable[[RequestRecord, Any], None]] = {"parse": _parsed, "resolve": _resolved, "call": _called}

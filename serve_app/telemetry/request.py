"""One request's telemetry around the router's pipeline: its record, its SERVER span (and the
failover span when it is forwarded), closed exactly once, with the metrics.

The pipeline's stages write what they learn into ``record`` (plain data: timings, model, engine
report); this object opens the spans when the request arrives and draws them, with the metrics,
from the one ``Split`` when the request is over (``close``), whatever way it ended.
"""

from collections.abc import Mapping
from typing import Any

from serve_app.telemetry import tracing
from serve_app.telemetry.metrics import observe
from serve_app.telemetry.timing import RequestRecord, Split, pg_metadata, server_timing_header
from serve_app.wire.messages import Trailer


class RequestTelemetry:
    def __init__(self, route: str, headers: Mapping[str, str], *, region: str, replica: str):
        self.record = RequestRecord.begin(route, region=region, replica=replica)
        self.trace = tracing.start_server_span(self.record, headers)
        self.split: Split | None = None
        self._failover_span = None

    @property
    def trace_id(self) -> str:
        return self.trace.trace_id

    def note_trailer(self, trailer: Trailer | None) -> None:
        """What the replica reported once the engine was done with the request."""
        if trailer is not None:
            self.record.note_engine(
                trailer.timing, usage=trailer.usage, finish_reasons=list(trailer.finish_reasons),
                replica=trailer.replica,
            )
            self.record.cached_tokens = trailer.generated.cached_tokens  # the replica's count, every surface

    def finish(self, status: int, error_type: str | None = None) -> Split:
        """Stop the server clock (its first call only; a later one may still correct the status)."""
        self.split = self.record.finish(status, error_type)
        return self.split

    def metadata(self) -> dict[str, Any]:
        """The client-visible timing (``pg_metadata``) of a finished request."""
        return pg_metadata(self.record, self.split or self.record.finish(), self.trace_id)

    def server_timing(self) -> str:
        return server_timing_header(self.split or self.record.finish())

    # --- failover ------------------------------------------------------------------------------
    def start_failover(self, reason: str) -> dict[str, str]:
        """Open the ``failover`` CLIENT span; the headers carry it to the peer (one trace)."""
        self.record.failover_reason = reason
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

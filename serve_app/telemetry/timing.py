"""Where a request's time went: the network / queue / inference split, with no OpenTelemetry in it.

The router owns the clock. ``RequestRecord.begin`` takes ``time.time_ns()`` (the wall-clock start
every span is laid out from) and a ``perf_counter_ns()`` origin; every duration the router measures
afterwards is monotonic. The engine's durations (``queue_ms``, ``prefill_ms``, ``decode_ms``) are
differences of vLLM engine-core monotonic timestamps (``--enable-per-request-metrics``), so no two
clocks are ever subtracted from each other.

Partition of the server time S (receipt → last byte, router clock)::

    queue      Q = Serve's queue + engine queue:
                   handle call → head, less the replica's own work before the head (router clock:
                   waiting for a free replica slot, plus the handle's two hops), and
                   engine arrival → first scheduled                                (engine)
    inference  I = prefill + decode = first scheduled → last token (engine)
    network    N = S − Q − I: everything else — router work (auth, body, rate limit), the
                   replica's validation and prompt rendering, SSE transport to the client

so N + Q + I = S exactly. A replica that took the request (its head opened a stream or accepted
it) but reported no engine timing — the client left (vLLM reports only on a finished request), or
``n`` > 1 (no per-request metrics) — still ran it: the time since its head is inference, on the
router's clock (``unreported_engine_ms``), and Serve's queue stays in Q.

Spans and ``pg_metadata`` are drawn from one ``Split``, which keeps the trace, the
``Server-Timing`` header and the client-visible metadata consistent to the digit.
"""

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from serve_app.surfaces import BY_ROUTE

# Sampling and length knobs a trace may carry: numbers and flags only, never text.
_REQUEST_PARAMS = {
    "max_tokens": "gen_ai.request.max_tokens",
    "max_completion_tokens": "gen_ai.request.max_tokens",
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "top_k": "gen_ai.request.top_k",
    "frequency_penalty": "gen_ai.request.frequency_penalty",
    "presence_penalty": "gen_ai.request.presence_penalty",
    "seed": "gen_ai.request.seed",
    "n": "gen_ai.request.choice.count",
}
MAX_ALIAS_CHARS = 128


def _ms_since(origin_ns: int) -> float:
    return (time.perf_counter_ns() - origin_ns) / 1e6


@dataclass
class RequestRecord:
    """Everything the router learns about one request; the single input to spans, metrics, headers.

    Offsets (``*_start_ms``) and durations are in milliseconds on the router's monotonic clock,
    measured from receipt. Engine fields come from the model replica (``note_engine``). Nothing
    here holds prompt or completion text, or the caller's credential.
    """

    route: str
    region: str
    replica: str  # the router replica (Serve replica tag) that took the request
    start_ns: int = field(default_factory=time.time_ns)  # wall clock at receipt: span start
    start_perf_ns: int = field(default_factory=time.perf_counter_ns)  # monotonic origin
    method: str = "POST"
    alias: str | None = None  # the model name the caller sent (truncated)
    model: str | None = None  # the canonical id it resolved to; None if it did not resolve
    stream: bool = False
    request_params: dict[str, int | float] = field(default_factory=dict)  # gen_ai.request.* attrs
    status: int = 200
    error_type: str | None = None  # short machine code (e.g. "overloaded"), never a message
    auth_start_ms: float | None = None
    auth_ms: float | None = None
    first_chunk_ms: float | None = None  # receipt → the stream's first output relayed (router clock)
    router_queue_ms: float | None = None  # Serve's queue for a replica slot (+ handle hops)
    # Receipt → the head of a call whose engine then works (a stream's, or an accepted non-stream
    # request's): from there on the time is the engine's, whether or not it reports its timing.
    head_ms: float | None = None
    # Receipt → the failover to peers that followed that head (its engine gone or unreachable):
    # the peers' connects and refusals after it are network, not the engine's.
    head_end_ms: float | None = None
    queue_ms: float | None = None
    prefill_ms: float | None = None
    decode_ms: float | None = None
    # A stream's attempts on engines that failed without reporting timing (a dying engine sends no
    # metrics): the router's own measure of each, head to the broken trailer, counted as inference.
    failed_engine_ms: float = 0.0
    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens the engine served from its prefix cache
    finish_reasons: list[str] = field(default_factory=list)
    response_id: str | None = None  # chatcmpl-… / cmpl-…
    model_replica: str | None = None  # the model replica (Serve replica tag) that ran inference
    failover_reason: str | None = None  # why the request was forwarded to a peer region
    failover_region: str | None = None  # the peer region that answered it (None: none did)
    # The region whose router forwarded (or resumed) this request here; None: this region's client sent it.
    forwarded_by: str | None = None
    resumes: int = 0  # times its stream was resumed on another replica after its engine failed
    resumes_given_up: int = 0  # engine failures mid-stream it could not be resumed from
    resumed_in: str | None = None  # the peer region that continued its stream, if one did
    # A stream a peer region's router asked this one to continue: its usage is the whole answer's,
    # which the region where the stream began counts (metrics.py: its tokens are not counted here).
    continuing: bool = False
    # The model deployment's request router's decision (serve_app.routing.decisions.Decision:
    # policy, reason, replica, matched_chars, prompt_chars), None when it made none.
    routing: Any = None
    server_ms: float | None = None  # set once, by finish()

    @classmethod
    def begin(cls, route: str, *, region: str, replica: str, method: str = "POST") -> "RequestRecord":
        """Call first thing when the request arrives."""
        return cls(route=route, region=region, replica=replica, method=method)

    @property
    def operation(self) -> str:
        surface = BY_ROUTE.get(self.route)
        return surface.operation if surface is not None else "unknown"

    def elapsed_ms(self) -> float:
        return _ms_since(self.start_perf_ns)

    @contextmanager
    def measure_auth(self) -> Iterator[None]:
        """``with record.measure_auth(): caller = authenticate(...)`` — kept even if it raises."""
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            self.auth_start_ms = (start - self.start_perf_ns) / 1e6
            self.auth_ms = _ms_since(start)

    def note_request(self, body: Mapping[str, Any], *, model: str | None = None) -> None:
        """The alias, stream flag and numeric sampling parameters of a body; never its text.

        Call before the body's ``model`` is rewritten to the canonical id, or pass the alias-free
        body and the caller's name separately by setting ``alias`` yourself.
        """
        name = body.get("model")
        if isinstance(name, str):
            self.alias = name[:MAX_ALIAS_CHARS]
        self.stream = body.get("stream") is True
        for key, attribute in _REQUEST_PARAMS.items():
            value = body.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.request_params[attribute] = value
        if model is not None:
            self.model = model

    def note_engine(
        self,
        engine_timing: Mapping[str, float | None] | None,
        usage: Mapping[str, Any] | None = None,
        finish_reasons: list[str] | None = None,
        response_id: str | None = None,
        replica: str | None = None,
    ) -> None:
        """What the model replica reports: ``{"queue_ms", "prefill_ms", "decode_ms"}`` (values may
        be None), OpenAI ``usage`` (``prompt_tokens``/``completion_tokens``), finish reasons, the
        response id and its own replica tag."""
        if engine_timing is not None and not isinstance(engine_timing, Mapping):  # the wire's EngineTiming
            engine_timing = {name: getattr(engine_timing, name) for name in ("queue_ms", "prefill_ms", "decode_ms")}
        if engine_timing and any(value is not None for value in engine_timing.values()):  # else it says nothing
            queue, prefill, decode = (_non_negative(engine_timing.get(name))
                                      for name in ("queue_ms", "prefill_ms", "decode_ms"))
            if self.resumes:  # a continuation's: its time adds to the attempts' before it
                # Its prefill re-reads the prompt mid-answer: inference, not the answer's first token.
                self.queue_ms = _sum(self.queue_ms, queue)
                self.decode_ms = _sum(self.decode_ms, _sum(prefill, decode))
            else:
                self.queue_ms, self.prefill_ms, self.decode_ms = queue, prefill, decode
        if usage:
            self.input_tokens = _int_or_none(usage.get("prompt_tokens", usage.get("input_tokens")))
            self.output_tokens = _int_or_none(
                usage.get("completion_tokens", usage.get("output_tokens"))
            )
        if finish_reasons is not None:
            self.finish_reasons = [str(reason) for reason in finish_reasons if reason is not None]
        if response_id is not None:
            self.response_id = response_id
        if replica is not None:
            self.model_replica = replica

    def note_failed_engine(self, engine_ms: float) -> None:
        """An attempt whose engine failed and reported no timing ran ``engine_ms`` (head → break)."""
        self.failed_engine_ms += max(0.0, engine_ms)

    def note_routing(self, decision: Any) -> None:
        """How the request router chose the model replica (``routing.take_decision``'s; None:
        it published none, and an earlier one is kept)."""
        if decision is not None:
            self.routing = decision

    def note_router_queue(self, waited_ms: float) -> None:
        """Handle call → head, less the replica's own time before the head (router clock)."""
        self.router_queue_ms = max(0.0, waited_ms)

    def note_head(self, at_ms: float) -> None:
        """The replica's head came ``at_ms`` after receipt (router clock) and its engine works on."""
        self.head_ms = max(0.0, at_ms)

    def mark_first_chunk(self) -> None:
        """Call when the stream's first output is handed to the client (TTFT as the router sees
        it): its first bytes, or a Responses stream's first event after its opening ones
        (``router/relay.FirstOutput``)."""
        if self.first_chunk_ms is None:
            self.first_chunk_ms = self.elapsed_ms()

    def finish(self, status: int | None = None, error_type: str | None = None) -> "Split":
        """Stop the server clock (first call only) and return the split.

        For a stream call it after the last engine event, right before writing ``pg_metadata`` and
        ``[DONE]``; for a JSON response right before building it (the header needs the numbers).
        """
        if status is not None:
            self.status = status
        if error_type is not None:
            self.error_type = error_type
        if self.server_ms is None:
            self.server_ms = self.elapsed_ms()
        return compute_split(self)


@dataclass(frozen=True)
class Split:
    """The server time, partitioned. ``network_ms + queue_ms + inference_ms == server_ms``."""

    server_ms: float
    network_ms: float
    queue_ms: float
    inference_ms: float
    prefill_ms: float | None
    decode_ms: float | None
    # False: no replica took it and no engine reported (an error before the engine, a request
    # forwarded to a peer) → all network. True: queue and inference are drawn.
    engine: bool
    clamped: bool = False  # engine time exceeded the router's measurement; server_ms was raised
    ttft_ms: float | None = None  # server-side time to first token (see compute_split)
    tokens_per_s: float | None = None  # output tokens / inference time (scheduled → last token)
    time_per_output_token_ms: float | None = None  # decode / (output tokens − 1)
    # Of inference_ms: head → end on the router's clock, for a replica that reported no timing.
    unreported_engine_ms: float = 0.0


def compute_split(record: RequestRecord) -> Split:
    """Partition ``record.server_ms`` (or the time elapsed so far) into network/queue/inference.

    Engine parts that are unknown count as zero. A replica that took the request and reported no
    timing ran it from its head on (``unreported_engine_ms``: inference); with no head and no
    report (an error before the engine, a request a peer region served) network is the whole span.
    Engine time never exceeds the router's (it happens inside it); if rounding or a late
    ``finish`` ever made it so, network becomes 0 and the server time is raised to match, so the
    sum stays exact (``clamped``).

    ``ttft_ms``: the router-observed time to the first streamed output when there is one (a
    stream); otherwise ``server − decode`` (everything up to the first token, plus the short tail).
    A peer region's continuation of a stream (``continuing``) has none, nor a rate: its output
    tokens are the whole answer's, its time only the continuation's, its first byte not the
    answer's first token.
    """
    server = record.server_ms if record.server_ms is not None else record.elapsed_ms()
    reported = any(v is not None for v in (record.queue_ms, record.prefill_ms, record.decode_ms)) or bool(
        record.failed_engine_ms)
    # A request a peer served ran in its engine (its spans have it): here it is all network. One
    # that no peer took after a local head (its replica gone) ran in ours until then.
    took = record.head_ms is not None and record.failover_region is None
    engine_end = server if record.head_end_ms is None else min(server, record.head_end_ms)
    unreported = 0.0 if reported or not took else max(0.0, engine_end - record.head_ms)
    engine = reported or took
    # Without a replica's head there is no queue span to hold Serve's queue: it stays in network.
    queue = (record.queue_ms or 0.0) + (record.router_queue_ms or 0.0 if engine else 0.0)
    inference = (record.prefill_ms or 0.0) + (record.decode_ms or 0.0) + record.failed_engine_ms + unreported
    clamped = False
    if queue + inference > server:
        server, clamped = queue + inference, True
    network = server - queue - inference

    ttft = record.first_chunk_ms
    if ttft is None and record.prefill_ms is not None:
        ttft = server - (record.decode_ms or 0.0)
    tokens_per_s = None  # the engine's own rate: not over time it did not report
    if record.output_tokens and inference > 0 and not unreported:
        tokens_per_s = record.output_tokens / (inference / 1000)
    tpot = None  # not for a resumed stream: its decode holds a re-prefill, and a failed engine's time
    if record.decode_ms is not None and record.output_tokens and record.output_tokens > 1 and not (
            record.resumes or record.failed_engine_ms):
        tpot = record.decode_ms / (record.output_tokens - 1)
    if record.continuing:
        ttft = tokens_per_s = tpot = None
    return Split(
        server_ms=server,
        network_ms=network,
        queue_ms=queue,
        inference_ms=inference,
        prefill_ms=record.prefill_ms,
        decode_ms=record.decode_ms,
        engine=engine,
        clamped=clamped,
        ttft_ms=ttft,
        tokens_per_s=tokens_per_s,
        time_per_output_token_ms=tpot,
        unreported_engine_ms=unreported,
    )


def pg_metadata(record: RequestRecord, split: Split, trace_id: str | None) -> dict[str, Any]:
    """The client-visible timing, identical in the final SSE event and a JSON body's ``pg_metadata``.

    ``inference_ttft_ms`` is the engine's prefill (first scheduled → first token);
    ``inference_total_ms`` is prefill + decode (first scheduled → last token), or, when the engine
    reported no timing, the time since the replica's head. ``inference_ttft_ms`` is None then;
    ``queue_ms`` and ``inference_total_ms`` are None when no replica took the request.
    ``network_ms + queue_ms + inference_total_ms == server_ms``.
    ``replica`` is the model replica that ran the request (None if it never reached one),
    ``router_replica`` the router replica that answered; ``cached_tokens`` (when the engine
    reported) the prompt tokens its prefix cache served; ``routing`` (when the model's request
    router decided) how that replica was chosen: its ``policy`` and ``reason``
    (``serve_app.routing.policy``: session, prefix, least_loaded, shed, fallback, default).
    """
    metadata = {
        "inference_ttft_ms": _ms(split.prefill_ms),
        "inference_total_ms": _ms(split.inference_ms) if split.engine else None,
        "queue_ms": _ms(split.queue_ms) if split.engine else None,
        "network_ms": _ms(split.network_ms),
        "server_ms": _ms(split.server_ms),
        "region": record.region,
        "replica": record.model_replica,
        "router_replica": record.replica,
        "model": record.model,
        "alias": record.alias,
        "trace_id": trace_id,
    }
    if record.cached_tokens is not None:  # of the prompt's tokens, those the prefix cache held
        metadata["cached_tokens"] = record.cached_tokens
    if record.routing is not None:
        metadata["routing"] = {"policy": record.routing.policy, "reason": record.routing.reason}
    if record.resumes:  # the stream went on from another replica after its engine failed
        metadata["resumes"] = record.resumes
        if record.resumed_in is not None:  # in a peer region
            metadata["resumed_in"] = record.resumed_in
    return metadata


def server_timing_header(split: Split) -> str:
    """W3C ``Server-Timing``: ``network;dur=12.3, queue;dur=0.4, inference;dur=85.1, total;dur=97.8``."""
    parts = [("network", split.network_ms)]
    if split.engine:
        parts += [("queue", split.queue_ms), ("inference", split.inference_ms)]
    parts.append(("total", split.server_ms))
    return ", ".join(f"{name};dur={duration:.3f}" for name, duration in parts)


def parse_server_timing(header: str) -> dict[str, float]:
    """``{"network": 12.3, ...}`` from a ``Server-Timing`` value (clients and tests)."""
    durations: dict[str, float] = {}
    for metric in header.split(","):
        name, *params = (part.strip() for part in metric.split(";"))
        for param in params:
            key, _, value = param.partition("=")
            if key.strip() == "dur":
                durations[name] = float(value)
    return durations


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _non_negative(value: Any) -> float | None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return max(float(value), 0.0)


def _sum(a: float | None, b: float | None) -> float | None:
    """Two durations added, either unknown counting as zero; None when both are."""
    return None if a is None and b is None else (a or 0.0) + (b or 0.0)


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None

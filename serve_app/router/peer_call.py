"""A resumed stream's continuation in a peer region, read as the relay reads a replica's call.

When no replica of this region can continue a stream whose engine failed (``resume.py``), a peer
region's router does: it gets the request with the tokens generated so far (``polargrid_resume``), runs
it on one of its replicas as a resume, and streams the continuation back. This router relays
that stream's chunks to the client, but not its ending: the peer's timing event and ``[DONE]``
(or its error event) become this call's trailer — the usage the peer counted (for the whole
answer, as the client's one request), its finish reasons, its region — and this router ends the
stream itself, with its own timing, as for any stream. The peer's router records what its engine
generated (a ledger row that ``continues`` this request's, exact also when this router hangs up
before the ending: relayed events are no token count once a slow reader has the engine merge
steps); this router's record is what this region's engines did.

Chat and completions: their chunks are ``data:`` events, the peer's ending is its ``pg_metadata``
event and ``data: [DONE]``. Messages: Anthropic's named events; the usage is in ``message_delta``
(relayed: the client's), the peer's ending is its ``message_stop`` with the timing inside, which
this router sends again as its own terminal event with its own timing. Responses: the peer's
ending is its terminal event (``response.completed``…) with the usage and the timing in its
response; this router sends it again with its own timing, and stores that response.
"""

import asyncio

import anyio
import httpx

from serve_app.engine.outputs import ResponsesOutput, ResponsesStream, anthropic_prompt_tokens, token_usage
from serve_app.router.failover import CONTINUATION_RECORDED_HEADER
from serve_app.telemetry.logs import module_logger
from serve_app.wire.messages import ENGINE_UNAVAILABLE, EngineTiming, Generated, Trailer
from serve_app.wire import sse
from serve_app.wire.sse import EVENT_END

logger = module_logger(__name__)

PEER_STREAM_FAILED = "peer_stream_failed"
_DONE = sse.DONE_BYTES.rstrip()
_ERROR = b'data: {"error"'
_METADATA = b"event: pg_metadata"
_MESSAGE_DELTA = b"event: message_delta\n"
_MESSAGE_STOP = b"event: message_stop\n"
_NAMED_ERROR = b"event: error\n"  # Anthropic's and Responses' error event
_RESPONSES_TERMINAL = tuple(f"event: {name}\n".encode() for name in ResponsesStream.TERMINAL)


class PeerCall:
    """The peer router's response to a resume (status 200, SSE), until its ending."""

    def __init__(self, region: str, upstream: httpx.Response, *, tokens_before: int, surface: str = "chat",
                 client_wants_usage: bool = True):
        self.region = region
        self._surface = surface
        # Chat and completions: the peer was asked for its usage chunk (its closing reports it);
        # it goes on to a client that asked for usage, never to one that did not (``choices: []``).
        self._client_wants_usage = client_wants_usage
        self._terminal: dict | None = None  # Messages, Responses: the peer's terminal event, without its timing
        self.replica = None  # the peer's model replica, from its timing event
        self._upstream = upstream
        # The peer records what its engine did (a row that ``continues`` this request's): this
        # region's record leaves it out. A peer one release behind does not, and is billed here.
        self.recorded_there = upstream.headers.get(CONTINUATION_RECORDED_HEADER) == "1"
        self._chunks = upstream.aiter_raw()
        self._before = tokens_before  # generated before the seam (the peer's usage counts them)
        self._pending = b""
        self._usage: dict | None = None
        self._cached = 0  # the prompt tokens the peer's engine read from its prefix cache
        self._metadata: dict | None = None
        self._finish_reasons: list[str] = []
        self._error: str | None = None
        self._done = False  # the peer's [DONE]: its stream ended as it should
        self._relayed = 0  # token chunks relayed: the count billed if the stream ends unfinished
        self.ended = False
        self._closed = False  # the upstream response is closed (``ended`` may come first: ``read``)
        self._closing: asyncio.Future | None = None

    # --- what the relay reads ------------------------------------------------------------------
    def present(self, client, *, keep: bool, stall_s: float) -> bool:
        """A peer's stream is relayed: never handed over (``ReplicaCall.present``)."""
        return False

    @property
    def reader(self) -> "PeerCall":
        return self

    async def read(self, _size: int) -> bytes:
        """The next whole events to relay; b"" when the peer's stream is over."""
        while not self.ended:
            try:
                chunk = await self._chunks.__anext__()
            except StopAsyncIteration:
                self.ended = True
                break
            except httpx.HTTPError as err:
                logger.warning("the resumed stream from %s broke (%s)", self.region, type(err).__name__)
                self._error, self.ended = PEER_STREAM_FAILED, True
                break
            *events, self._pending = (self._pending + chunk).split(EVENT_END)
            relayed = b"".join(event + EVENT_END for event in events if self._passes(event))
            if relayed:
                return relayed
        return b""

    async def trailer(self) -> Trailer:
        """How the peer's stream ended, once ``read`` returned b""."""
        await self._close()
        return self._trailer()

    # --- what the request's one exit uses (``context.Context.settle``) --------------------------
    @property
    def under_way(self) -> bool:
        return not self.ended

    def hang_up(self) -> None:
        """The client left (or the relay is done): closing the connection stops the peer's engine.
        Also after ``read`` saw the stream end, when the client left before ``trailer`` closed it."""
        if not self._closed and self._closing is None:
            self._closing = asyncio.ensure_future(self._close())

    async def last(self) -> Trailer:
        """After ``hang_up``: the peer's stream closed before its ending, so its usage is not
        known here (the token chunks relayed stand for it). A peer that records its part
        (``recorded_there``) has its engine's own count: it is billed by that record."""
        await self._close()
        return self._trailer()

    # --- the peer's events ----------------------------------------------------------------------
    def _passes(self, event: bytes) -> bool:
        if event.startswith(b":"):  # the peer's keep-alive comment: nothing to relay or count
            return False
        if self._surface == "messages":
            return self._passes_anthropic(event)
        if self._surface == "responses":
            return self._passes_responses(event)
        if event.startswith(_DONE):
            self._done = True
            return False
        if event.startswith(_METADATA):
            payload = sse.json_of(event)
            self._usage, self._metadata = payload.get("usage"), payload.get("pg_metadata") or {}
            self._cached = _cached_tokens(self._usage or {})
            return False
        if event.startswith(_ERROR):
            error = sse.json_of(event).get("error") or {}
            self._error = error.get("code") or ENGINE_UNAVAILABLE
            logger.warning("the resumed stream from %s ended with %s", self.region, self._error)
            return False
        if not self._client_wants_usage and b'"choices":[]' in event and b'"usage":' in event:
            return False
        if b'"finish_reason":"' in event:
            for choice in sse.json_of(event).get("choices") or ():
                if choice.get("finish_reason"):
                    self._finish_reasons.append(choice["finish_reason"])
        self._relayed += 1
        return True

    def _passes_anthropic(self, event: bytes) -> bool:
        if event.startswith(_MESSAGE_STOP):
            payload = sse.json_of(event)
            self._metadata = payload.pop("pg_metadata", None) or {}
            self._terminal, self._done = payload, True
            return False
        if event.startswith(_NAMED_ERROR):
            error = sse.json_of(event).get("error") or {}
            # Anthropic's errors carry a type, not our code: overloaded is our engine_unavailable.
            self._error = ENGINE_UNAVAILABLE if error.get("type") == "overloaded_error" else PEER_STREAM_FAILED
            logger.warning("the resumed stream from %s ended with %s", self.region, error.get("type"))
            return False
        if event.startswith(_MESSAGE_DELTA):
            payload = sse.json_of(event)
            usage = payload.get("usage") or {}
            self._usage = token_usage(anthropic_prompt_tokens(usage) or 0, usage.get("output_tokens") or 0)
            self._cached = _cached_tokens(usage)
            if stop := (payload.get("delta") or {}).get("stop_reason"):
                self._finish_reasons.append(stop)
        elif event.startswith(b"event: content_block_delta"):
            self._relayed += 1
        return True

    def _passes_responses(self, event: bytes) -> bool:
        if event.startswith(_RESPONSES_TERMINAL):
            payload = sse.json_of(event)
            response = dict(payload.get("response") or {})
            self._metadata = response.pop("pg_metadata", None) or {}
            summary = ResponsesOutput().summarize(dict(response))  # usage and finish, as the replica reads them
            self._usage = summary.usage or token_usage(0, 0)
            self._cached = _cached_tokens(response.get("usage") or {})
            self._finish_reasons += summary.finish_reasons
            self._terminal, self._done = {**payload, "response": response}, True
            return False
        if event.startswith(_NAMED_ERROR):
            error = sse.json_of(event)
            self._error = error.get("code") or PEER_STREAM_FAILED
            logger.warning("the resumed stream from %s ended with %s", self.region, self._error)
            return False
        if b".delta\n" in event[:64]:
            self._relayed += 1
        return True

    def _trailer(self) -> Trailer:
        complete = self._done and self._usage is not None and self._error is None
        if not complete:
            return Trailer(complete=False, error_code=self._error or PEER_STREAM_FAILED,
                           finish_reasons=tuple(self._finish_reasons), generated=Generated(0, self._relayed))
        usage, metadata = self._usage, self._metadata or {}
        self.replica = metadata.get("replica")
        # The peer counts the whole answer as the client's request; its engine prefilled the
        # prompt and the tokens before the seam, and generated the rest. (Where the seam cut a
        # character, the peer replayed fewer than ``_before`` and generated those again: they
        # were billed with the first engine's, so never below none.)
        generated = Generated(usage.get("prompt_tokens", 0) + self._before,
                              max(0, usage.get("completion_tokens", 0) - self._before), self._cached)
        prefill, total = metadata.get("inference_ttft_ms"), metadata.get("inference_total_ms")
        timing = EngineTiming(queue_ms=metadata.get("queue_ms"), prefill_ms=prefill,
                              decode_ms=total - prefill if None not in (prefill, total) else None)
        response = self._terminal.get("response") if self._surface == "responses" and self._terminal else None
        return Trailer(timing=timing, usage=usage, finish_reasons=tuple(self._finish_reasons),
                       replica=self.replica, generated=generated, terminal=self._terminal, response=response)

    async def _close(self) -> None:
        self.ended = self._closed = True
        with anyio.CancelScope(shield=True):  # a leaving client cancels us; still release the peer
            await self._upstream.aclose()


def _cached_tokens(usage: dict) -> int:
    """The cached prompt tokens of a usage object, in any of the surfaces' shapes (OpenAI's
    ``prompt_tokens_details``, Responses' ``input_tokens_details``, Anthropic's
    ``cache_read_input_tokens``): the record's, when the first engine died before counting its prompt."""
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    return int(details.get("cached_tokens") or usage.get("cache_read_input_tokens") or 0)

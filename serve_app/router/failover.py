"""Cross-region failover: when this region cannot serve a request (the router decided on a 503:
model overloaded, cold, loading, replica unavailable), send the same request to a peer region's
router and relay its answer.

- One hop only. The forwarded request carries ``HOP_HEADER`` (the forwarding region); a router that
  receives it with a peer router's failover token never forwards again (``Context.origin``,
  ``pipeline.fail_over``), so two overloaded regions cannot ping-pong.
- Peers are tried in order, at most ``max_attempts``. Only a 503, a failed connect or a timeout
  before the request was sent moves on to the next peer; any other status is the peer's verdict on
  this request and is relayed as is (a 400 or 429 would not change elsewhere). A peer that had the
  request and sent no head within ``read_timeout_s``, or whose line broke after the request was
  sent, may be running it (and will bill it): no other peer runs it a second time (``no_head``). All failed → a
  ``Forwarded`` without a response (its attempts go into the trace), and the router answers with
  its own 503.
- Timeouts: connecting must be quick (a dead peer must not eat the client's patience); reading
  is long, since a long generation can be slow between bytes. A peer that could not be reached
  (connect error or timeout) is skipped for ``unreachable_hold_s`` afterwards, so an outage of a
  peer does not add the connect timeout to every request of an overloaded region.
- Relayed: the status, the body (SSE byte for byte, as it arrives) and the headers a client acts on
  (content-type, retry-after, server-timing, www-authenticate, x-ratelimit-*, x-budget-*, x-pg-region,
  x-pg-trace-id), plus
  ``x-pg-failover-from`` / ``x-pg-failover-reason``. Hop-by-hop headers are not relayed, and
  upstream is asked for ``identity`` encoding so the bytes relayed are the bytes the client reads.
- Credentials: given ``authorization`` (the router always gives it), each peer gets its own
  ``Authorization`` value from it — a short token whose audience is that peer alone — and no
  credential from ``headers`` is sent anywhere.
"""

import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
from starlette.responses import Response, StreamingResponse

from serve_app.config import Peer  # the peer region as a region file names it: id and router URL
from serve_app.errors import APIError
from serve_app.surfaces import dialects
from serve_app.telemetry.request import TRACE_ID_HEADER
from serve_app.telemetry.logs import module_logger

logger = module_logger(__name__)

HOP_HEADER = "x-pg-forwarded-from"
REGION_HEADER = "x-pg-region"
FAILOVER_FROM_HEADER = "x-pg-failover-from"
FAILOVER_REASON_HEADER = "x-pg-failover-reason"
# A peer's answer to a stream it continues: it records what its engine did (``resume.py``).
CONTINUATION_RECORDED_HEADER = "x-pg-continuation-recorded"

# The trace id: one trace across the regions (the peer continues this router's failover span).
_RELAYED = {"content-type", "retry-after", "server-timing", "www-authenticate", REGION_HEADER, TRACE_ID_HEADER}
# Never copied from the router's headers: httpx or the Forwarder set these for the request it
# sends (a stale content-length from the client's request would corrupt the forwarded body).
_NOT_FORWARDED = {"host", "content-length", "transfer-encoding", "connection", "content-type", "accept",
                  "accept-encoding", "content-encoding", HOP_HEADER}  # the body is re-encoded JSON
_PEER_BROKE = "peer_stream_failed"
# A pooled connection that breaks this soon after a request was sent on it was closed by the peer's
# side before the request arrived (a round trip, not a peer's work): the request ran nowhere.
STALE_BREAK_S = 1.0
OnDone = Callable[[int, str | None], None]


@dataclass
class Attempt:
    region: str
    outcome: str  # served | unavailable | connect_error | timeout | no_head | error | skipped (unreachable lately)
    status: int | None
    duration_ms: float


@dataclass
class Forwarded:
    """What ``forward`` did. ``response`` is None when no peer took the request. A JSON answer is
    complete when returned; a stream reports its end through ``on_done``."""

    response: Response | None
    region: str | None
    status: int | None
    attempts: list[Attempt] = field(default_factory=list)
    error_type: str | None = None  # peer_stream_failed when a JSON body broke off
    stream: bool = False


class _RelayResponse(StreamingResponse):
    """Starlette abandons the body iterator when the client leaves; close it here at once, so the
    upstream connection is released and ``on_done`` runs now, not whenever the GC gets to it. A
    client gone before the body's first chunk was asked for leaves a generator that never started,
    whose close runs none of its code: ``on_end`` runs here then (the request settles, the peer's
    connection closes; else the peer generated on, and this region kept the request's charge)."""

    def __init__(self, content: AsyncIterator[bytes], *, on_end: Callable[[], Awaitable[None]], **kwargs: Any):
        super().__init__(content, **kwargs)
        self._on_end = on_end

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                await self._on_end()


class Forwarder:
    def __init__(self, region: str, peers: Sequence[Peer], *, connect_timeout_s: float = 2.0,
                 read_timeout_s: float = 600.0, max_attempts: int = 2,
                 unreachable_hold_s: float = 10.0, transport: httpx.AsyncBaseTransport | None = None,
                 verify: ssl.SSLContext | bool = True, clock: Callable[[], float] = time.monotonic):
        self.region = region
        self._clock = clock
        self._unreachable_until: dict[str, float] = {}
        self._transport = transport
        self._verify = verify
        self._client: httpx.AsyncClient | None = None
        self.peers: list[Peer] = []
        self.apply(peers, connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s,
                   max_attempts=max_attempts, unreachable_hold_s=unreachable_hold_s)

    def apply(self, peers: Sequence[Peer], *, connect_timeout_s: float, read_timeout_s: float,
              max_attempts: int, unreachable_hold_s: float) -> None:
        """New settings, in place (the router was reconfigured): requests forwarded from now on
        use them; one under way keeps the peer list it is walking and its connection. A peer whose
        endpoint changed is not held back for its old one's failures."""
        endpoints = {peer.region: peer.endpoint for peer in self.peers}
        for peer in peers:
            if endpoints.get(peer.region, peer.endpoint) != peer.endpoint:
                self._unreachable_until.pop(peer.region, None)
        self.peers = list(peers)
        self.max_attempts = max_attempts
        self.unreachable_hold_s = unreachable_hold_s
        self._timeout = httpx.Timeout(connect=connect_timeout_s, read=read_timeout_s,
                                      write=connect_timeout_s, pool=connect_timeout_s)
        if self._client is not None:
            self._client.timeout = self._timeout

    def _http(self) -> httpx.AsyncClient:
        # Created lazily: the client's pool belongs to the event loop that first uses it.
        if self._client is None:
            # No cap on connections: the router's own admission bounds what it forwards (one
            # connection a request, HTTP/1.1), and httpx's default of 100 would make the 101st
            # forwarded stream of a region fail over wait, then time out, as if the peer were down.
            self._client = httpx.AsyncClient(timeout=self._timeout, follow_redirects=False,
                                             verify=self._verify, transport=self._transport,
                                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=32))
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def forward(self, route: str, body: dict, headers: Mapping[str, str], *, reason: str,
                      allowed: Callable[[str], bool] = lambda region: True,
                      on_done: OnDone | None = None,
                      authorization: Callable[[str], str] | None = None, dialect: Any = None) -> Forwarded:
        """The first peer's answer that is not a 503, ready to return, or none and why.

        ``on_done(status, error_type)`` is called once when a relayed *stream* ends (or breaks off,
        or the client leaves). ``authorization(peer_region)``: the Authorization value for that
        peer; it replaces any the headers carry (a token bound to one peer must not reach another).
        ``dialect``: the request's (``surfaces/dialects.py``), in which a peer's stream that breaks
        off ends; OpenAI's chat chunks by default."""
        peer, upstream, attempts = await self.open(route, body, headers, allowed=allowed, authorization=authorization)
        if upstream is None:
            return Forwarded(None, None, None, attempts)
        return await self._relay(peer, upstream, reason, attempts, on_done or (lambda s, e: None),
                                 dialect or dialects.OPENAI)

    async def open(self, route: str, body: dict, headers: Mapping[str, str], *,
                   allowed: Callable[[str], bool] = lambda region: True,
                   authorization: Callable[[str], str] | None = None,
                   ) -> tuple[Peer | None, httpx.Response | None, list[Attempt]]:
        """The first peer that answers other than 503, and its response with the body still to
        read (the caller closes it), or ``(None, None, attempts)``."""
        dropped = _NOT_FORWARDED | ({"authorization"} if authorization else set())
        out = {k: v for k, v in headers.items() if k.lower() not in dropped}
        out |= {"content-type": "application/json", HOP_HEADER: self.region, "accept-encoding": "identity",
                "accept": "text/event-stream" if body.get("stream") else "application/json"}
        attempts: list[Attempt] = []
        tried = 0
        for peer in self.peers:
            if tried >= self.max_attempts:
                break
            if peer.region == self.region or not allowed(peer.region):
                continue
            if self._unreachable_until.get(peer.region, 0.0) > self._clock():
                attempts.append(Attempt(peer.region, "skipped", None, 0.0))
                continue
            tried += 1
            start = time.perf_counter()
            upstream, outcome, detail = None, "error", ""
            sent = out | {"authorization": authorization(peer.region)} if authorization else out
            fresh: list[bool] = []  # whether this request opened its own connection (httpcore's trace)

            async def trace(event: str, info: dict, fresh: list[bool] = fresh) -> None:
                if event.endswith(".connect_tcp.complete"):  # "connection.", or "socks." through a SOCKS proxy
                    fresh.append(True)

            try:
                url = peer.endpoint.rstrip("/") + route
                request = self._http().build_request("POST", url, json=body, headers=sent, extensions={"trace": trace})
                upstream = await self._http().send(request, stream=True)
                outcome = "unavailable" if upstream.status_code == 503 else "served"
            except httpx.ConnectError:
                outcome = "connect_error"
            except httpx.PoolTimeout:  # waiting for this router's own pool: says nothing of the peer
                detail = "PoolTimeout"
            except httpx.ReadTimeout:  # sent, and no head within the read timeout: the peer has it
                outcome = "no_head"
            except (httpx.ReadError, httpx.RemoteProtocolError) as err:
                # Sent, then the line broke before the head. A pooled connection the peer's proxy
                # had just closed (an ingress reload closes idle ones) breaks at once and ran
                # nothing: the next peer. A new one, or a break later (a proxy's cut, a restart),
                # reached a peer that may be running it and bills what it ran: no second peer.
                detail = type(err).__name__
                stale = not fresh and time.perf_counter() - start < STALE_BREAK_S
                outcome = "error" if stale else "no_head"
            except httpx.TimeoutException:  # connect or write
                outcome = "timeout"
            except httpx.HTTPError as err:  # e.g. a write that failed: the peer never had all of it
                detail = type(err).__name__
            status = upstream.status_code if upstream is not None else None
            attempts.append(Attempt(peer.region, outcome, status, (time.perf_counter() - start) * 1000))
            if outcome in ("connect_error", "timeout") and peer in self.peers:  # not an endpoint replaced meanwhile
                self._unreachable_until[peer.region] = self._clock() + self.unreachable_hold_s
            if outcome == "served":
                return peer, upstream, attempts
            if outcome == "no_head":
                logger.warning("failover to %s: sent, then %s before the answer's head; not sent to another peer "
                               "(it may be running there, billed there)", peer.region,
                               detail or f"nothing in {self._timeout.read:.0f} s")
                break
            logger.warning("failover to %s failed: outcome=%s status=%s %s", peer.region, outcome, status, detail)
            if upstream is not None:
                await upstream.aclose()
        return None, None, attempts

    async def _relay(self, peer: Peer, upstream: httpx.Response, reason: str, attempts: list[Attempt],
                     on_done: OnDone, dialect: Any) -> Forwarded:
        status, error_type = upstream.status_code, None
        relayed = [(k, v) for k, v in upstream.headers.multi_items()  # multi: www-authenticate may repeat
                   if k in _RELAYED or k.startswith(("x-ratelimit-", "x-budget-"))]
        stream = upstream.headers.get("content-type", "").split(";")[0].strip().lower() == "text/event-stream"
        if stream:
            end = _Ending(on_done, upstream)
            response: Response = _RelayResponse(_peer_events(peer, upstream, end, dialect), on_end=end,
                                                status_code=status)
        else:
            try:
                response = Response(await upstream.aread(), status_code=status)
            except httpx.HTTPError as err:  # the head came, the body did not: nothing left to relay
                logger.warning("failover to %s: body read failed (%s)", peer.region, type(err).__name__)
                attempts[-1].outcome = "error"
                status, error_type = 502, _PEER_BROKE
                response = (dialect or dialects.OPENAI).error_response(_broke(peer))  # in the request's own shape
                relayed = []
            finally:
                await upstream.aclose()
        for key, value in relayed:
            response.headers.append(key, value)
        if REGION_HEADER not in response.headers:
            response.headers[REGION_HEADER] = peer.region
        response.headers[FAILOVER_FROM_HEADER] = self.region
        response.headers[FAILOVER_REASON_HEADER] = reason
        return Forwarded(response, peer.region, status, attempts, error_type, stream)


class _Ending:
    """A relayed stream's end, once however it comes (its events' own end, or the response's):
    ``on_done`` with how it ended (a client gone: 499), then the peer's connection closed."""

    def __init__(self, on_done: OnDone, upstream: httpx.Response):
        self._on_done, self._upstream, self._ended = on_done, upstream, False

    async def __call__(self, status: int = 499, error_type: str | None = "client_closed") -> None:
        if self._ended:
            return
        self._ended = True
        _call(self._on_done, status, error_type)
        with anyio.CancelScope(shield=True):  # a leaving client cancels us; still release the peer
            await self._upstream.aclose()


async def _peer_events(peer: Peer, upstream: httpx.Response, end: _Ending, dialect: Any) -> AsyncIterator[bytes]:
    """The peer's SSE bytes as they arrive; a broken peer ends the stream with an error event in
    the request's own dialect."""
    result: tuple[int, str | None] = (499, "client_closed")  # unless we reach the end below
    sequence = dialect.sequence_watch()  # a Responses error event continues the peer's numbering
    try:
        async for chunk in upstream.aiter_raw():
            sequence.saw(chunk)
            yield chunk
        result = (upstream.status_code, None)
    except httpx.HTTPError as err:
        # The status line is sent: end the stream properly so the client never hangs.
        logger.warning("failover to %s: stream broke (%s)", peer.region, type(err).__name__)
        result = (502, _PEER_BROKE)
        yield dialect.error_event(502, _broke(peer).body(), sequence_number=sequence.next)
    finally:
        await end(*result)


def _broke(peer: Peer) -> APIError:
    return APIError(502, f"the peer region {peer.region} failed mid-response", code=_PEER_BROKE)


def _call(on_done: OnDone, status: int, error_type: str | None) -> None:
    try:
        on_done(status, error_type)
    except Exception:  # the router's bookkeeping must not break the client's response
        logger.exception("failover on_done callback failed")

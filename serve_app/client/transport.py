"""Sending one request: pick a region, authenticate, retry and fail over, and time-box all of it.

One ``httpx.AsyncClient`` serves every base URL, so connections (and TLS sessions) are reused per
region across requests. What happens to one request, in order:

- Regions are tried in the caller's order, less those that failed recently: a region that refused
  a connection or answered 503 is put last for ``region_hold_s`` (its ``Retry-After`` when it sent
  one), so an outage does not cost every request a connect timeout. With one base URL it is always
  tried.
- A connect error (nothing reached the server, so any request is safe to resend), a 503, or the
  region's HAProxy saying no router took the request (500 ``gateway_unavailable``: nothing ran)
  moves on to the next region at once. The server has already tried its own peers before
  answering 503 (docs/api.md, "Cross-region failover"), so this only adds the regions the caller
  knows about. So does a 404 ``model_not_found``, a region's word on the models it serves: the
  model may be served in another (a region's optional model); it is raised only when every
  region said it.
- A pooled connection the server had closed (an ingress reload closes idle ones) breaks at once,
  before any answer, on a connection this request did not open ("disconnected without a
  response", or a failed write): nothing ran, and the request is sent again on a new one, to the
  same region, once (the server's own failover reads it the same way). A line that breaks
  otherwise, after the answer's head, or is reset (the server may have had the request), is raised —
  but for a ``GET`` and the token exchange, which run nothing twice: they go on as after a connect
  error.
- When every region failed in a round, or on a 429 (the caller's budget, which another region
  would charge too), the client waits until the first region may be asked again — its
  ``Retry-After`` if it gave one (plus up to a fifth, so that clients shed together do not come
  back together), else exponential backoff with jitter — and starts a new round with the regions
  whose wait is over; a 429 waits for its own region's ``Retry-After``, whatever other regions
  said. A region that could not be reached waits as long as the first region that answered with
  a ``Retry-After`` (its short backoff would otherwise make it due first, alone, at every round,
  spending the retries that region asked to wait for), unless that is past the call's budget.
  After a 429's rounds, a region not asked yet in the call is asked once that region fails
  otherwise. At most ``max_retries`` waits and ``max_retry_time_s`` in all. A
  ``Retry-After`` past that budget is not waited for: the error is raised at once with
  ``retry_after`` set (a cold model says 60 s; the caller decides).
- The error raised when the attempts end is the most useful one of the call's, not the last: a
  429, then an answer with ``Retry-After``, then any other answer, then a connection's failure,
  then a region's 404 ``model_not_found``; of equals, the region first in the caller's order.
- A 401 that refuses the token (``token_expired``, ``token_not_yet_valid``, ``token_revoked``,
  ``invalid_token``: a signing key rotated out) mints a new token once and resends
  (``Auth.after_rejection``); so does a 401 whose body has no code but whose ``WWW-Authenticate``
  says ``invalid_token`` (Messages' errors are Anthropic's shape, which has no ``code``).
- Anything else ≥ 400 is raised as is. A read timeout or a connection lost after the request was
  sent is raised, not retried: the server may have run (and billed) the generation.
- A stream is returned as soon as its status line says 200; nothing after that is retried
  (``streams.py``). Its status line may wait long (Serve's queue, silent before the head), so
  it has the client's read timeout; once it is open, a stream silent for ``stream_read_timeout_s``
  ends (``AsyncStream``): the server writes a keep-alive comment into every open stream silent
  for a second, so a longer silence is a dead path (a dropped NAT entry), not a slow model.
"""

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from serve_app.client.auth import TOKEN_PATH, Auth, Secret
from serve_app.client.errors import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    ServeAppError,
    described,
    from_response,
)
from serve_app.client.timing import new_traceparent, trace_id_of

logger = logging.getLogger("serve_app.client")

USER_AGENT = "serve_app-client/0.1"
# Connect quickly (a dead region must not eat the caller's patience); read for as long as the
# server's own request timeout (configs: request_timeout_s 600) — a long non-stream generation
# sends nothing until it is done.
DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=5.0)
DEFAULT_STREAM_READ_TIMEOUT_S = 30.0  # ≫ the server's 1 s keep-alive period (module docstring)
# The token exchange: a signature and a key lookup. Bounded apart from the client's timeout (600 s
# to read), since requests may wait on it when there is no valid token to send meanwhile.
EXCHANGE_TIMEOUT = httpx.Timeout(10.0, connect=5.0)
# Connections per client, all kept alive between calls: httpx keeps 20 of its 100 alive, so past 20
# concurrent streams every call opened (and TLS-shook) a new connection. The 101st concurrent call
# waits for one (the timeout's pool part, the read timeout's by default).
DEFAULT_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=100)
GATEWAY_UNAVAILABLE = "gateway_unavailable"  # HAProxy's: no router took the request (haproxy/error_pages.py)
MODEL_NOT_FOUND = "model_not_found"  # a region's word on the models it serves
RETRY_AFTER_SPREAD = 0.2  # a Retry-After is waited for, plus up to this fraction of it
_CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)
# A line that breaks before the answer: read, a closed connection's "disconnected without a
# response", or a write that failed (the server never had the whole body).
_BROKEN_LINE = (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError)
# A break this soon on a connection the request did not open: a pooled one the server had closed.
STALE_BREAK_S = 1.0


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 2  # waits between rounds of attempts (0: never wait and resend)
    max_retry_time_s: float = 30.0  # the whole request, waits included
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    region_hold_s: float = 30.0  # how long a failed region goes to the back of the order

    def backoff(self, retry: int) -> float:
        """Exponential with full jitter in its upper half: 0.25–0.5 s, 0.5–1 s, ... capped."""
        ceiling = min(self.max_backoff_s, self.initial_backoff_s * 2**retry)
        return ceiling * random.uniform(0.5, 1.0)


@dataclass
class Sent:
    """A response with status < 400 (open, for a stream) and what the client knows about it."""

    response: httpx.Response
    trace_id: str
    base_url: str


def normalize_base_url(url: str) -> str:
    """``http://host:8000``, ``.../v1`` and ``.../v1/`` all mean the same server root."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"base URL must start with http:// or https://, got {url!r}")
    return url.removesuffix("/v1")


class Transport:
    def __init__(
        self,
        base_urls: list[str],
        auth: Auth,
        *,
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        retry: RetryPolicy = RetryPolicy(),
        trace_sample_ratio: float = 0.1,
        http_transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
        stream_read_timeout_s: float | None = DEFAULT_STREAM_READ_TIMEOUT_S,
        limits: httpx.Limits = DEFAULT_LIMITS,
    ):
        if not base_urls:
            raise ValueError("at least one base URL is needed")
        self.base_urls = [normalize_base_url(u) for u in base_urls]
        self.auth, self.retry, self.trace_sample_ratio, self._clock = auth, retry, trace_sample_ratio, clock
        self._held_until = [0.0] * len(self.base_urls)
        # No Authorization here: it is set per request, from whatever Auth holds at that moment.
        self.max_connections = limits.max_connections
        self._http = httpx.AsyncClient(timeout=timeout, transport=http_transport, limits=limits,
                                       headers={"user-agent": USER_AGENT})
        self.stream_read_timeout_s = stream_read_timeout_s  # an open stream's silence (``AsyncStream``)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def exchange(self, api_key: Secret) -> dict[str, Any]:
        """``POST /v1/auth/token`` with the key as its Bearer value, through the same regions and
        retries. In a header, not a JSON body: no plain dict of this call's holds the key, so a
        traceback's locals (an error reporter's) show it masked (httpx masks ``authorization``)."""
        sent = await self.send("POST", TOKEN_PATH, credential=api_key, timeout=EXCHANGE_TIMEOUT)
        return json_object(sent.response)

    def _order(self) -> list[int]:
        now = self._clock()
        ready = [i for i, until in enumerate(self._held_until) if until <= now]
        return ready + sorted(set(range(len(self.base_urls))) - set(ready), key=lambda i: self._held_until[i])

    def _hold(self, index: int, seconds: float | None) -> None:
        if len(self.base_urls) > 1:
            self._held_until[index] = self._clock() + (seconds if seconds is not None else self.retry.region_hold_s)

    async def send(
        self,
        method: str,
        path: str,
        *,
        body: dict[str, Any] | None = None,
        stream: bool = False,
        credential: Secret | None = None,
        traceparent: str | None = None,
        timeout: httpx.Timeout | float | None = None,
        extra_headers: dict[str, str] | None = None,
    ) -> Sent:
        """The first response below 400, or the error that ended the attempts (module docstring).
        ``credential``: sent as the Bearer value instead of the client's (the exchange's key)."""
        if self._http.is_closed:
            raise ServeAppError("this client has been closed")
        traceparent = traceparent or new_traceparent(self.trace_sample_ratio)
        trace_id = trace_id_of(traceparent)
        started, retries, refreshed, resent_stale = self._clock(), 0, False, False
        order = self._order()
        untried = list(order)  # this round's regions, in order
        due: dict[int, float] = {}  # region → when it may be asked again: its Retry-After, or a backoff
        failures: dict[int, ServeAppError] = {}  # each region's last failure in this call
        idempotent = method == "GET" or path == TOKEN_PATH  # runs nothing twice if sent twice
        while True:
            index = untried.pop(0)
            base_url = self.base_urls[index]
            headers = httpx.Headers(extra_headers)  # the caller's, under ours: never its own Authorization
            headers.update({"traceparent": traceparent, "accept": "text/event-stream" if stream else "application/json"})
            sent_credential = credential
            if sent_credential is None:
                await self.auth.ensure(self.exchange)
                sent_credential = self.auth.credential()
            headers["authorization"] = f"Bearer {sent_credential.reveal()}"
            # From httpcore's trace: whether this request opened its own connection, and whether
            # an answer's head came back (a body cut after it is a request the server ran).
            fresh: list[bool] = []
            answered: list[bool] = []

            async def trace(event: str, info: dict, fresh: list[bool] = fresh, answered: list[bool] = answered) -> None:
                if event.endswith((".connect_tcp.complete", ".connect_unix_socket.complete")):
                    fresh.append(True)
                elif event.endswith(".receive_response_headers.complete"):
                    answered.append(True)

            request = self._http.build_request(
                method, base_url + path, json=body, headers=headers, extensions={"trace": trace},
                timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
            )
            sent_at = self._clock()
            try:
                response = await self._http.send(request, stream=stream)
            except _CONNECT_ERRORS as err:
                failure: ServeAppError = APIConnectionError(f"cannot connect to {base_url}: {type(err).__name__}", trace_id=trace_id)
                self._hold(index, None)
            except httpx.PoolTimeout:  # nothing was sent: this client's own connections were all taken
                raise APITimeoutError(f"all {self.max_connections} connections of this client were in use until "
                                      "the timeout; raise its limits or send fewer calls at once",
                                      trace_id=trace_id) from None
            except httpx.TimeoutException as err:
                raise APITimeoutError(f"{base_url} did not answer in time ({type(err).__name__})", trace_id=trace_id) from None
            except _BROKEN_LINE as err:
                broken = APIConnectionError(f"connection to {base_url} failed: {type(err).__name__}", trace_id=trace_id)
                # A closed keep-alive connection: the request written into it, then "disconnected
                # without a response" (or the write failed). A reset (ReadError) may come from a
                # server that had the request: resent only where nothing runs twice.
                stale_shape = idempotent or (not answered and not isinstance(err, httpx.ReadError))
                if stale_shape and not fresh and self._clock() - sent_at < STALE_BREAK_S and not resent_stale:
                    resent_stale = True  # a pooled connection the server had closed: nothing ran
                    logger.info("%s closed a pooled connection (%s); sending again", base_url, type(err).__name__)
                    untried.insert(0, index)
                    continue
                if not idempotent:
                    raise broken from None  # the server may have run (and billed) it
                failure = broken
            except httpx.TransportError as err:
                raise APIConnectionError(f"connection to {base_url} failed: {type(err).__name__}", trace_id=trace_id) from None
            else:
                if response.status_code < 400:
                    self._held_until[index] = 0.0
                    return Sent(response, trace_id, base_url)
                failure = await _error_of(response, trace_id)
                if (
                    credential is None and _token_rejected(failure, response) and not refreshed
                    and await self.auth.after_rejection(sent_credential, self.exchange)
                ):
                    refreshed = True
                    logger.info("token refused at %s (%s); minted a new one and resending", base_url, failure.code)
                    untried.insert(0, index)
                    continue
                not_served = len(order) > 1 and _not_served(failure)
                if failure.status == 503 or (failure.status == 500 and failure.code == GATEWAY_UNAVAILABLE):
                    self._hold(index, failure.retry_after)
                elif failure.status != 429 and not not_served:
                    raise failure
            failures[index] = failure
            rate_limited = getattr(failure, "status", None) == 429
            retry_after = getattr(failure, "retry_after", None)
            if _not_served(failure):  # a region that does not serve the model is not asked again
                due.pop(index, None)
            else:
                due[index] = self._clock() + (retry_after * random.uniform(1.0, 1.0 + RETRY_AFTER_SPREAD)
                                              if retry_after is not None else self.retry.backoff(retries))
            if untried and not rate_limited:
                logger.info("%s failed (%s); trying %s", base_url, described(failure), self.base_urls[untried[0]])
                continue
            # The round is over: wait until the first region may be asked again, within the budget
            # (a 429: until its own region may be, the only one asked again).
            if rate_limited:
                raised, wait = failure, max(0.0, due[index] - self._clock())
            else:
                raised = _most_useful(failures, order)
                # A region not asked yet in this call (a 429's rounds ask their own region alone)
                # is asked now, without a wait, whatever the others said.
                untried = [i for i in order if i not in failures]
                if untried:
                    continue
                if not due:  # every region said it does not serve the model
                    raise raised
                self._wait_for_answering_regions(due, failures, started)
                wait = max(0.0, min(due.values()) - self._clock())
            if retries >= self.retry.max_retries or self._clock() - started + wait > self.retry.max_retry_time_s:
                raise raised
            logger.info("%s failed (%s); retrying in %.2fs (%d/%d)", base_url, described(failure), wait,
                        retries + 1, self.retry.max_retries)
            await asyncio.sleep(wait)
            retries += 1
            # A 429 is this region's word on this caller: ask it again. Otherwise every region
            # whose wait is over, in order: none is asked before its own Retry-After.
            # The sleep may end a clock tick early (a coarse monotonic clock): the first region due
            # is asked then, never none.
            now = self._clock()
            untried = [index] if rate_limited else (
                [i for i in order if i in due and due[i] <= now] or [min(due, key=due.__getitem__)])

    def _wait_for_answering_regions(self, due: dict[int, float], failures: dict[int, ServeAppError],
                                    started: float) -> None:
        """A region that could not be reached is due after a short backoff, one that answered
        with a Retry-After when it said: the dead one would be asked alone at every round,
        spending the retries the live one asked to wait for. So the unreachable ones wait as long
        as the first such region (and are asked in its round) — unless that is past the call's
        time budget (a cold model's 60 s): then they are all this call has left to ask."""
        asked_to_wait = [due[i] for i in due if getattr(failures[i], "retry_after", None) is not None]
        if not asked_to_wait:
            return
        then = min(asked_to_wait)
        if then - started > self.retry.max_retry_time_s:
            return
        for i in due:
            if not isinstance(failures[i], APIStatusError):
                due[i] = max(due[i], then)


def _not_served(failure: ServeAppError) -> bool:
    return isinstance(failure, APIStatusError) and failure.status == 404 and failure.code == MODEL_NOT_FOUND


def _most_useful(failures: dict[int, ServeAppError], order: list[int]) -> ServeAppError:
    """The failure to raise when the attempts end (module docstring): a 429, an answer with
    Retry-After, any other answer, a connection's failure, a region's model_not_found; of
    equals, the region first in ``order``."""

    def rank(failure: ServeAppError) -> int:
        if _not_served(failure):
            return 4
        if not isinstance(failure, APIStatusError):
            return 3
        return 0 if failure.status == 429 else 1 if failure.retry_after is not None else 2

    return min((failures[i] for i in order if i in failures), key=rank)


async def _error_of(response: httpx.Response, trace_id: str) -> APIStatusError:
    """The exception for an error response; reads and closes it (a stream's too)."""
    try:
        await response.aread()
    except httpx.HTTPError:
        pass
    finally:
        await response.aclose()
    return from_response(response, region=None, trace_id=trace_id)


# The 401s a new token may cure: expired or not yet valid by the server's clock, revoked (a token
# leaked, not the key), or refused as a token (a signing key rotated out, a region that does not
# trust the minting region's keys: the exchange goes through the same order of regions, so the
# region now asked mints it). A key revoked or gone fails the exchange itself, which is raised.
_TOKEN_REFUSALS = frozenset({"token_expired", "token_not_yet_valid", "token_revoked", "invalid_token"})


def _token_rejected(failure: APIStatusError, response: httpx.Response) -> bool:
    """A 401 that a new token may cure: one of ``_TOKEN_REFUSALS``, or one with no code of ours
    (an Anthropic-shaped body) whose challenge says the token was refused (RFC 6750 ``invalid_token``)."""
    if failure.status != 401:
        return False
    if failure.code is not None:
        return failure.code in _TOKEN_REFUSALS
    return 'error="invalid_token"' in response.headers.get("www-authenticate", "")


def json_object(response: httpx.Response) -> dict[str, Any]:
    try:
        payload = response.json()
    except ValueError:
        raise ServeAppError(f"{response.request.url.path} answered with a body that is not JSON") from None
    if not isinstance(payload, dict):
        raise ServeAppError(f"{response.request.url.path} answered with JSON that is not an object")
    return payload

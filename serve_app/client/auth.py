"""Which credential goes in ``Authorization``, and when to mint a new one.

The API key is exchanged for a short-lived JWT at ``POST /v1/auth/token`` (docs/auth.md, "Tokens"):
a token verifies in every region that trusts the issuing region's keys, with no key-store lookup,
and a stolen one dies within its lifetime. The key itself stays in this process and goes on the
wire only to the token endpoint, except in the fallback below.

- Refresh before expiry: at ``expires_in - margin``, the margin being ``refresh_margin_s`` but at
  most half the lifetime (so a 60 s token is not re-minted on every request). The clock starts
  *before* the exchange is sent, so network time only makes the client refresh early.
- Refresh on rejection: a 401 that refuses the token (``token_expired``: the server's clock ran
  ahead of ours, or the process slept; ``invalid_token``: its signing key was rotated out, or the
  region does not trust the one that minted it; ``token_revoked``) mints once and the request is
  sent again; a second 401 is the caller's. A revoked key fails that exchange, which is raised.
- While the current token is still valid, the refresh runs in the background and requests go on
  with that token: none waits for an exchange it does not need. A refresh that fails (any error:
  a refusal, a timeout, a connection) keeps the token and is tried again after
  ``REFRESH_RETRY_S`` (or the server's ``Retry-After``), never later than the token's expiry: a
  brief outage of the token endpoint must not fail, or stall, traffic. Only a client with no valid
  token waits for the exchange (and sees its error): requests that queued behind an exchange which
  failed get its error, not an exchange each in turn (the k-th would wait k exchanges' time).
- Fallback: only when the server says it has no exchange — a JSON 404 on the token route with no
  error code of ours but ``not_found`` (FastAPI's answer for a route that does not exist: an older
  gateway, a bare vLLM; not a proxy's page, nor Ray's plain-text 404 while the application is
  not yet deployed), 405 or 501 — the key itself is sent as the Bearer value, which every
  route of this server accepts. Any other refusal (401 ``invalid_api_key``, 403, 429, 5xx) is raised:
  a wrong key must not be retried as a Bearer value on every request.

Neither secret is ever logged or shown: both live in ``Secret``, whose repr is a mask. The key
goes to the token endpoint as the Bearer value (``Transport.exchange``), never in a JSON body.
"""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from serve_app.client.errors import APIStatusError, ServeAppError, described

logger = logging.getLogger("serve_app.client")

TOKEN_PATH = "/v1/auth/token"
DEFAULT_REFRESH_MARGIN_S = 60.0
MODE_TOKEN, MODE_API_KEY = "token", "api_key"
_EXCHANGE_UNAVAILABLE = {404, 405, 501}
REFRESH_RETRY_S = 5.0  # after a failed background refresh, unless the server said when


class Secret:
    """A string that does not show itself: ``repr``/``str`` are a mask; ``reveal()`` is explicit."""

    __slots__ = ("_value",)

    def __init__(self, value: str):
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('********')"

    __str__ = __repr__

    def __reduce__(self):  # pickling would write the secret out in the clear
        raise TypeError("a Secret cannot be pickled")


# The exchange: POST the key, get the token endpoint's JSON (or a ServeAppError raised).
Exchange = Callable[[Secret], Awaitable[dict[str, Any]]]


def exchange_unavailable(err: APIStatusError) -> bool:
    """The server has no token exchange (see the module docstring): fall back to the key."""
    if err.status == 404:
        return err.json_body and err.code in (None, "not_found")
    return err.status in _EXCHANGE_UNAVAILABLE


class Auth:
    def __init__(
        self,
        api_key: str,
        *,
        refresh_margin_s: float = DEFAULT_REFRESH_MARGIN_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not api_key or not isinstance(api_key, str):
            raise ValueError("api_key must be a non-empty string")
        self._key = Secret(api_key)
        self._token: Secret | None = None
        self._refresh_at = self._expires_at = 0.0
        self._margin, self._clock = refresh_margin_s, clock
        self._lock = asyncio.Lock()
        self.refreshing: asyncio.Task | None = None  # the background refresh under way, if one is
        self.mode: str | None = None  # decided by the first exchange
        self.exchanges = 0  # tokens minted so far (observability and tests)
        self._attempts = 0  # exchanges ended, minted or failed (``_shared_failure``)
        self._failure: Exception | None = None  # the last exchange's error, until one mints

    def __repr__(self) -> str:
        return f"Auth(mode={self.mode!r}, expires_in={self.expires_in()})"

    def expires_in(self) -> float | None:
        """Seconds the current token has left by this client's clock (None: no token)."""
        return None if self._token is None else round(self._expires_at - self._clock(), 3)

    def credential(self) -> Secret:
        """What to send as the Bearer value now (call ``ensure`` first)."""
        if self.mode == MODE_API_KEY:
            return self._key
        if self._token is None:
            raise RuntimeError("no token yet: await ensure() first")
        return self._token

    async def ensure(self, exchange: Exchange) -> None:
        """Have a credential to send now: the current token (refreshed in the background once it
        is due), or a new one minted first when there is none still valid."""
        if self.mode == MODE_API_KEY or (self._token is not None and self._clock() < self._refresh_at):
            return
        if self._valid():
            if self.refreshing is None or self.refreshing.done():
                self.refreshing = asyncio.ensure_future(self._refresh(exchange))
            return
        attempts = self._attempts
        async with self._lock:  # concurrent requests share one exchange
            if self.mode == MODE_API_KEY or self._valid():
                return
            self._shared_failure(attempts)
            await self._mint(exchange)

    async def aclose(self) -> None:
        """Stop a background refresh under way (the client is closing)."""
        if self.refreshing is not None and not self.refreshing.done():
            self.refreshing.cancel()
            try:
                await self.refreshing
            except (asyncio.CancelledError, Exception):
                pass

    def _shared_failure(self, attempts: int) -> None:
        """Raise the error of an exchange that ended in failure while the caller waited for the
        lock (``attempts``: the count when it started waiting): that exchange was its exchange too."""
        if self._attempts != attempts and self._failure is not None:
            # The same error for each waiter, its traceback restarted: raised in many tasks, it
            # would grow one (and keep every frame alive) per task.
            raise self._failure.with_traceback(None)

    def _valid(self) -> bool:
        return self._token is not None and self._clock() < self._expires_at

    async def _refresh(self, exchange: Exchange) -> None:
        async with self._lock:
            if self._clock() < self._refresh_at:  # another exchange (a 401's) got there first
                return
            try:
                await self._mint(exchange)
            except ServeAppError as err:
                retry = getattr(err, "retry_after", None)
                self._refresh_at = min(self._expires_at, self._clock() + (retry or REFRESH_RETRY_S))
                logger.warning("token refresh failed (%s); the current token is valid for %.0f s more",
                               described(err), self._expires_at - self._clock())
            except Exception:  # a task nobody awaits: say it here, or it goes unseen
                self._refresh_at = min(self._expires_at, self._clock() + REFRESH_RETRY_S)
                logger.exception("token refresh failed; the current token is still valid")

    async def after_rejection(self, rejected: Secret, exchange: Exchange) -> bool:
        """The server refused ``rejected`` (``transport._TOKEN_REFUSALS``): mint a new token, unless
        another request already did (or tried, and failed: its error is raised). False when there is
        nothing to refresh (the key itself was sent)."""
        if self.mode != MODE_TOKEN:
            return False
        attempts = self._attempts
        async with self._lock:
            if self._token is rejected:
                self._shared_failure(attempts)
                self._refresh_at = self._expires_at = 0.0  # whatever our clock says, it is over
                await self._mint(exchange)
        return True

    async def _mint(self, exchange: Exchange) -> None:
        try:
            await self._exchange(exchange)
        except Exception as err:
            self._failure, self._attempts = err, self._attempts + 1
            raise
        # Cancelled (its caller's timeout, Ctrl-C): no attempt ended, so nobody waiting shares an
        # outcome; the next in line runs its own exchange.
        self._failure, self._attempts = None, self._attempts + 1

    async def _exchange(self, exchange: Exchange) -> None:
        started = self._clock()
        try:
            answer = await exchange(self._key)
        except APIStatusError as err:
            if self.mode is None and exchange_unavailable(err):
                self.mode = MODE_API_KEY
                logger.info("the server has no token exchange (%s on %s): sending the API key itself", err.status, TOKEN_PATH)
                return
            raise
        token, lifetime = answer.get("access_token"), answer.get("expires_in")
        if not isinstance(token, str) or not isinstance(lifetime, (int, float)) or lifetime <= 0:
            raise ServeAppError(f"{TOKEN_PATH} answered without access_token/expires_in")
        self._token = Secret(token)
        self._expires_at = started + lifetime
        self._refresh_at = self._expires_at - min(self._margin, lifetime / 2)
        self.mode = MODE_TOKEN
        self.exchanges += 1
        logger.debug("minted an access token valid for %ss", lifetime)


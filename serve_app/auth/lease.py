"""Region-wide rate limits with no actor call on the common path: leases from the limiter actor.

The region's limits live in one actor (``ratelimit.RateLimiter``); asking it for every request
costs a Ray actor call on the request path — measured 2.2 ms of TTFT at concurrency 1 and ~15 %
of the router's CPU under load on the 2-core host (docs/benchmarks.md). Instead each router
replica asks it for a *lease*: the request at hand plus a small slice of the key's per-minute
limits (``LEASE_FRACTION``), carved out of the region's buckets. Requests that fit in the slice
are admitted in memory. A lease lives ``LEASE_TTL_S``; what it left unused goes back to the
buckets with the next lease.

So the region never admits more than its limits (a lease is taken from the same buckets every
replica draws on); at worst a key is refused while another replica still holds an unused slice
of its budget — at most ``LEASE_FRACTION`` of a minute's limit per replica, for ``LEASE_TTL_S``.
A key whose limits are tiny (a slice under one request) gets no slice: one actor call a request,
exactly as before.

When the actor does not answer (``SharedRateLimiter`` gives up after 2 s), the replica neither
admits everything nor refuses everything: it enforces each key's limits itself, in its own
buckets, starting from the actor's last answer about that key (plus this replica's unused lease)
and refilling at the tier's rate. A key it has no recent answer for starts with one lease's
slice (at least one request). So a key over its budget stays refused (fail closed) until its
Retry-After, and during an outage a key gets at most its tier's rate from each replica (never
unlimited). The actor is asked again at most every ``OUTAGE_RETRY_S``, so requests do not each
wait for a dead actor; its first answer ends the outage and the replica's buckets are dropped.

A key that keeps sending never waits for the actor: a request admitted from an aging lease has
it renewed in the background (``_renew``), so the next request finds a fresh lease. The renewal
starts ``RENEW_DELAY_S`` after that admission, not at once: at once, its actor call (and the
limiter actor's own work, on the gateway's CPU) ran inside that request's time to its first token
— one stream's requests find the lease aging every one to four admissions, and the TTFT p50 was
0.6–1.6 ms higher in 10 of 10 rounds taking turns (docs/benchmarks.md, "The lease's renewal, off
the first token's way"). The delay is taken out of the lease's first half: it counts as aging
``RENEW_DELAY_S`` before half its life, and a renewal due when it is nearly over starts sooner
(``tests/unit/test_auth_lease.py``: steady streams at intervals from 0.3 to 1.9 s never wait).
Before the background renewal, every lease expiry put one actor call on a request's way: at one
request a second, one request in two or three waited ~3 ms for it, and ~30 ms when the actor's
process (nice 15, as every Ray worker) was not scheduled in time — the c=1 TTFT tail
(docs/benchmarks.md, "The c=1 tail"). A renewal takes the lease out first, so the requests that
arrive while it is on its way wait for its answer as before, and none is admitted twice; the
renewal has no request of its own: the actor admits one (costing no tokens) as if it were, which
the new lease keeps.

What a request cost beyond its admission (``charge``: its real prompt over the estimate) is taken
from this replica's live lease of the key first, with no actor call; what the lease cannot cover
goes to the actor, which may put the key in debt. During an outage this replica's own buckets
take it (for a key they already hold; otherwise it is logged and lost: at most one request's
under-estimate per request served during the outage).
"""

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Protocol

from serve_app.auth.ratelimit import Decision, RateLimiter, Window
from serve_app.telemetry.logs import module_logger

logger = module_logger(__name__)

LEASE_FRACTION = 0.05
LEASE_TTL_S = 2.0
# A lease is renewed once it has less than LEASE_TTL_S / 2 + RENEW_DELAY_S to live, RENEW_DELAY_S
# after the admission that finds it so (past that request's first token), or sooner when it would
# otherwise have less than RENEW_MARGIN_S left as the renewal starts: a key sending steadily at any
# interval below LEASE_TTL_S never finds its lease ended (the actor answering in that margin).
RENEW_DELAY_S = 0.25
RENEW_MARGIN_S = 0.1
# After the actor failed to answer, decide alone this long before asking it again.
OUTAGE_RETRY_S = 1.0
# The actor's last answer about a key says something for a minute: by then any bucket has refilled.
KNOWN_FOR_S = 60.0
MAX_KNOWN = 50_000  # keys remembered; bounded, like the key store's cache


class LeaseSource(Protocol):
    async def lease(
        self, key_id: str, rpm: int, tpm: int, tokens: int, want_requests: int, want_tokens: int,
        returned_requests: int, returned_tokens: int,
    ) -> tuple[Decision, int, int] | None: ...

    async def charge(self, key_id: str, rpm: int, tpm: int, tokens: int) -> Window | None: ...


@dataclass
class _Lease:
    requests: int
    tokens: int
    expires: float
    decision: Decision  # the actor's answer when the lease was taken (for the headers)


@dataclass
class _Known:
    """What the actor last said remains of a key's region-wide budget, and when."""

    requests: int
    tokens: int  # below zero: a debt (``RateLimiter.charge``)
    at: float


class LeasedRateLimiter:
    """The router-side limiter: admits from its lease, goes to the actor only when it runs out."""

    def __init__(self, source: LeaseSource, clock: Callable[[], float] = time.monotonic):
        self.source, self.clock = source, clock
        self._leases: dict[str, _Lease] = {}
        self._renewing: dict[str, asyncio.Lock] = {}
        self._renewals: set[asyncio.Task] = set()  # in the background (kept: the loop holds tasks weakly)
        self._renewals_due: set[str] = set()  # keys with a renewal under way (its delay, or its call)
        self._known: dict[str, _Known] = {}
        self._outage: RateLimiter | None = None  # this replica's own buckets while the actor is away
        self._ask_actor_at = 0.0

    async def acquire(self, key_id: str, rpm: int, tpm: int, tokens: int) -> Decision:
        cost = min(tokens, tpm)  # as the actor charges it: never more than a whole minute's tokens
        if (decision := self._from_lease(key_id, cost)) is not None:
            self._renew_if_aging(key_id, rpm, tpm)
            return decision
        async with self._renewing.setdefault(key_id, asyncio.Lock()):
            # Another request may have renewed the lease while this one waited for the lock.
            if (decision := self._from_lease(key_id, cost)) is not None:
                return decision
            left = self._leases.pop(key_id, None)
            ask = self.clock() >= self._ask_actor_at
            answer = await self._ask_for_lease(key_id, rpm, tpm, tokens, left) if ask else None
            if answer is None:  # the limiter is unavailable (it logged why): decide alone
                if ask:
                    self._ask_actor_at = self.clock() + OUTAGE_RETRY_S
                return self._decide_alone(key_id, rpm, tpm, tokens, left)
        self._outage = None  # the actor answers again: its buckets decide
        decision, requests, granted_tokens = answer
        self._remember(key_id, decision)
        if decision.allowed and (requests or granted_tokens):
            self._leases[key_id] = _Lease(requests, granted_tokens, self.clock() + LEASE_TTL_S, decision)
        return _with_lease(decision, requests, granted_tokens)

    def refuses(self, key_id: str, rpm: int, tpm: int, tokens: int) -> Decision | None:
        """The refusal, when what this replica knows says a request costing at least ``tokens``
        cannot be admitted now; None when it may be (``acquire`` decides): no lease here covers
        it, and the actor's last word about the key, refilled at the tier's rate since, leaves
        less than one request or fewer tokens. Costs no actor call: the router asks before it
        reads the body, so a key already over its limit costs no parse."""
        now, cost = self.clock(), min(tokens, tpm)
        if (lease := self._leases.get(key_id)) is not None and lease.expires >= now:
            if lease.requests >= 1 and lease.tokens >= cost:
                return None
        if self._outage is not None and self._outage.knows(key_id):  # deciding alone: its buckets know
            decision = self._outage.peek(key_id, rpm, tpm, tokens)
            return None if decision.allowed else decision
        known = self._known.get(key_id)
        if known is None:
            return None
        elapsed = now - known.at
        requests, budget = min(rpm, known.requests + elapsed * rpm / 60), min(tpm, known.tokens + elapsed * tpm / 60)
        wait = max((1 - requests) * 60 / rpm, (cost - budget) * 60 / tpm, 0.0)
        if wait == 0:
            return None
        reset_requests, reset_tokens = (rpm - requests) * 60 / rpm, (tpm - budget) * 60 / tpm
        windows = Window(rpm, max(0, int(requests)), reset_requests), Window(tpm, max(0, int(budget)), reset_tokens)
        return Decision(False, *windows, retry_after_s=wait)

    def _renew_if_aging(self, key_id: str, rpm: int, tpm: int) -> None:
        """Have the lease renewed in the background once it has less than ``LEASE_TTL_S / 2 +
        RENEW_DELAY_S`` to live (see ``RENEW_DELAY_S``): not while the actor is away, nor twice at
        once."""
        lease, now = self._leases.get(key_id), self.clock()
        if lease is None or self._outage is not None or now < self._ask_actor_at:
            return
        left = lease.expires - now
        # Due until its task ends: a renewal waiting out its delay or asking the actor. (The key's
        # lock is never held while it has a lease: whoever takes it takes the lease out first.)
        if left >= LEASE_TTL_S / 2 + RENEW_DELAY_S or key_id in self._renewals_due:
            return
        self._renewals_due.add(key_id)
        delay = min(RENEW_DELAY_S, max(0.0, left - RENEW_MARGIN_S))
        task = asyncio.get_running_loop().create_task(self._renew(key_id, rpm, tpm, delay))
        self._renewals.add(task)
        task.add_done_callback(self._renewals.discard)
        # However it ends (even cancelled before it ran), the key may be renewed again.
        task.add_done_callback(lambda _: self._renewals_due.discard(key_id))

    async def _renew(self, key_id: str, rpm: int, tpm: int, delay: float) -> None:
        if delay > 0:
            await asyncio.sleep(delay)
        if self._outage is not None or self.clock() < self._ask_actor_at:
            return  # the actor went away meanwhile: the lease lives out its time, as at an outage
        async with self._renewing.setdefault(key_id, asyncio.Lock()):
            left = self._leases.get(key_id)
            if left is None or left.expires - self.clock() >= LEASE_TTL_S / 2 + RENEW_DELAY_S:
                return  # expired and dropped, or renewed meanwhile
            del self._leases[key_id]  # from here its requests wait for the answer: none is used twice
            answer = await self._ask_for_lease(key_id, rpm, tpm, 0, left)
            if answer is None:  # the actor is away: nothing was returned, the lease is still ours
                self._ask_actor_at = self.clock() + OUTAGE_RETRY_S
                self._leases.setdefault(key_id, left)
                return
            decision, requests, granted_tokens = answer
            self._remember(key_id, decision)
            if decision.allowed:  # the request the actor admitted for it is the lease's too
                self._leases[key_id] = _Lease(requests + 1, granted_tokens, self.clock() + LEASE_TTL_S, decision)

    def _ask_for_lease(
        self, key_id: str, rpm: int, tpm: int, tokens: int, left: _Lease | None
    ) -> Awaitable[tuple[Decision, int, int] | None]:
        """The actor's call for a request of ``tokens`` and a new lease, returning what ``left``
        (the old lease, taken out) did not use."""
        return self.source.lease(
            key_id, rpm, tpm, tokens, int(rpm * LEASE_FRACTION), int(tpm * LEASE_FRACTION),
            left.requests if left else 0, left.tokens if left else 0,
        )

    async def charge(self, key_id: str, rpm: int, tpm: int, tokens: int) -> None:
        """Charge ``tokens`` more to ``key_id``, never refused: from its live lease here first,
        the rest in the actor (or, while it is away, in this replica's buckets). Below zero,
        tokens given back: to the live lease (it returns what it leaves unused to the region's
        bucket with its renewal), else where a charge would go, never over the bucket's capacity."""
        lease = self._leases.get(key_id)
        if tokens < 0 and lease is not None and lease.expires >= self.clock():
            # Never more than one slice in a lease (what the actor grants one): the rest goes back
            # where a charge goes, so a refund of a charge made elsewhere (an outage's buckets)
            # cannot grow what this replica admits alone.
            back = min(-tokens, max(0, int(tpm * LEASE_FRACTION) - lease.tokens))
            lease.tokens += back
            tokens += back
        if tokens > 0 and lease is not None and lease.expires >= self.clock():
            taken = min(lease.tokens, tokens)  # carved out of the region's bucket for this key already
            lease.tokens -= taken
            tokens -= taken
        if tokens == 0:
            return
        if self._outage is not None and self._outage.knows(key_id):
            self._outage.charge(key_id, tpm, tokens)
        elif await self.source.charge(key_id, rpm, tpm, tokens) is None:
            logger.warning("rate limiter unavailable: %+d tokens of key %s (beyond its admission) are not counted",
                           tokens, key_id)

    def _decide_alone(self, key_id: str, rpm: int, tpm: int, tokens: int, left: _Lease | None) -> Decision:
        if self._outage is None:
            logger.warning("rate limiter unavailable: this replica enforces each key's limits alone")
            self._outage = RateLimiter(self.clock)
        if not self._outage.knows(key_id):
            now = self.clock()
            known = self._known.get(key_id)
            if known is not None and now - known.at < KNOWN_FOR_S:
                requests, budget, at = float(known.requests), float(known.tokens), known.at
            else:  # nothing recent: one lease's slice, enough for this request at least
                requests, budget, at = max(1.0, rpm * LEASE_FRACTION), max(tpm * LEASE_FRACTION, min(tokens, tpm)), now
            if left is not None:  # this replica's unused lease was carved out for it: still its own
                requests, budget = requests + left.requests, budget + left.tokens
            self._outage.seed(key_id, rpm, tpm, requests, budget, at)
        return self._outage.acquire(key_id, rpm, tpm, tokens)

    def _remember(self, key_id: str, decision: Decision) -> None:
        if len(self._known) >= MAX_KNOWN:
            cutoff = self.clock() - KNOWN_FOR_S
            self._known = {k: v for k, v in self._known.items() if v.at > cutoff}
            if len(self._known) >= MAX_KNOWN:
                self._known.clear()
        # The tokens with their sign: a key in debt is refused before its body (``refuses``) and
        # stays in debt if the actor goes away (``_decide_alone``).
        self._known[key_id] = _Known(decision.requests.remaining, decision.tokens.signed, self.clock())

    def _from_lease(self, key_id: str, cost: int) -> Decision | None:
        lease = self._leases.get(key_id)
        if lease is None or lease.expires < self.clock() or lease.requests < 1 or lease.tokens < cost:
            return None
        lease.requests -= 1
        lease.tokens -= cost
        return _with_lease(lease.decision, lease.requests, lease.tokens)


def _with_lease(decision: Decision, requests: int, tokens: int) -> Decision:
    """The headers count what this replica still holds as remaining: it is the key's to use."""
    return replace(
        decision,
        requests=_plus(decision.requests, requests),
        tokens=_plus(decision.tokens, tokens),
    )


def _plus(window: Window, extra: int) -> Window:
    return Window(window.limit, min(window.limit, window.remaining + extra), window.reset_s)

"""Per-key rate limits: requests/min and tokens/min, enforced region-wide.

``RateLimiter`` is plain token-bucket arithmetic (unit-tested without Ray). In a region it lives in
one named Ray actor that every router replica calls (``SharedRateLimiter``), so N router replicas
enforce the limit once, not N times.

Tokens are charged up front, when the request is admitted: its price (``router/pricing.py``: the
prompt estimated from its size plus every sequence's completion limit, as the engine will obey
it). There is no refund for a shorter answer: simple, bounded, and it is what a caller asked to be
allowed to use. The prompt estimate can be under the engine's real count; what a request turns out
to have cost beyond its charge is charged once it is known (``charge``), never refused: the bucket
may go below zero, a debt the key's next requests wait out.
"""

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from serve_app.telemetry.logs import module_logger

logger = module_logger(__name__)

ACTOR_NAMESPACE = "serve_app"
# The limiter is on every request's path: if it does not answer this fast, the router replica
# enforces the key's limits itself from what it last knew (serve_app/auth/lease.py), logged.
ACTOR_TIMEOUT_S = 2


@dataclass(frozen=True)
class Window:
    """One dimension (requests or tokens) as the ``x-ratelimit-*`` headers report it."""

    limit: int
    remaining: int
    reset_s: float  # until the bucket is full again
    # ``remaining`` with its sign: below zero, a debt. None from a limiter actor older than the
    # field (detached, it outlives a deploy: docs/operations.md), where ``remaining`` stands for it.
    level: int | None = None

    @property
    def signed(self) -> int:
        return self.remaining if self.level is None else self.level


@dataclass(frozen=True)
class Decision:
    allowed: bool
    requests: Window
    tokens: Window
    retry_after_s: float = 0.0

    def headers(self) -> dict[str, str]:
        headers = {}
        for name, window in (("requests", self.requests), ("tokens", self.tokens)):
            headers[f"x-ratelimit-limit-{name}"] = str(window.limit)
            headers[f"x-ratelimit-remaining-{name}"] = str(window.remaining)
            headers[f"x-ratelimit-reset-{name}"] = f"{window.reset_s:.3f}s"
        if not self.allowed:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
            headers["retry-after-ms"] = str(max(1, math.ceil(self.retry_after_s * 1000)))
        return headers


@dataclass
class _Bucket:
    capacity: float
    level: float
    updated: float

    def refill(self, capacity: float, now: float) -> float:
        # A tier change applies at once: the bucket is clamped to the new capacity.
        self.capacity = capacity
        self.level = min(capacity, self.level + (now - self.updated) * capacity / 60)
        self.updated = now
        return self.level

    def seconds_until(self, level: float) -> float:
        return max(0.0, (level - self.level) * 60 / self.capacity)


class RateLimiter:
    """Token buckets per (key, dimension): capacity = the per-minute limit, refilled continuously."""

    PRUNE_EVERY = 10_000  # acquisitions between sweeps that drop full (idle) buckets

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        self._calls = 0

    def acquire(self, key_id: str, requests_per_minute: int, tokens_per_minute: int, tokens: int) -> Decision:
        """Admit one request costing ``tokens``, or not; both buckets or neither are charged."""
        now = self.clock()
        self._prune(now)
        return self._admit(key_id, requests_per_minute, tokens_per_minute, tokens, now)

    def _admit(self, key_id: str, requests_per_minute: int, tokens_per_minute: int, tokens: int, now: float) -> Decision:
        requests = self._bucket(key_id, "requests", requests_per_minute, now)
        token_bucket = self._bucket(key_id, "tokens", tokens_per_minute, now)
        # A request larger than a whole minute's tokens could never pass: it costs a full bucket.
        cost = min(tokens, tokens_per_minute)
        # Zero tokens is a request the engine never runs — a refused one's count (``count_refused``),
        # a lease's renewal, a route that costs no tokens (``GET /v1/models``); a request the
        # engine runs is priced at least one token. It needs a request only: a key in token debt
        # (``charge``) still pays for its refusals in requests, so it cannot have bodies parsed
        # faster than its requests/min.
        allowed = requests.level >= 1 and (cost == 0 or token_bucket.level >= cost)
        retry_after = 0.0
        if allowed:
            requests.level -= 1
            token_bucket.level -= cost
        else:
            retry_after = max(requests.seconds_until(1), token_bucket.seconds_until(cost))
        return Decision(
            allowed=allowed,
            requests=self._window(requests),
            tokens=self._window(token_bucket),
            retry_after_s=retry_after,
        )

    def peek(self, key_id: str, requests_per_minute: int, tokens_per_minute: int, tokens: int) -> Decision:
        """What ``acquire`` would decide for a request costing ``tokens``, charging nothing."""
        now = self.clock()
        requests = self._bucket(key_id, "requests", requests_per_minute, now)
        token_bucket = self._bucket(key_id, "tokens", tokens_per_minute, now)
        cost = min(tokens, tokens_per_minute)
        wait = max(requests.seconds_until(1), token_bucket.seconds_until(cost))
        return Decision(wait == 0, self._window(requests), self._window(token_bucket), retry_after_s=wait)

    def lease(
        self, key_id: str, requests_per_minute: int, tokens_per_minute: int, tokens: int,
        want_requests: int, want_tokens: int, returned_requests: int = 0, returned_tokens: int = 0,
    ) -> tuple[Decision, int, int]:
        """Admit one request costing ``tokens`` and reserve up to ``want_*`` more for the caller
        to admit locally (serve_app/auth/lease.py): ``(decision, requests, tokens)`` granted on top
        of this request. ``returned_*``: what the caller's previous lease left unused."""
        now = self.clock()
        self._prune(now)  # first: a sweep between here and the grant would debit buckets no longer kept
        requests = self._bucket(key_id, "requests", requests_per_minute, now)
        token_bucket = self._bucket(key_id, "tokens", tokens_per_minute, now)
        requests.level = min(requests.capacity, requests.level + max(0, returned_requests))
        token_bucket.level = min(token_bucket.capacity, token_bucket.level + max(0, returned_tokens))
        decision = self._admit(key_id, requests_per_minute, tokens_per_minute, tokens, now)
        if not decision.allowed:
            return decision, 0, 0
        granted_requests = max(0, min(want_requests, int(requests.level)))
        granted_tokens = max(0, min(want_tokens, int(token_bucket.level)))
        requests.level -= granted_requests
        token_bucket.level -= granted_tokens
        decision = Decision(True, self._window(requests), self._window(token_bucket))
        return decision, granted_requests, granted_tokens

    def charge(self, key_id: str, tokens_per_minute: int, tokens: int) -> Window:
        """Charge ``tokens`` a request turned out to cost beyond what admitting it charged (its
        real prompt over the estimate). Never refused: the bucket may go below zero, and the
        key's next requests wait until it has refilled past their cost (their Retry-After).
        Below zero, tokens given back (a request the region did not serve): never over capacity."""
        bucket = self._bucket(key_id, "tokens", tokens_per_minute, self.clock())
        bucket.level = min(bucket.capacity, bucket.level - tokens)
        return self._window(bucket)

    def knows(self, key_id: str) -> bool:
        return (key_id, "requests") in self._buckets

    def seed(self, key_id: str, requests_per_minute: int, tokens_per_minute: int,
             requests: float, tokens: float, at: float) -> None:
        """Start a key's buckets at the levels someone else last reported (at ``at``, on this
        limiter's clock); they refill from then on, as the reporter's would have. A token debt
        (below zero) is kept: the key waits it out here too."""
        for dimension, capacity, level in (("requests", requests_per_minute, requests), ("tokens", tokens_per_minute, tokens)):
            floor = 0.0 if dimension == "requests" else -math.inf
            self._buckets[(key_id, dimension)] = _Bucket(capacity, max(floor, min(capacity, level)), at)

    def _bucket(self, key_id: str, dimension: str, capacity: int, now: float) -> _Bucket:
        bucket = self._buckets.setdefault((key_id, dimension), _Bucket(capacity, capacity, now))
        bucket.refill(capacity, now)
        return bucket

    @staticmethod
    def _window(bucket: _Bucket) -> Window:
        # In debt (charge), nothing remains: the headers never report a negative number; ``level``
        # keeps the debt for the routers (``lease.py``: a key in debt is refused before its body).
        return Window(int(bucket.capacity), max(0, int(bucket.level)), bucket.seconds_until(bucket.capacity),
                      level=math.floor(bucket.level))

    def _prune(self, now: float) -> None:
        # A full bucket is the same as no bucket: forgetting it bounds memory by active keys.
        self._calls += 1
        if self._calls % self.PRUNE_EVERY == 0:
            self._buckets = {k: b for k, b in self._buckets.items() if b.refill(b.capacity, now) < b.capacity}

    def bucket_count(self) -> int:
        return len(self._buckets)


class LocalRateLimiter:
    """In-process limiter with the router-side interface (unit tests, single-process use)."""

    def __init__(self, limiter: RateLimiter | None = None):
        self.limiter = limiter or RateLimiter()

    async def acquire(self, key_id: str, rpm: int, tpm: int, tokens: int) -> Decision | None:
        return self.limiter.acquire(key_id, rpm, tpm, tokens)

    async def lease(self, *args: int | str) -> tuple[Decision, int, int] | None:
        return self.limiter.lease(*args)

    async def charge(self, key_id: str, rpm: int, tpm: int, tokens: int) -> Window | None:
        return self.limiter.charge(key_id, tpm, tokens)

    def refuses(self, key_id: str, rpm: int, tpm: int, tokens: int) -> Decision | None:
        decision = self.limiter.peek(key_id, rpm, tpm, tokens)
        return None if decision.allowed else decision


class SharedRateLimiter:
    """The router replicas' client of the region's one limiter actor.

    The actor is named per region and created by whichever replica asks first
    (``get_if_exists``); it is detached so it outlives the replica that created it, asks for no
    CPU (it must never keep a model replica from being placed), and Ray restarts it if it dies.
    It is placed on the node of the router that creates it (a region's head): Ray places an actor
    that asks for no resource on a node picked at random, a GPU worker's as likely, whose
    scale-down or eviction restarted it with every key's buckets full.
    """

    def __init__(self, region: str):
        self.actor_name = f"ratelimit-{region}"
        self._actor = None

    def actor(self):
        if self._actor is None:
            import ray

            options = self.actor_options(ray.get_runtime_context().get_node_id())
            self._actor = ray.remote(RateLimiter).options(**options).remote()
        return self._actor

    def actor_options(self, node_id: str) -> dict[str, Any]:
        """The actor's options when a router on ``node_id`` creates it (soft: on a node that is
        gone, Ray places it elsewhere rather than never)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return {
            "name": self.actor_name,
            "namespace": ACTOR_NAMESPACE,
            "get_if_exists": True,
            "lifetime": "detached",
            "num_cpus": 0,
            "max_restarts": -1,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=True),
        }

    def refuses(self, key_id: str, rpm: int, tpm: int, tokens: int) -> Decision | None:
        """Nothing is known here without an actor call (the router's ``LeasedRateLimiter`` knows)."""
        return None

    async def acquire(self, key_id: str, rpm: int, tpm: int, tokens: int) -> Decision | None:
        return await self._call("acquire", key_id, rpm, tpm, tokens)

    async def lease(self, *args: int | str) -> tuple[Decision, int, int] | None:
        """``RateLimiter.lease`` in the actor; None when it is unavailable (the lease's holder
        then decides from its last known state: serve_app/auth/lease.py)."""
        return await self._call("lease", *args)

    async def charge(self, key_id: str, rpm: int, tpm: int, tokens: int) -> Window | None:
        """``RateLimiter.charge`` in the actor; None when it is unavailable."""
        return await self._call("charge", key_id, tpm, tokens)

    async def _call(self, method: str, *args):
        try:
            ref = getattr(self.actor(), method).remote(*args)
            return await asyncio.wait_for(ref, timeout=ACTOR_TIMEOUT_S)
        except Exception as err:  # the caller decides without it (lease.py); the outage is logged
            logger.error("rate limiter %s unavailable (%s)", self.actor_name, type(err).__name__)
            self._actor = None  # look it up again next time
            return None

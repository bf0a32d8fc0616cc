"""Leased admission (serve_app/auth/lease.py): region-wide limits with few actor calls."""

import asyncio

import pytest

from serve_app.auth import lease as lease_module
from serve_app.auth.lease import LeasedRateLimiter
from serve_app.auth.ratelimit import LocalRateLimiter, RateLimiter


@pytest.fixture(autouse=True)
def renew_at_once(monkeypatch):
    """Renewals start in the admitting request's loop turn here, so a test's fake clock decides
    when a lease ages; the delay itself has a test of its own."""
    monkeypatch.setattr(lease_module, "RENEW_DELAY_S", 0)


class CountingSource(LocalRateLimiter):
    """The region's limiter as the router sees it, counting the calls (each one an actor call)."""

    def __init__(self, limiter: RateLimiter):
        super().__init__(limiter)
        self.calls = 0

    async def lease(self, *args):
        self.calls += 1
        return await super().lease(*args)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _admit(limiter: LeasedRateLimiter, n: int, rpm=600, tpm=1_000_000, tokens=100) -> list[bool]:
    async def run():
        return [(await limiter.acquire("k", rpm, tpm, tokens)).allowed for _ in range(n)]

    return asyncio.run(run())


def test_most_requests_are_admitted_without_asking_the_actor():
    clock = Clock()
    source = CountingSource(RateLimiter(clock))
    limiter = LeasedRateLimiter(source, clock)
    assert _admit(limiter, 60) == [True] * 60
    # 600 rpm: each lease is the request plus 5 % (30 requests) → 2 actor calls for 60 requests.
    assert source.calls == 2


def test_replicas_together_never_exceed_the_regions_limit():
    clock = Clock()  # frozen: the buckets do not refill during the test
    shared = RateLimiter(clock)
    replicas = [LeasedRateLimiter(CountingSource(shared), clock) for _ in range(3)]
    admitted = sum(sum(_admit(replica, 80, rpm=200)) for replica in replicas)
    assert admitted <= 200
    # Refused while another replica still holds an unused slice: at most one slice (10) each.
    assert admitted >= 200 - 3 * 10


def test_a_lease_gives_what_it_left_unused_back_when_it_is_renewed():
    clock = Clock()  # frozen: only leases move the buckets
    shared = RateLimiter(clock)
    limiter = LeasedRateLimiter(CountingSource(shared), clock)
    # rpm 100 → slices of 5 requests; tpm 1e6 → slices of 50 000 tokens; each request costs 100.
    assert _admit(limiter, 6, rpm=100) == [True] * 6  # one lease: this request + 5 from the slice
    tokens = shared._buckets[("k", "tokens")]
    assert tokens.level == 1_000_000 - 100 - 50_000
    assert _admit(limiter, 1, rpm=100) == [True]  # out of requests: renew, returning 49 500 tokens
    assert tokens.level == 1_000_000 - 100 - 50_000 + 49_500 - 100 - 50_000


def test_an_expired_lease_is_not_used():
    clock = Clock()
    source = CountingSource(RateLimiter(clock))
    limiter = LeasedRateLimiter(source, clock)
    _admit(limiter, 1)
    clock.now += lease_module.LEASE_TTL_S + 0.001
    _admit(limiter, 1)
    assert source.calls == 2


class DownAfterFirst(CountingSource):
    """The actor answers the first call, then never again (each later call times out)."""

    async def lease(self, *args):
        self.calls += 1
        return await LocalRateLimiter.lease(self, *args) if self.calls == 1 else None


async def _lease_then_age_it(limiter: LeasedRateLimiter, clock: Clock) -> None:
    """Key "k"'s first lease, then a request 1.5 s later admitted from it: its renewal is due."""
    await limiter.acquire("k", 600, 1_000_000, 100)
    clock.now += 1.5
    await limiter.acquire("k", 600, 1_000_000, 100)


class ForegroundSource(CountingSource):
    """Tells the actor calls a request waited for (made in its own task) from background ones."""

    def __init__(self, limiter: RateLimiter):
        super().__init__(limiter)
        self.foreground, self.request_task = 0, None

    async def lease(self, *args):
        self.foreground += asyncio.current_task() is self.request_task
        return await super().lease(*args)


def _steady(limiter: LeasedRateLimiter, source: ForegroundSource, clock: Clock, n: int, every_s: float,
            rpm=600) -> list[bool]:
    """``n`` requests ``every_s`` apart, each waited for; background work runs between them."""
    async def run():
        source.request_task, allowed = asyncio.current_task(), []
        for _ in range(n):
            allowed.append((await limiter.acquire("k", rpm, 1_000_000, 100)).allowed)
            for _ in range(5):  # the renewal's task: its actor call, then its new lease
                await asyncio.sleep(0)
            clock.now += every_s
        return allowed

    return asyncio.run(run())


def test_a_key_that_keeps_sending_never_waits_for_the_actor_after_its_first_request():
    """One request every 0.7 s outlives a 2 s lease: without the renewal in the background every
    third request waited for the actor (~3 ms; ~30 ms when its process was not scheduled)."""
    clock = Clock()
    source = ForegroundSource(RateLimiter(clock))
    limiter = LeasedRateLimiter(source, clock)
    assert _steady(limiter, source, clock, 30, 0.7) == [True] * 30
    assert source.foreground == 1 and source.calls >= 10  # the first request's, then renewals only


def test_renewals_in_the_background_never_admit_more_than_the_regions_limit():
    """Buckets that never refill (their clock frozen): every request any lease admits came out of
    them, and what a renewal returns goes back; the lease still held counts as taken."""
    frozen, moving = Clock(), Clock()
    shared = RateLimiter(frozen)
    source = ForegroundSource(shared)
    limiter = LeasedRateLimiter(source, moving)
    allowed = _steady(limiter, source, moving, 150, 0.7, rpm=100)
    held = limiter._leases["k"].requests if "k" in limiter._leases else 0
    requests_left = shared._buckets[("k", "requests")].level
    assert sum(allowed) + held + requests_left == 100  # nothing admitted twice, nothing lost
    assert sum(allowed) >= 100 - 6 and allowed[-1] is False  # all but a slice, then refused
    assert source.calls > source.foreground  # renewed in the background along the way


def test_a_request_that_comes_while_its_lease_is_renewed_waits_for_it_and_uses_the_new_one():
    clock = Clock()

    class Gated(CountingSource):
        def __init__(self, limiter):
            super().__init__(limiter)
            self.gate = asyncio.Event()

        async def lease(self, *args):
            if self.calls >= 1:  # the renewal's call waits until the test opens the gate
                await self.gate.wait()
            return await super().lease(*args)

    async def run():
        source = Gated(RateLimiter(clock))
        limiter = LeasedRateLimiter(source, clock)
        assert (await limiter.acquire("k", 600, 1_000_000, 100)).allowed  # the first lease
        clock.now += 1.5  # past half its life: the next admission starts the renewal
        assert (await limiter.acquire("k", 600, 1_000_000, 100)).allowed
        await asyncio.sleep(0)  # the renewal takes the lease and waits at the gate
        waiting = asyncio.ensure_future(limiter.acquire("k", 600, 1_000_000, 100))
        await asyncio.sleep(0)
        assert not waiting.done()  # no lease to use while the old one is being returned
        source.gate.set()
        assert (await waiting).allowed
        return source.calls, limiter._leases["k"].requests

    calls, left = asyncio.run(run())
    # Two actor calls: the first lease and the renewal (30 + the one it kept), the waiter used it.
    assert calls == 2 and left == 30 + 1 - 1


def test_a_renewal_starts_after_the_request_that_found_the_lease_aging_not_in_its_way(monkeypatch):
    """The renewal's actor call would share the admitted request's time to first token: it starts
    RENEW_DELAY_S later, once, however many requests the aging lease admits meanwhile."""
    monkeypatch.setattr(lease_module, "RENEW_DELAY_S", 0.05)
    clock = Clock()

    async def run():
        source = CountingSource(RateLimiter(clock))
        limiter = LeasedRateLimiter(source, clock)
        assert (await limiter.acquire("k", 600, 1_000_000, 100)).allowed  # the first lease
        clock.now += 1.5  # past half its life
        for _ in range(3):  # admitted from the aging lease: one renewal due, none started
            assert (await limiter.acquire("k", 600, 1_000_000, 100)).allowed
            for _ in range(5):
                await asyncio.sleep(0)
        calls_before = source.calls
        await asyncio.sleep(0.2)  # past the delay: the one renewal ran
        return calls_before, source.calls, limiter._leases["k"].expires - clock.now

    calls_before, calls_after, left_s = asyncio.run(run())
    assert calls_before == 1 and calls_after == 2 and left_s == lease_module.LEASE_TTL_S


def _steady_in_time(limiter: LeasedRateLimiter, source: ForegroundSource, clock: Clock, n: int,
                    every_s: float) -> list[bool]:
    """``n`` requests ``every_s`` apart on an event loop whose clock is the test's: the renewals'
    delays pass as the requests' time does (10 ms steps, the loop turning at each)."""
    async def run():
        source.request_task, allowed = asyncio.current_task(), []
        for _ in range(n):
            allowed.append((await limiter.acquire("k", 600, 1_000_000, 100)).allowed)
            for _ in range(round(every_s / 0.01)):
                clock.now += 0.01
                for _ in range(3):
                    await asyncio.sleep(0)
        return allowed

    loop = asyncio.new_event_loop()
    loop.time = clock
    try:
        return loop.run_until_complete(run())
    finally:
        loop.close()


@pytest.mark.parametrize("every_s", [0.3, 0.9, 1.2, 1.6, 1.9])
def test_a_steady_key_never_waits_for_the_actor_with_the_renewal_delayed(monkeypatch, every_s):
    """The delay comes out of the lease's first half: a renewal due just before its end starts
    sooner. (Taken from the second half, the lease ended before its renewal at 0.9, 1.2 and 1.9 s,
    and at 1.2 s one request in three found it ended and waited for the actor.)"""
    monkeypatch.setattr(lease_module, "RENEW_DELAY_S", 0.25)
    clock = Clock()
    source = ForegroundSource(RateLimiter(clock))
    limiter = LeasedRateLimiter(source, clock)
    ask, left_at_renewal = limiter._ask_for_lease, []

    def asking(key_id, rpm, tpm, tokens, left):  # the time the lease a renewal returns had left
        if left is not None:
            left_at_renewal.append(left.expires - clock())
        return ask(key_id, rpm, tpm, tokens, left)

    limiter._ask_for_lease = asking
    assert _steady_in_time(limiter, source, clock, 20, every_s) == [True] * 20
    assert source.foreground == 1 and len(left_at_renewal) >= 20 * every_s / lease_module.LEASE_TTL_S
    assert min(left_at_renewal) > 0  # every renewal found its lease still live


def test_a_renewal_due_when_the_actor_goes_away_is_not_asked_of_it(monkeypatch):
    """Another key found the actor down while this key's renewal waited out its delay: the
    renewal does not call the dead actor (each such call holds the key's lock for its 2 s
    timeout); the lease lives out its time, as at an outage."""
    monkeypatch.setattr(lease_module, "RENEW_DELAY_S", 0.05)
    clock = Clock()
    limiter = LeasedRateLimiter(source := DownAfterFirst(RateLimiter(clock)), clock)

    async def run():
        await _lease_then_age_it(limiter, clock)  # its renewal is due in 0.05 s
        assert (await limiter.acquire("other", 600, 1_000_000, 100)).allowed  # the actor is down
        await asyncio.sleep(0.2)
        return limiter._leases["k"].requests

    assert asyncio.run(run()) == 30 - 1 and source.calls == 2  # the lease kept, less its one request


def test_a_renewal_the_actor_does_not_answer_leaves_the_lease_to_its_end():
    clock = Clock()
    limiter = LeasedRateLimiter(source := DownAfterFirst(RateLimiter(clock)), clock)

    async def run():
        await _lease_then_age_it(limiter, clock)  # starts a renewal, which gets no answer
        for _ in range(5):
            await asyncio.sleep(0)
        return [(await limiter.acquire("k", 600, 1_000_000, 100)).allowed for _ in range(3)]

    assert asyncio.run(run()) == [True] * 3
    assert source.calls == 2  # the renewal's, once: not again until OUTAGE_RETRY_S
    assert limiter._leases["k"].requests == 30 - 4  # the lease it kept, used by four requests


def test_tiny_limits_get_no_slice_so_every_request_asks_the_actor():
    clock = Clock()
    source = CountingSource(RateLimiter(clock))
    limiter = LeasedRateLimiter(source, clock)
    assert _admit(limiter, 4, rpm=3) == [True, True, True, False]
    assert source.calls == 4


def test_headers_count_the_leased_slice_as_remaining():
    clock = Clock()
    limiter = LeasedRateLimiter(CountingSource(RateLimiter(clock)), clock)

    async def run():
        return [await limiter.acquire("k", 100, 1_000_000, 1) for _ in range(2)]

    first, second = asyncio.run(run())
    assert first.requests.remaining == 99 and second.requests.remaining == 98


def test_a_limiter_outage_is_decided_by_the_replica_not_failed_open():
    class Down:
        async def lease(self, *args):
            return None

    limiter = LeasedRateLimiter(Down(), Clock())
    # A key it knows nothing about: one lease's slice (30 of 600/min), then refused until refill.
    decisions = [asyncio.run(limiter.acquire("k", 600, 1_000_000, 10)) for _ in range(40)]
    assert [d.allowed for d in decisions] == [True] * 30 + [False] * 10
    assert decisions[-1].retry_after_s > 0


class ChargedSource(CountingSource):
    charges = 0

    async def charge(self, *args):
        self.charges += 1
        return await super().charge(*args)


def test_a_charge_comes_out_of_the_live_lease_without_an_actor_call():
    clock = Clock()
    shared = RateLimiter(clock)
    source = ChargedSource(shared)
    limiter = LeasedRateLimiter(source, clock)
    _admit(limiter, 1, rpm=600, tpm=100_000, tokens=100)  # lease: 5 000 tokens beside this request
    asyncio.run(limiter.charge("k", 600, 100_000, 3_000))
    assert source.charges == 0 and limiter._leases["k"].tokens == 2_000
    asyncio.run(limiter.charge("k", 600, 100_000, 7_000))  # 2 000 from the lease, 5 000 from the region
    assert source.charges == 1 and limiter._leases["k"].tokens == 0
    assert shared._buckets[("k", "tokens")].level == 100_000 - 100 - 5_000 - 5_000


def test_a_charge_after_the_lease_expired_goes_to_the_region_and_may_leave_a_debt():
    clock = Clock()
    shared = RateLimiter(clock)
    source = ChargedSource(shared)
    limiter = LeasedRateLimiter(source, clock)
    _admit(limiter, 1, rpm=600, tpm=1_000, tokens=900)  # no slice left to lease
    clock.now += lease_module.LEASE_TTL_S + 1
    asyncio.run(limiter.charge("k", 600, 1_000, 2_000))
    assert source.charges == 1 and shared._buckets[("k", "tokens")].level < 0
    assert _admit(limiter, 1, rpm=600, tpm=1_000, tokens=10) == [False]  # in debt: refused


def test_during_an_outage_the_replicas_own_buckets_take_the_charge():
    class Down:
        async def lease(self, *args):
            return None

        async def charge(self, *args):
            return None

    clock = Clock()
    limiter = LeasedRateLimiter(Down(), clock)
    assert _admit(limiter, 1, rpm=600, tpm=1_000, tokens=50) == [True]  # decided alone: 50 of a 50 slice
    asyncio.run(limiter.charge("k", 600, 1_000, 500))
    assert limiter._outage._buckets[("k", "tokens")].level == pytest.approx(-500)
    asyncio.run(limiter.charge("unseen", 600, 1_000, 500))  # a key it holds nothing for: logged, not counted


def test_what_the_actor_last_said_refuses_a_key_before_its_body_is_read_and_refills_at_the_tiers_rate():
    clock = Clock()
    source = CountingSource(RateLimiter(clock))
    limiter = LeasedRateLimiter(source, clock)
    assert limiter.refuses("k", 2, 1_000, 10) is None  # nothing known yet: admission decides
    assert _admit(limiter, 3, rpm=2, tpm=1_000, tokens=10) == [True, True, False]
    calls = source.calls
    refused = limiter.refuses("k", 2, 1_000, 10)
    assert refused is not None and not refused.allowed and 0 < refused.retry_after_s <= 30
    assert refused.headers()["x-ratelimit-remaining-requests"] == "0"
    assert source.calls == calls  # decided without an actor call
    clock.now += 30  # 2 requests/min: one has come back
    assert limiter.refuses("k", 2, 1_000, 10) is None
    # A request whose prompt alone is more than the key has left of its tokens is refused too.
    assert asyncio.run(limiter.acquire("t", 600, 100, 90)).allowed
    assert limiter.refuses("t", 600, 100, 50) is not None and limiter.refuses("t", 600, 100, 5) is None


def test_a_key_in_debt_is_refused_before_its_body_and_stays_in_debt_through_an_outage():
    """The actor's signed level is what the router remembers: a key whose real prompts put it in
    token debt is refused unread, also for a body of no declared size (0 tokens), and an outage
    does not forgive the debt (the replica's own buckets start from it)."""
    clock = Clock()
    shared = RateLimiter(clock)
    source = CountingSource(shared)
    limiter = LeasedRateLimiter(source, clock)
    assert _admit(limiter, 1, rpm=600, tpm=1_000, tokens=1_000) == [True]  # no token slice left to lease
    shared.charge("k", 1_000, 3_000)  # its real prompt was 3,000 over the estimate: -3,000
    assert _admit(limiter, 1, rpm=600, tpm=1_000, tokens=10) == [False]  # the actor says so, and its level
    refused = limiter.refuses("k", 600, 1_000, 0)
    assert refused is not None and refused.retry_after_s == pytest.approx(180)  # -3,000 → 0 at 1,000/min

    class Down:
        async def lease(self, *args):
            return None

    limiter.source = Down()
    clock.now += 30  # half a minute refilled 500 of the 3,000
    assert _admit(limiter, 1, rpm=600, tpm=1_000, tokens=10) == [False]  # decided alone, still in debt
    clock.now += 160  # 3,166 refilled since the actor's answer
    assert _admit(limiter, 1, rpm=600, tpm=1_000, tokens=10) == [True]


def test_a_refusals_count_is_taken_from_a_key_in_debt():
    clock = Clock()
    shared = RateLimiter(clock)
    limiter = LeasedRateLimiter(CountingSource(shared), clock)
    assert _admit(limiter, 1, rpm=3, tpm=1_000, tokens=900) == [True]
    shared.charge("k", 1_000, 3_000)
    assert _admit(limiter, 3, rpm=3, tpm=1_000, tokens=0) == [True, True, False]  # 3 requests a minute

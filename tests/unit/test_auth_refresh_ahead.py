"""The key cache's refresh ahead (``serve_app/auth/cache.py``, ``refresh.py``): a key in steady
use never waits for the registry on its request's path, no request ever waits for a background
re-read, and an edit still reaches the router within the TTL. The cache runs on a clock the test
moves; background re-reads are jobs the test runs when it chooses (real threads where the
router's own store is under test). No sleeps, no timing thresholds."""

import asyncio
import logging
import threading
from concurrent.futures import Future

import pytest

from serve_app.auth.cache import CacheMiss, LookupCache
from serve_app.auth.database import RegistryUnavailable
from serve_app.auth.keys import SCOPE_INFERENCE
from serve_app.auth.refresh import FAILURE_LOG_INTERVAL_S, Refresher
from serve_app.errors import APIError
from tests.unit.auth_support import claims, current_key, sign
from tests.unit.test_auth_registry_misses import TTL_S, Clock, _router

FAILED = "key registry: re-reading a cached row failed (test: the registry is down); rows expire and are read as requests come"


class Registry:
    """One row's value, and on which path each read of it ran."""

    def __init__(self, value="v1"):
        self.value, self.down, self.reads = value, False, []
        self.after_read = None  # runs once a read has its value (a write racing the read)

    def loader(self, path: str):
        def load():
            self.reads.append(path)
            if self.down:
                raise RegistryUnavailable("test: the registry is down")
            value = self.value
            if self.after_read is not None:
                self.after_read()
            return value

        return load


class Jobs(list):
    """An executor that keeps each submitted job (with its future) until the test runs it."""

    def submit(self, fn, *args):
        future = Future()
        self.append((future, lambda: fn(*args)))
        return future

    def run(self) -> int:
        ran = 0
        while self:
            future, job = self.pop(0)
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(job())
                except Exception as err:
                    future.set_exception(err)
                ran += 1
        return ran

    def shutdown(self, wait=True, cancel_futures=False):
        if cancel_futures:
            for future, _ in self:
                future.cancel()


def _cache(clock: Clock, jobs: Jobs, max_pending: int = 16, **kwargs) -> LookupCache:
    return LookupCache(TTL_S, refresher=Refresher(1, max_pending, executor=jobs, clock=clock), clock=clock, **kwargs)


def _read(cache: LookupCache, registry: Registry, key="k"):
    """A request's read: from memory, else a query on the request's path (counted as such)."""
    try:
        return cache.get(key, registry.loader("background"), offline=True)
    except CacheMiss:
        return cache.get(key, registry.loader("request"))


def test_a_row_used_in_its_second_half_is_answered_now_and_read_again_in_the_background():
    clock, jobs, registry = Clock(), Jobs(), Registry()
    cache = _cache(clock, jobs)
    assert _read(cache, registry) == "v1" and registry.reads == ["request"]  # the first read
    clock.now += TTL_S * 0.4
    assert _read(cache, registry) == "v1" and not jobs  # first half: nothing more
    clock.now += TTL_S * 0.2  # 0.6 of its life
    registry.value = "v2"
    assert _read(cache, registry) == "v1"  # answered from memory at once...
    assert len(jobs) == 1 and _read(cache, registry) == "v1" and len(jobs) == 1  # ...one re-read
    assert jobs.run() == 1 and registry.reads == ["request", "background"]
    assert _read(cache, registry) == "v2"
    # The new row lives TTL_S from when it was asked for: past the first row's end, no query.
    clock.now += TTL_S * 0.45  # 1.05 of the first row's life
    assert _read(cache, registry) == "v2" and registry.reads == ["request", "background"] and not jobs


def test_a_key_in_steady_use_never_waits_for_the_registry_and_an_edit_reaches_it_within_the_ttl():
    clock, jobs, registry = Clock(), Jobs(), Registry()
    cache = _cache(clock, jobs)
    start, edited_at, answers = clock.now, None, []
    for step in range(300):  # a read every 0.3 s for 90 s; re-reads run soon, as a thread would
        clock.now = start + step * 0.3
        if step == 100:
            registry.value, edited_at = "v2", clock.now
        answers.append((clock.now, _read(cache, registry)))
        jobs.run()
    assert registry.reads.count("request") == 1  # the first read only
    assert 300 * 0.3 / TTL_S <= registry.reads.count("background") <= 2 * 300 * 0.3 / TTL_S + 1
    stale = [at for at, value in answers if value == "v1" and at > edited_at]
    assert stale and max(stale) - edited_at <= TTL_S  # the bound an operator is promised


def test_a_re_read_that_finishes_late_is_stamped_when_it_was_asked_for():
    """The bound is counted from the query's start: a re-read asked for at 0.6 of the row's life
    and finished at 0.95 gives a row that ends TTL_S after 0.6, not after 0.95."""
    clock, jobs, registry = Clock(), Jobs(), Registry()
    cache = _cache(clock, jobs)
    _read(cache, registry)
    asked_at = clock.now = clock.now + TTL_S * 0.6
    _read(cache, registry)
    clock.now = asked_at + TTL_S * 0.35
    jobs.run()
    clock.now = asked_at + TTL_S + 0.001
    _read(cache, registry)
    assert registry.reads == ["request", "background", "request"]


def test_reads_too_sparse_for_the_second_half_cost_what_they_did():
    clock, jobs, registry = Clock(), Jobs(), Registry()
    cache = _cache(clock, jobs)
    for _ in range(5):  # every 1.2 TTLs: each row has expired by the next read
        _read(cache, registry)
        clock.now += TTL_S * 1.2
    assert registry.reads == ["request"] * 5 and not jobs


def test_a_failed_re_read_is_not_retried_the_row_expires_and_the_request_meets_the_outage(caplog):
    clock, jobs, registry = Clock(), Jobs(), Registry()
    cache = _cache(clock, jobs)
    _read(cache, registry)
    registry.down = True
    with caplog.at_level(logging.WARNING, logger="ray.serve.serve_app.auth.refresh"):
        for _ in range(6):  # used through its life, three times in its second half...
            clock.now += TTL_S * 0.15
            assert _read(cache, registry) == "v1"
            jobs.run()
        assert registry.reads == ["request", "background"]  # ...one re-read, failed, not retried
        clock.now += TTL_S * 0.11  # past the row's end
        with pytest.raises(RegistryUnavailable):
            _read(cache, registry)
        registry.down = False
        assert _read(cache, registry) == "v1"  # the failure was not cached
        # Another failure within the minute is not logged again; one a minute later is.
        registry.down = True
        clock.now += TTL_S * 0.6
        _read(cache, registry)
        jobs.run()
        clock.now += FAILURE_LOG_INTERVAL_S
        registry.down = False
        _read(cache, registry)  # expired: read on the request's path
        registry.down = True
        clock.now += TTL_S * 0.6
        _read(cache, registry)
        jobs.run()
    assert [r.message for r in caplog.records].count(FAILED) == 2


def test_no_request_waits_for_a_re_read_still_queued_when_its_row_expires():
    clock, jobs, registry = Clock(), Jobs(), Registry()
    cache = _cache(clock, jobs)
    _read(cache, registry)
    clock.now += TTL_S * 0.9
    _read(cache, registry)  # a re-read is queued and does not start (a slow registry)
    clock.now += TTL_S * 0.2  # the row has expired
    registry.value = "v2"
    assert _read(cache, registry) == "v2"  # read at once, on the request's own path
    assert registry.reads == ["request", "request"] and len(jobs) == 1
    kept = cache._rows["k"]
    registry.value = "v3"
    jobs.run()  # the late re-read finds its row replaced: no query, and the newer row stays
    assert cache._rows["k"] == kept and _read(cache, registry) == "v2"
    assert registry.reads == ["request", "request"]


def test_a_re_read_whose_row_expired_while_it_waited_does_not_query():
    clock, jobs, registry = Clock(), Jobs(), Registry()
    cache = _cache(clock, jobs)
    _read(cache, registry)
    clock.now += TTL_S * 0.9
    _read(cache, registry)
    clock.now += TTL_S * 0.2  # no request since: the row has expired unread
    jobs.run()
    assert registry.reads == ["request"] and cache.refresher.pending == 0


def test_a_write_to_one_key_does_not_discard_another_keys_re_read():
    clock, jobs, registry = Clock(), Jobs(), Registry()
    cache = _cache(clock, jobs)
    for key in ("a", "b"):
        _read(cache, registry, key)
    clock.now += TTL_S * 0.6
    _read(cache, registry, "a")
    cache.forget("b")  # a revocation of another key, while "a"'s re-read waits
    jobs.run()
    clock.now += TTL_S * 0.5  # past "a"'s first row's end: its re-read's row answers
    assert _read(cache, registry, "a") == "v1"
    assert registry.reads == ["request", "request", "background"]


def test_a_write_during_a_re_read_is_not_overwritten_by_it():
    """``forget`` follows this process's own write (a revocation): a re-read that began before it
    may have read the old row and must not put it back for another TTL."""
    clock, jobs, registry = Clock(), Jobs(), Registry("active")
    cache = _cache(clock, jobs)
    _read(cache, registry)
    clock.now += TTL_S * 0.6
    _read(cache, registry)  # the re-read is queued...

    def revoke():  # ...and the revocation lands after its query has read "active"
        registry.value = "revoked"
        cache.forget("k")

    registry.after_read = revoke
    jobs.run()
    registry.after_read = None
    assert _read(cache, registry) == "revoked"
    assert registry.reads == ["request", "background", "request"]


def test_after_a_write_no_lookup_waits_for_a_query_that_began_before_it():
    cache, registry = LookupCache(TTL_S), Registry("active")
    release, old_answer = threading.Event(), []

    def slow_load():
        value = registry.value
        release.wait(30)
        return value

    first = threading.Thread(target=lambda: old_answer.append(cache.get("k", slow_load)))
    first.start()
    while "k" not in cache._flights:
        threading.Event().wait(0.001)
    registry.value = "revoked"
    cache.forget("k")  # this process's write, while the old query is under way
    assert cache.get("k", registry.loader("request")) == "revoked"  # its own query, not the old one
    release.set()
    first.join(30)
    assert old_answer == ["active"]  # asked before the write: may see the old row...
    assert cache.get("k", registry.loader("request")) == "revoked"  # ...which is not stored


def test_misses_are_never_read_ahead():
    clock, jobs = Clock(), Jobs()
    cache = _cache(clock, jobs)
    registry = Registry(None)  # an id the registry does not hold
    _read(cache, registry)
    clock.now += TTL_S * 0.9
    assert _read(cache, registry) is None and not jobs


def test_the_bound_on_waiting_re_reads_is_the_stores_whatever_its_caches():
    clock, jobs, registry = Clock(), Jobs(), Registry()
    refresher = Refresher(1, 3, executor=jobs, clock=clock)
    keys, revoked = (LookupCache(TTL_S, refresher=refresher, clock=clock) for _ in range(2))
    for cache in (keys, revoked):
        for i in range(4):
            _read(cache, registry, f"k{i}")
    clock.now += TTL_S * 0.6
    for cache in (keys, revoked):
        for i in range(4):
            _read(cache, registry, f"k{i}")
    assert len(jobs) == 3 and refresher.pending == 3
    jobs.run()
    assert refresher.pending == 0
    _read(revoked, registry, "k3")  # room again: a row not re-read yet is
    assert len(jobs) == 1


def test_a_re_read_the_executor_refuses_leaves_the_row_to_expire_and_frees_its_place():
    class Closed:
        def submit(self, fn, *args):
            raise RuntimeError("cannot schedule new futures after shutdown")

    class QueuedThenFailed(Jobs):  # CPython's submit can queue the job, then fail to start a thread
        def submit(self, fn, *args):
            super().submit(fn, *args)
            raise RuntimeError("can't start new thread")

    for executor in (Closed(), QueuedThenFailed()):
        clock, registry = Clock(), Registry()
        refresher = Refresher(1, 16, executor=executor, clock=clock)
        cache = LookupCache(TTL_S, refresher=refresher, clock=clock)
        _read(cache, registry)
        clock.now += TTL_S * 0.6
        assert _read(cache, registry) == "v1" and refresher.pending == 0
        if isinstance(executor, Jobs):
            executor.run()  # queued before the failure, it runs once; its place was freed once
            assert refresher.pending == 0 and registry.reads == ["request", "background"]
        else:  # never ran: the row is left to expire, and is read on the request's path
            clock.now += TTL_S * 0.5
            assert _read(cache, registry) == "v1" and registry.reads == ["request", "request"]


def test_a_wrong_secret_for_a_real_key_does_not_read_its_row_again(tmp_path):
    """Key ids are public: a raw key with a real id and a wrong secret must not make the router
    query the registry (nor take the store's places for re-reads)."""
    clock, jobs = Clock(), Jobs()
    auth, database = _router(tmp_path, clock)
    auth.keys._keys.refresher = Refresher(1, 16, executor=jobs, clock=clock)
    key, record = auth.keys.create_key(owner="alice", tier="standard")
    wrong = key[:-1] + ("A" if key[-1] != "A" else "B")
    assert auth.keys.lookup(key) == record
    clock.now += TTL_S * 0.6
    assert auth.keys.lookup(wrong, offline=True) is None and not jobs
    assert auth.keys.lookup(key, offline=True) == record and len(jobs) == 1


def test_a_closed_store_drops_its_queued_re_reads_and_asks_for_no_more(tmp_path):
    clock, jobs = Clock(), Jobs()
    auth, database = _router(tmp_path, clock)
    store = auth.keys
    assert store._keys.refresher is store._revoked.refresher is store._refresher  # one bound per store
    store._refresher._executor = jobs
    key, _ = store.create_key(owner="alice", tier="standard")
    other, _ = store.create_key(owner="bob", tier="standard")
    store.lookup(key)
    store.lookup(other)
    clock.now += TTL_S * 0.6
    store.lookup(key, offline=True)  # queued
    assert len(jobs) == 1 and store._refresher.pending == 1
    before = database.queries
    store.close()  # the router stopping
    assert store._refresher.pending == 0 and jobs.run() == 0  # cancelled, its place given back
    assert store.lookup(other, offline=True) is not None  # lookups still answer; none read ahead
    assert not jobs and database.queries == before


def test_the_routers_store_keeps_a_busy_key_and_its_tokens_off_the_request_path(tmp_path):
    """The real store and authenticator, re-reads on the store's own threads: a key sending every
    0.5 s for a minute, by its raw key and by a token, is always answered in the event loop's pass
    (``CacheMiss`` would fail the test), and its revocation in another region's router is refused
    within the TTL, both ways."""
    clock = Clock()
    auth, database = _router(tmp_path, clock)
    key, record = auth.keys.create_key(owner="alice", tier="standard")
    token = sign(current_key(auth), claims(auth, sub=record.key_id, scope="inference"))
    other_region = auth.keys.__class__(auth.args.key_store())  # a peer's router, same registry

    async def steady():
        for credential in (key, token):  # the first lookups (the key's row, the token's jti)
            await auth.authenticate_async(f"Bearer {credential}", scope=SCOPE_INFERENCE)
        refused_at, revoked_at = {}, None
        for step in range(1, 120):
            clock.now += 0.5
            if step == 60:
                other_region.revoke_key(record.key_id)
                revoked_at = clock.now
            for name, credential in (("key", key), ("token", token)):
                try:
                    auth.authenticate(f"Bearer {credential}", scope=SCOPE_INFERENCE, offline=True)
                except APIError as err:
                    assert err.code == "api_key_revoked"
                    refused_at.setdefault(name, clock.now)
            await asyncio.to_thread(_settle, auth.keys._refresher)
        return revoked_at, refused_at

    revoked_at, refused_at = asyncio.run(steady())
    assert set(refused_at) == {"key", "token"}
    assert all(revoked_at <= at <= revoked_at + TTL_S for at in refused_at.values())
    auth.keys.close()


def _settle(refresher: Refresher) -> None:
    """Wait (a thread's wait, bounded) until the store's re-reads have finished."""
    for _ in range(30_000):
        if refresher.pending == 0:
            return
        threading.Event().wait(0.001)
    raise AssertionError(f"{refresher.pending} re-reads still pending after 30 s")


def test_a_final_row_is_kept_and_never_read_again():
    clock, jobs, registry = Clock(), Jobs(), Registry("active")
    cache = _cache(clock, jobs, is_final=lambda value: value == "revoked")
    assert _read(cache, registry) == "active"
    registry.value = "revoked"
    clock.now += TTL_S * 1.01
    assert _read(cache, registry) == "revoked" and registry.reads == ["request", "request"]
    for _ in range(20):  # twenty TTLs of steady use: no expiry, no re-read
        clock.now += TTL_S * 0.6
        assert _read(cache, registry) == "revoked"
    assert not jobs and registry.reads == ["request", "request"]
    cache.forget("k")  # this process's own write still drops it
    assert _read(cache, registry) == "revoked" and registry.reads == ["request", "request", "request"]


def test_a_revoked_key_or_token_costs_the_registry_nothing_once_refused(tmp_path):
    """A client that goes on sending a credential revoked in another region's router: refused
    within the TTL, then from memory for good (revocation cannot be undone), not read twice
    every TTL as a live key is."""
    clock = Clock()
    auth, database = _router(tmp_path, clock)
    key, record = auth.keys.create_key(owner="alice", tier="standard")
    _, token_key = auth.keys.create_key(owner="bob", tier="standard")
    token_claims = claims(auth, sub=token_key.key_id, scope="inference")
    token = sign(current_key(auth), token_claims)
    peer = auth.keys.__class__(auth.args.key_store())  # a peer's router, same registry

    async def hammer():
        codes: dict[str, set] = {"key": set(), "token": set()}
        for credential in (key, token):
            await auth.authenticate_async(f"Bearer {credential}", scope=SCOPE_INFERENCE)
        peer.revoke_key(record.key_id)
        peer.revoke_jti(token_claims["jti"], purge_after=int(token_claims["exp"]))
        queries_at = {}
        for step in range(1, 121):  # a minute, every 0.5 s: twelve TTLs
            clock.now += 0.5
            for name, credential in (("key", key), ("token", token)):
                try:
                    await auth.authenticate_async(f"Bearer {credential}", scope=SCOPE_INFERENCE)
                except APIError as err:
                    codes[name].add(err.code)
            await asyncio.to_thread(_settle, auth.keys._refresher)
            queries_at[step] = database.queries
        return codes, queries_at

    try:
        codes, queries_at = asyncio.run(hammer())
    finally:
        auth.keys.close()
        peer.close()
    assert codes == {"key": {"api_key_revoked"}, "token": {"token_revoked"}}
    refused_by = int(TTL_S / 0.5)  # both refused within the TTL, each after one query
    assert queries_at[refused_by] > queries_at[1] and queries_at[120] == queries_at[refused_by]

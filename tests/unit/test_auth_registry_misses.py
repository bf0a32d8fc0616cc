"""Lookups of key ids the registry does not hold (issue #22, item 7): a well-formed ``pgk_`` key
costs nothing to invent, so each made-up id must not cost the shared registry a query per request,
push real keys out of the cache, or hold up lookups of real keys. Counted with a wrapped database
and a clock the test moves (no sleeps, no timing thresholds)."""

import asyncio
import secrets
import threading
from types import SimpleNamespace

import pytest

from serve_app.auth import keys as keys_module
from serve_app.auth.cache import CacheMiss, LookupCache, MissBudget, RegistryBusy, _Flight
from serve_app.auth.database import RegistryUnavailable
from serve_app.auth.keys import SCOPE_INFERENCE, KeyStore
from serve_app.errors import APIError
from tests.unit.auth_support import authenticator, claims, current_key, sign

TTL_S = 5
RATE = 20  # unknown-id lookups a second (and at once) in these tests


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class CountingDatabase:
    """The registry's database, counting every operation (one per query) and able to go down."""

    def __init__(self, database):
        self.inner, self.queries, self.down = database, 0, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def connect(self, read: bool = False):
        self.queries += 1
        if self.down:
            raise RegistryUnavailable("test: the registry is down")
        return self.inner.connect(read)


def _router(tmp_path, clock: Clock, rate: float = RATE):
    """An authenticator as a router builds it, its store on the test's clock and counted."""
    auth = authenticator(tmp_path, cache_ttl_s=TTL_S, registry_miss_lookups_per_s=rate)
    auth.keys = KeyStore(auth.args.key_store(), cache_ttl_s=TTL_S, miss_lookups_per_s=rate, clock=clock)
    database = auth.keys.database = CountingDatabase(auth.keys.database)
    return auth, database


def _random_key() -> str:
    return f"pgk_{secrets.token_hex(6)}_{secrets.token_urlsafe(40)[:43].replace('-', 'a').replace('_', 'b')}"


def _outcome(auth, credential: str) -> tuple[int, str | None, dict]:
    async def attempt():
        try:
            principal = await auth.authenticate_async(f"Bearer {credential}", scope=SCOPE_INFERENCE)
        except APIError as err:
            return err.status, err.code, err.headers
        return 200, principal.key_id, {}

    return asyncio.run(attempt())


def _flood(auth, n: int) -> list[tuple[int, str | None, dict]]:
    async def all_of_them():
        answers = []
        for _ in range(n):
            try:
                await auth.authenticate_async(f"Bearer {_random_key()}", scope=SCOPE_INFERENCE)
            except APIError as err:
                answers.append((err.status, err.code, err.headers))
        return answers

    return asyncio.run(all_of_them())


def test_a_flood_of_random_key_ids_costs_the_registry_a_bounded_number_of_queries(tmp_path):
    clock = Clock()
    auth, database = _router(tmp_path, clock)
    before = database.queries
    answers = _flood(auth, 2000)
    assert database.queries - before == RATE  # not 2000: one per id up to the budget, then none
    assert len(answers) == 2000
    statuses = [(status, code) for status, code, _ in answers]
    assert statuses.count((401, "invalid_api_key")) == RATE  # looked up: unknown
    assert statuses.count((503, "key_registry_busy")) == 2000 - RATE  # not looked up at all
    assert all(headers.get("Retry-After") == "1" for status, _, headers in answers if status == 503)
    # The budget refills at its rate: a second later, RATE more lookups, and no more.
    clock.now += 1
    before = database.queries
    _flood(auth, 500)
    assert database.queries - before == RATE


def test_a_refused_lookup_is_answered_in_the_event_loop_without_a_worker_thread(tmp_path):
    auth, _ = _router(tmp_path, Clock(), rate=1)
    _flood(auth, 1)  # spends the budget
    # The offline pass (the event loop's) refuses it outright, where a CacheMiss would have sent
    # the request to a worker thread to queue behind the database.
    with pytest.raises(APIError) as refused:
        auth.authenticate(f"Bearer {_random_key()}", scope=SCOPE_INFERENCE, offline=True)
    assert refused.value.status == 503 and refused.value.code == "key_registry_busy"


def test_during_a_flood_real_keys_keep_answering_and_known_ones_are_refreshed(tmp_path):
    clock = Clock()
    auth, database = _router(tmp_path, clock)
    cached, cached_record = auth.keys.create_key(owner="alice", tier="standard")
    assert _outcome(auth, cached)[0] == 200  # this router now holds its row
    _flood(auth, 1000)  # the budget is spent
    before = database.queries
    assert _outcome(auth, cached) == (200, cached_record.key_id, {})  # from memory
    assert database.queries == before
    # Its row goes stale: refreshing a key the router knows is never held back by the flood.
    clock.now += TTL_S + 1
    _flood(auth, 100)
    assert _outcome(auth, cached)[0] == 200
    assert database.queries == before + RATE + 1
    # A token is verified by its signature before any lookup, so tokens are not budgeted either.
    never_seen = auth.keys.create_key(owner="bob", tier="standard")[1]
    token = sign(current_key(auth), claims(auth, sub=never_seen.key_id, scope="inference"))
    assert _outcome(auth, token)[:2] == (200, never_seen.key_id)


def test_during_a_flood_a_real_key_this_router_never_saw_is_looked_up_once_listed(tmp_path):
    """Right after a restart a router holds no row at all: every real key's first lookup would
    share the budget with the flood. The registry's key ids, listed at start and then every
    KNOWN_IDS_REFRESH_S, are never budgeted; only a key created since the last listing is."""
    clock = Clock()
    auth, database = _router(tmp_path, clock)
    listed, listed_record = auth.keys.create_key(owner="alice", tier="standard")
    assert auth.keys.refresh_known_ids() == 1
    _flood(auth, 1000)  # the budget is spent
    assert _outcome(auth, listed) == (200, listed_record.key_id, {})  # looked up all the same
    newer, newer_record = auth.keys.create_key(owner="bob", tier="standard")
    assert _outcome(auth, newer)[:2] == (503, "key_registry_busy")  # not listed yet: it waits its turn
    assert auth.keys.refresh_known_ids() == 2  # the next listing (only what is new since the last)
    assert _outcome(auth, newer) == (200, newer_record.key_id, {})
    # A made-up id is still refused without a query.
    before = database.queries
    assert _flood(auth, 10)[0][:2] == (503, "key_registry_busy") and database.queries == before


def test_the_router_lists_key_ids_in_the_background_and_stops_with_it(tmp_path):
    auth, _ = _router(tmp_path, Clock())
    auth.keys.create_key(owner="alice", tier="standard")

    async def scenario():
        auth.start()
        for _ in range(200):  # its first listing runs at once, on a thread
            if auth.keys._known_ids:
                break
            await asyncio.sleep(0.01)
        await auth.aclose()
        return len(auth.keys._known_ids), auth._following

    assert asyncio.run(scenario()) == (1, [])


def test_unknown_ids_are_queried_on_threads_of_their_own_never_in_front_of_real_keys(tmp_path):
    clock = Clock()
    auth, database = _router(tmp_path, clock)
    real, _ = auth.keys.create_key(owner="alice", tier="standard")
    assert _outcome(auth, real)[0] == 200
    clock.now += TTL_S + 1  # its row is stale: the next use queries
    gate, blocked, threads = threading.Event(), [], []
    connect = database.connect

    def gated(read: bool = False):
        threads.append(threading.current_thread().name)
        if threading.current_thread().name.startswith("unknown-key-id"):
            blocked.append(1)
            gate.wait(30)
        return connect(read)

    database.connect = gated

    async def scenario():
        made_up = [f"Bearer {_random_key()}" for _ in range(10)]
        flood = [asyncio.create_task(auth.authenticate_async(bearer, scope=SCOPE_INFERENCE)) for bearer in made_up]
        try:
            while len(blocked) < 2:  # both of the unknown ids' threads are stuck in the database
                await asyncio.sleep(0.01)
            refreshed = await auth.authenticate_async(f"Bearer {real}", scope=SCOPE_INFERENCE)
            assert len(blocked) == 2  # no third thread joined them: at most 2 such queries at once
        finally:
            gate.set()
        answers = await asyncio.gather(*flood, return_exceptions=True)
        return refreshed, answers

    refreshed, answers = asyncio.run(scenario())
    assert refreshed.owner == "alice"  # answered while the flood's queries were stuck
    assert all(isinstance(a, APIError) and a.code == "invalid_api_key" for a in answers)
    unknown = [name for name in threads if name.startswith("unknown-key-id")]
    assert len(unknown) == 10 and len(threads) == 11


def test_many_requests_for_one_unknown_id_wait_on_its_threads_for_one_query(tmp_path, monkeypatch):
    auth, database = _router(tmp_path, Clock())
    made_up = _random_key()
    key_id = made_up.split("_")[1]
    gate, waiting_on = threading.Event(), []
    connect, result = database.connect, _Flight.result

    def gated(read: bool = False):
        gate.wait(30)
        return connect(read)

    def recorded(flight):
        waiting_on.append(threading.current_thread().name)
        return result(flight)

    database.connect = gated
    monkeypatch.setattr(_Flight, "result", recorded)
    before = database.queries

    async def scenario():
        once = lambda: auth.authenticate_async(f"Bearer {made_up}", scope=SCOPE_INFERENCE)  # noqa: E731
        flood = [asyncio.create_task(once()) for _ in range(10)]
        try:
            while auth.keys._keys.waiting(key_id) < 1:  # the leader is in the database, one waits
                await asyncio.sleep(0.01)
        finally:
            gate.set()
        return await asyncio.gather(*flood, return_exceptions=True)

    answers = asyncio.run(scenario())
    assert all(isinstance(a, APIError) and a.code == "invalid_api_key" for a in answers)
    assert database.queries == before + 1
    # Those waiting for the answer waited on the unknown ids' threads, not the shared ones.
    assert waiting_on and all(name.startswith("unknown-key-id") for name in waiting_on)


def test_misses_never_evict_real_keys_and_nothing_is_flushed(tmp_path, monkeypatch):
    monkeypatch.setattr(LookupCache, "MAX_MISSES", 50)
    monkeypatch.setattr(LookupCache, "MAX_ROWS", 3)
    auth, database = _router(tmp_path, Clock(), rate=10_000)
    real = [auth.keys.create_key(owner="alice", tier="standard")[0] for _ in range(3)]
    for key in real:
        assert _outcome(auth, key)[0] == 200
    assert all(status == 401 for status, _, _ in _flood(auth, 500))  # all looked up: 500 misses
    database.down = True  # anything not in memory would now fail
    assert [_outcome(auth, key)[0] for key in real] == [200, 200, 200]
    # The fourth real key pushes out the least recently used one, not the others.
    database.down = False
    fourth = auth.keys.create_key(owner="alice", tier="standard")[0]
    for key in (real[1], real[2], real[0], fourth):  # real[1] is now the least recently used
        assert _outcome(auth, key)[0] == 200
    database.down = True
    assert [_outcome(auth, key)[0] for key in (real[2], real[0], fourth)] == [200, 200, 200]
    assert _outcome(auth, real[1])[:2] == (503, "key_registry_unavailable")


def test_a_revocation_forgets_that_key_only(tmp_path):
    auth, database = _router(tmp_path, Clock())
    kept, _ = auth.keys.create_key(owner="alice", tier="standard")
    revoked, revoked_record = auth.keys.create_key(owner="alice", tier="standard")
    assert _outcome(auth, kept)[0] == _outcome(auth, revoked)[0] == 200
    auth.keys.revoke_key(revoked_record.key_id)
    before = database.queries
    assert _outcome(auth, kept)[0] == 200
    assert database.queries == before  # still cached: the revoke did not flush the cache
    assert _outcome(auth, revoked)[:2] == (401, "api_key_revoked")  # seen at once here


def test_an_unknown_id_is_one_query_per_ttl_however_often_it_is_sent(tmp_path):
    clock = Clock()
    auth, database = _router(tmp_path, clock)
    made_up = _random_key()
    before = database.queries
    assert {_outcome(auth, made_up)[:2] for _ in range(100)} == {(401, "invalid_api_key")}
    assert database.queries == before + 1
    clock.now += TTL_S
    assert _outcome(auth, made_up)[0] == 401
    assert database.queries == before + 2


def test_a_key_created_after_its_id_was_looked_up_works_within_the_ttl(tmp_path, monkeypatch):
    clock = Clock()
    auth, _ = _router(tmp_path, clock)
    key_id = "00ab00cd00ef"
    monkeypatch.setattr(keys_module, "secrets", SimpleNamespace(token_hex=lambda n: key_id, choice=secrets.choice))
    assert _outcome(auth, f"pgk_{key_id}_{'A' * 43}")[:2] == (401, "invalid_api_key")  # a miss, cached
    cli = KeyStore(auth.args.key_store(), cache_ttl_s=0)  # `serve-app keys create`, elsewhere
    key, _ = cli.create_key(owner="alice", tier="standard")
    assert key.startswith(f"pgk_{key_id}_")
    assert _outcome(auth, key)[0] == 401  # the cached miss, for at most cache_ttl_s
    clock.now += TTL_S
    assert _outcome(auth, key) == (200, key_id, {})


def test_a_key_created_by_the_store_that_cached_its_miss_works_at_once(tmp_path, monkeypatch):
    auth, _ = _router(tmp_path, Clock())
    key_id = "00ab00cd00ef"
    monkeypatch.setattr(keys_module, "secrets", SimpleNamespace(token_hex=lambda n: key_id, choice=secrets.choice))
    assert _outcome(auth, f"pgk_{key_id}_{'A' * 43}")[0] == 401
    key, _ = auth.keys.create_key(owner="alice", tier="standard")
    assert _outcome(auth, key)[0] == 200


def test_concurrent_lookups_of_one_id_share_one_query():
    cache = LookupCache(TTL_S)
    release, queries, answers = threading.Event(), [], []

    def load():
        queries.append(1)
        release.wait(30)
        return "row"

    threads = [threading.Thread(target=lambda: answers.append(cache.get("k", load))) for _ in range(8)]
    for thread in threads:
        thread.start()
    while cache.waiting("k") < 7:  # one is querying, seven wait for its answer
        threading.Event().wait(0.01)
    release.set()
    for thread in threads:
        thread.join(30)
    assert queries == [1] and answers == ["row"] * 8


def test_a_failed_query_is_every_waiters_failure_and_is_not_cached():
    cache = LookupCache(TTL_S)
    release, attempts = threading.Event(), []

    def failing():
        attempts.append(1)
        release.wait(30)
        raise RegistryUnavailable("down")

    errors = []

    def lookup():
        try:
            cache.get("k", failing)
        except RegistryUnavailable as err:
            errors.append(err)

    threads = [threading.Thread(target=lookup) for _ in range(3)]
    for thread in threads:
        thread.start()
    while cache.waiting("k") < 2:
        threading.Event().wait(0.01)
    release.set()
    for thread in threads:
        thread.join(30)
    assert len(errors) == 3 and attempts == [1]
    assert cache.get("k", lambda: "row") == "row"  # the failure was not remembered


def test_one_budgeted_lookup_is_paid_once_across_the_offline_and_the_online_pass():
    clock = Clock()
    cache = LookupCache(TTL_S, budget=MissBudget(2, clock), clock=clock)
    for key in ("a", "b"):
        with pytest.raises(CacheMiss):
            cache.get(key, lambda: None, offline=True, budgeted=True)  # pays
        assert cache.get(key, lambda: None, budgeted=True) is None  # already paid: no second token
    with pytest.raises(RegistryBusy):
        cache.get("c", lambda: None, offline=True, budgeted=True)
    assert cache.get("a", lambda: None, offline=True, budgeted=True) is None  # a cached miss is free

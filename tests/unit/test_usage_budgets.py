"""Per-key token budgets: the reset math, the guard's 429s and headers on real databases, this
router's unwritten spend, the cache, and what happens when the store is away."""

import asyncio
import datetime as dt
import json
import logging
import os
import threading
import time
from collections import Counter

import pytest

from serve_app.auth.database import open_database
from serve_app.errors import APIError
from serve_app.usage import budgets
from serve_app.usage.budgets import BudgetGuard
from serve_app.usage.ledger import UsageLedger
from serve_app.usage.store import UsageStore
from test_usage_store import open_test_database, unreachable, usage_record


def at(iso: str) -> float:
    return dt.datetime.fromisoformat(iso).replace(tzinfo=dt.timezone.utc).timestamp()


class Clock:
    def __init__(self, iso: str):
        self.now = at(iso)

    def __call__(self) -> float:
        return self.now


class CountingStore(UsageStore):
    """The real store, counting the budget reads the guard makes."""

    reads = 0
    primary_reads = 0

    def budget_state(self, key_id, *, day, month_start, primary=False):
        self.reads += 1
        self.primary_reads += primary
        return super().budget_state(key_id, day=day, month_start=month_start, primary=primary)


@pytest.fixture(params=["sqlite", "postgres"])
def store(request, tmp_path) -> CountingStore:
    return CountingStore(open_test_database(request, tmp_path))


@pytest.fixture
def sqlite_store(tmp_path) -> CountingStore:
    return CountingStore(open_database(tmp_path / "registry.sqlite3", create=True))


def _check(guard, key_id="k1"):
    return asyncio.run(guard.check(key_id))


def _refusal(guard, key_id="k1") -> APIError:
    with pytest.raises(APIError) as refused:
        _check(guard, key_id)
    return refused.value


# --- reset math ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "now, day_reset, month_reset",
    [
        ("2026-12-01T13:00:00", "2026-12-02T00:00:00", "2027-01-01T00:00:00"),  # December → January
        ("2026-12-31T23:59:59.5", "2027-01-01T00:00:00", "2027-01-01T00:00:00"),
        ("2026-02-28T00:00:00", "2026-03-01T00:00:00", "2026-03-01T00:00:00"),  # midnight itself: the next one
        ("2028-02-28T12:00:00", "2028-02-29T00:00:00", "2028-03-01T00:00:00"),  # a leap year
        ("2026-01-31T08:00:00", "2026-02-01T00:00:00", "2026-02-01T00:00:00"),
    ],
)
def test_budgets_reset_at_the_next_utc_midnight_and_the_first_of_the_next_month(now, day_reset, month_reset):
    assert budgets.next_day_start(at(now)) == at(day_reset)
    assert budgets.next_month_start(at(now)) == at(month_reset)
    assert budgets.month_start(at(now)) == now[:8] + "01"


def test_reset_times_are_written_in_iso_8601_utc():
    assert budgets.iso_utc(at("2026-12-02T00:00:00")) == "2026-12-02T00:00:00Z"


# --- the guard ---------------------------------------------------------------------------------------
def test_a_daily_budget_admits_below_its_limit_and_refuses_at_it(store):
    store.set_budget("k1", tokens_per_day=1000, tokens_per_month=None)
    store.insert([usage_record(day="2026-12-01", prompt=800, completion=100, cached=500)])  # 900: cached is not extra
    store.insert([usage_record(day="2026-11-30", prompt=5000, completion=0)])  # yesterday does not count
    clock = Clock("2026-12-01T13:00:00")
    guard = BudgetGuard(store, None, cache_ttl_s=5, clock=clock)
    assert _check(guard) == {
        "x-budget-limit-tokens-day": "1000",
        "x-budget-remaining-tokens-day": "100",
        "x-budget-reset-tokens-day": "39600.000s",  # 11 h to midnight
    }
    store.insert([usage_record(day="2026-12-01", prompt=100, completion=0)])
    guard.written({"k1": 100})  # what the ledger says once it wrote a batch: counted at once
    clock.now += 0.5
    refused = _refusal(guard)
    assert refused.status == 429 and refused.code == "budget_exceeded"
    assert "daily" in refused.message and "1000 tokens" in refused.message and "2026-12-02T00:00:00Z" in refused.message
    assert refused.headers["Retry-After"] == "39600" and refused.headers["x-budget-remaining-tokens-day"] == "0"
    assert _check(guard, "k2") == {}  # another key, without a budget


def test_a_monthly_budget_counts_the_whole_utc_month_and_names_the_later_reset(store):
    store.set_budget("k1", tokens_per_day=10_000, tokens_per_month=5000)
    store.insert([usage_record(day="2026-12-01", prompt=3000, completion=0), usage_record(day="2026-12-20", prompt=1999, completion=0)])
    store.insert([usage_record(day="2026-11-30", prompt=9000, completion=0)])  # last month
    clock = Clock("2026-12-31T23:00:00")
    guard = BudgetGuard(store, None, clock=clock)
    headers = _check(guard)
    assert headers["x-budget-remaining-tokens-month"] == "1" and headers["x-budget-remaining-tokens-day"] == "10000"
    assert headers["x-budget-reset-tokens-month"] == "3600.000s"  # December → 1 January

    store.insert([usage_record(day="2026-12-31", prompt=1, completion=0)])
    guard.written({"k1": 1})
    refused = _refusal(guard)
    assert "monthly" in refused.message and "5000 tokens per UTC month" in refused.message
    assert "2027-01-01T00:00:00Z" in refused.message and refused.headers["Retry-After"] == "3600"

    store.set_budget("k1", tokens_per_day=1, tokens_per_month=5000)  # both spent: the month is the one to wait for
    # On the 20th the month's spend is what was used up to that day (the 31st's token comes later).
    store.insert([usage_record(day="2026-12-19", prompt=1, completion=0)])
    clock.now = at("2026-12-20T10:00:00")  # 1999 spent today: the day's 1 is spent too
    refused = _refusal(BudgetGuard(store, None, clock=clock))
    assert "monthly" in refused.message and refused.headers["Retry-After"] == str(11 * 86400 + 14 * 3600)
    assert refused.headers["x-budget-reset-tokens-day"] == f"{14 * 3600}.000s"


def test_headers_name_only_the_budgets_that_are_set(sqlite_store):
    sqlite_store.set_budget("k1", tokens_per_day=None, tokens_per_month=100)
    headers = _check(BudgetGuard(sqlite_store, None, clock=Clock("2026-12-01T00:00:00")))
    assert sorted(headers) == ["x-budget-limit-tokens-month", "x-budget-remaining-tokens-month", "x-budget-reset-tokens-month"]


def test_this_routers_unwritten_spend_counts_at_once_and_only_once(sqlite_store, tmp_path):
    sqlite_store.set_budget("k1", tokens_per_day=1500, tokens_per_month=None)
    ledger = UsageLedger(sqlite_store, tmp_path / "spool", writer_id="a")
    clock = Clock("2026-12-01T12:00:00")
    guard = BudgetGuard(sqlite_store, ledger, cache_ttl_s=5, clock=clock)
    ledger.on_written = guard.written

    async def main():
        assert (await guard.check("k1"))["x-budget-remaining-tokens-day"] == "1500"
        ledger.record(usage_record(day="2026-12-01", prompt=900, completion=100))  # not written yet
        assert (await guard.check("k1"))["x-budget-remaining-tokens-day"] == "500"
        await ledger.flush()  # now in the database, and no longer pending: still 1000 spent, not 2000
        assert (await guard.check("k1"))["x-budget-remaining-tokens-day"] == "500"
        assert sqlite_store.reads == 1  # the write counts through this router's total: no read for it
        clock.now += 3  # the entry's second half: this check starts a read in the background...
        assert (await guard.check("k1"))["x-budget-remaining-tokens-day"] == "500"
        await guard.settle()
        assert (sqlite_store.reads, sqlite_store.primary_reads) == (2, 1)  # ...from the primary: a replica may lag
        assert (await guard.check("k1"))["x-budget-remaining-tokens-day"] == "500"  # it saw the write: once
        ledger.record(usage_record(day="2026-12-01", prompt=500, completion=0))
        with pytest.raises(APIError):
            await guard.check("k1")
        clock.now += 31  # nothing written for PRIMARY_AFTER_WRITE_S: the replica is good enough again
        with pytest.raises(APIError):
            await guard.check("k1")

    asyncio.run(main())
    assert (sqlite_store.reads, sqlite_store.primary_reads) == (3, 1)


def test_a_key_without_a_budget_costs_no_reload_when_its_records_are_written(sqlite_store, tmp_path):
    ledger = UsageLedger(sqlite_store, tmp_path / "spool", writer_id="a")
    guard = BudgetGuard(sqlite_store, ledger, clock=Clock("2026-12-01T12:00:00"))
    ledger.on_written = guard.written

    async def main():
        for _ in range(3):
            assert await guard.check("k1") == {}
            ledger.record(usage_record(day="2026-12-01"))
            await ledger.flush()

    asyncio.run(main())
    assert sqlite_store.reads == 1 and sqlite_store.primary_reads == 0  # one read per cache TTL


def test_the_cache_serves_checks_for_its_ttl_and_coalesces_concurrent_loads(sqlite_store):
    clock = Clock("2026-12-01T12:00:00")
    guard = BudgetGuard(sqlite_store, None, cache_ttl_s=5, clock=clock)

    async def concurrent():
        return await asyncio.gather(*(guard.check("k1") for _ in range(10)))

    assert asyncio.run(concurrent()) == [{}] * 10 and sqlite_store.reads == 1  # no budget: one read for all
    sqlite_store.set_budget("k1", tokens_per_day=10, tokens_per_month=None)
    clock.now += 2
    assert _check(guard) == {} and sqlite_store.reads == 1  # the TTL's first half: the cached answer, no read
    clock.now += 3.5  # expired (an idle key): the check waits for a fresh read
    assert _check(guard)["x-budget-limit-tokens-day"] == "10" and sqlite_store.reads == 2


def test_a_busy_key_is_read_again_in_the_background_and_waits_for_no_slow_read_for_one_more_ttl(sqlite_store):
    sqlite_store.set_budget("k1", tokens_per_day=100, tokens_per_month=None)
    clock = Clock("2026-12-01T12:00:00")
    guard = BudgetGuard(sqlite_store, None, cache_ttl_s=5, clock=clock)
    release = threading.Event()
    read = sqlite_store.budget_state

    def held_read(key_id, **kwargs):  # answers only once the test lets it
        release.wait(5)
        return read(key_id, **kwargs)

    async def main():
        assert (await guard.check("k1"))["x-budget-limit-tokens-day"] == "100"  # the first read: waited for
        sqlite_store.set_budget("k1", tokens_per_day=50, tokens_per_month=None)
        sqlite_store.budget_state = held_read
        clock.now += 2.4  # still the entry's first half: no read
        assert (await guard.check("k1"))["x-budget-limit-tokens-day"] == "100" and not guard._loading
        clock.now += 0.6  # its second half
        checks = [await guard.check("k1") for _ in range(3)]  # decided at once, on the entry, the store held
        assert [c["x-budget-limit-tokens-day"] for c in checks] == ["100"] * 3
        assert len(guard._loading) == 1  # one read in the background for all of them
        clock.now += 3  # expired, the read still on its way (a database in trouble): still at once
        assert (await guard.check("k1"))["x-budget-limit-tokens-day"] == "100"
        clock.now += 4.5  # past one more TTL: this check waits for the read
        waiting = asyncio.create_task(guard.check("k1"))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        release.set()
        assert (await waiting)["x-budget-limit-tokens-day"] == "50"  # its answer, and used after it
        assert (await guard.check("k1"))["x-budget-limit-tokens-day"] == "50"

    asyncio.run(main())
    assert sqlite_store.reads == 2


def test_concurrent_requests_written_batches_and_reads_never_let_a_key_past_its_budget(sqlite_store, tmp_path):
    """The adversary: eight streams of one key spending its budget as fast as the router admits
    them, the ledger writing in small batches (several transactions per flush) in its own task,
    and slow reads of the store overlapping those writes and the checks waiting on them. Every
    request costs exactly its price, so what is admitted must be the budget to the token. (The
    orderings that broke earlier versions are pinned one by one by the tests below.)"""
    sqlite_store.set_budget("k1", tokens_per_day=10_000, tokens_per_month=None)
    read = sqlite_store.budget_state

    def slow_read(key_id, **kwargs):
        time.sleep(0.004)  # a query in flight while batches are written
        return read(key_id, **kwargs)

    sqlite_store.budget_state = slow_read

    class Ticking(Clock):  # every look at the clock is 0.2 s on: entries expire and refresh all along
        def __call__(self):
            self.now += 0.2
            return self.now

    ledger = UsageLedger(sqlite_store, tmp_path / "spool", writer_id="a", flush_interval_s=0.003, max_batch=2)
    guard = BudgetGuard(sqlite_store, ledger, cache_ttl_s=5, clock=Ticking("2026-12-01T12:00:00"))
    ledger.on_written = guard.written
    admitted = []
    full = 10_000 // 70  # 142 requests: every token of the budget
    # The adversary keeps asking for 0.3 s more once the budget is full (an overshoot would show),
    # and gives up after 10 s (a count that never comes back down would show).
    deadline = [time.monotonic() + 10]

    async def stream(worker: int):
        attempt = 0
        while time.monotonic() < deadline[0]:
            attempt += 1
            try:
                held = await guard.reserve("k1", 70)
            except APIError as refused:
                assert refused.code == "budget_exceeded"
                await asyncio.sleep(0.002)
                continue
            admitted.append(worker)
            if len(admitted) == full:
                deadline[0] = min(deadline[0], time.monotonic() + 0.3)
            await asyncio.sleep(0.001 * (attempt % 3))  # in flight
            ledger.record(usage_record(day="2026-12-01", prompt=50, completion=20))  # 70: its price
            held.release()

    async def main():
        ledger.start()
        await asyncio.gather(*(stream(w) for w in range(8)))
        await ledger.aclose()
        await guard.settle()

    asyncio.run(main())
    assert len(admitted) == full  # every token of the budget, and not one more
    assert sqlite_store.spent("k1", since_day="2026-12-01") == 142 * 70 and len(set(admitted)) > 1


def test_an_entry_read_before_midnight_counts_nothing_for_the_new_day(sqlite_store):
    sqlite_store.set_budget("k1", tokens_per_day=100, tokens_per_month=None)
    sqlite_store.insert([usage_record(day="2026-12-01", at="23:59:58", prompt=100, completion=0)])
    clock = Clock("2026-12-01T23:59:59")
    guard = BudgetGuard(sqlite_store, None, cache_ttl_s=5, clock=clock)
    assert _refusal(guard).headers["Retry-After"] == "1"
    clock.now += 2  # 00:00:01, still within the entry's TTL
    assert _check(guard)["x-budget-remaining-tokens-day"] == "100"


def test_an_unreachable_store_fails_open_for_unknown_keys_and_keeps_known_ones(store, caplog):
    store.set_budget("k1", tokens_per_day=100, tokens_per_month=None)
    store.insert([usage_record(day="2026-12-01", prompt=100, completion=0)])
    clock = Clock("2026-12-01T12:00:00")
    guard = BudgetGuard(store, None, cache_ttl_s=5, clock=clock)
    _refusal(guard)  # k1 is known, and over its budget
    store.database = unreachable(store.database)
    clock.now += 10  # the entry has expired
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        assert _refusal(guard).code == "budget_exceeded"  # the stale entry still refuses
        assert _check(guard, "k2") == {}  # never seen: admitted
    assert "keeps its last known budget" in caplog.text and "admitting key k2 unchecked" in caplog.text
    reads = store.reads
    assert _check(guard, "k2") == {} and store.reads == reads  # no retry until the grace entry expires
    clock.now += 6
    assert _check(guard, "k2") == {} and store.reads == reads + 1


def test_a_read_overtaken_by_batches_counts_all_of_them_for_its_waiters(sqlite_store, tmp_path):
    sqlite_store.set_budget("k1", tokens_per_day=300, tokens_per_month=None)
    read_done, release = threading.Event(), threading.Event()
    read = sqlite_store.budget_state

    def slow_read(key_id, **kwargs):  # reads, then is slow to answer
        answer = read(key_id, **kwargs)
        read_done.set()
        release.wait(5)
        return answer

    ledger = UsageLedger(sqlite_store, tmp_path / "spool", writer_id="a", max_batch=1)  # a transaction each
    guard = BudgetGuard(sqlite_store, ledger, clock=Clock("2026-12-01T12:00:00"))
    ledger.on_written = guard.written

    async def main():
        for prompt in (60, 40):  # pending: counted as this router's
            ledger.record(usage_record(day="2026-12-01", prompt=prompt, completion=0))
        sqlite_store.budget_state = slow_read
        early = asyncio.create_task(guard.check("k1"))
        # Its read has been made, in a thread, and has not seen the records (waited for, not slept
        # on: a loaded host may start the thread after the flush below).
        assert await asyncio.to_thread(read_done.wait, 5)
        await ledger.flush()  # two batches written: no longer pending, and not in what that read saw
        release.set()
        # Its waiters count both batches: 100 spent, not 0 or 60 (which would admit too much).
        assert (await early)["x-budget-remaining-tokens-day"] == "200"
        assert (await guard.check("k1"))["x-budget-remaining-tokens-day"] == "200"  # cached, with the same count
        assert sqlite_store.reads == 1

    asyncio.run(main())


def test_records_spooled_in_an_outage_and_replayed_count_once(sqlite_store, tmp_path):
    sqlite_store.set_budget("k1", tokens_per_day=1000, tokens_per_month=None)
    clock = Clock("2026-12-01T12:00:00")
    guard, ledger = _guard_with_ledger(sqlite_store, tmp_path, clock=clock)
    database = sqlite_store.database

    async def remaining() -> str:
        return (await guard.check("k1"))["x-budget-remaining-tokens-day"]

    async def main():
        assert await remaining() == "1000"
        sqlite_store.database = unreachable(database)
        ledger.record(usage_record(day="2026-12-01", prompt=300, completion=0))
        await ledger.flush()  # the write fails: spooled, still this router's own unwritten spend
        assert ledger.spooled == 1 and await remaining() == "700"
        sqlite_store.database = database
        ledger.record(usage_record(day="2026-12-01", prompt=100, completion=0))
        await ledger.flush()  # the database was away: the 100 is spooled too, and the replay tries it
        await ledger._probe
        assert ledger.replayed == 2 and await remaining() == "600" and not ledger.database_away
        clock.now += 6  # read again: the store has both, counted once
        assert await remaining() == "600"

    asyncio.run(main())
    assert sqlite_store.reads == 2


def test_a_spool_that_cannot_be_listed_keeps_its_records_pending(sqlite_store, tmp_path, monkeypatch):
    sqlite_store.set_budget("k1", tokens_per_day=1000, tokens_per_month=None)
    guard, ledger = _guard_with_ledger(sqlite_store, tmp_path)
    database = sqlite_store.database

    async def main():
        sqlite_store.database = unreachable(database)
        ledger.record(usage_record(day="2026-12-01", prompt=300, completion=0))
        await ledger.flush()  # spooled
        sqlite_store.database = database
        real_listdir = os.listdir
        monkeypatch.setattr(os, "listdir", lambda path: (_ for _ in ()).throw(OSError(24, "Too many open files")))
        # The spool cannot be listed: this writer's own files are not "gone" (their spend would
        # stop counting before the database has it), and are replayed by the names it knows.
        another = tmp_path / "spool-a" / f"other-{time.time_ns()}.jsonl"
        another.write_text(json.dumps(usage_record(day="2026-12-01", prompt=50, completion=0).to_json()) + "\n")
        ledger.record(usage_record(day="2026-12-01", prompt=100, completion=0))
        await ledger.flush()
        assert ledger.pending_tokens("k1") == 400  # spooled, not yet known written
        await ledger._probe
        assert ledger.replayed == 2 and ledger.pending_tokens("k1") == 0 and another.exists()
        assert (await guard.check("k1"))["x-budget-remaining-tokens-day"] == "600"
        monkeypatch.setattr(os, "listdir", real_listdir)
        ledger.record(usage_record(day="2026-12-01", prompt=1, completion=0))
        await ledger.flush()  # written; listed again: the other writer's file is replayed, counted once
        assert ledger.replayed == 3 and not another.exists()

    asyncio.run(main())


def test_a_batch_written_between_a_reads_answer_and_its_waiters_waking_is_counted(sqlite_store, tmp_path):
    sqlite_store.set_budget("k1", tokens_per_day=300, tokens_per_month=None)
    guard, ledger = _guard_with_ledger(sqlite_store, tmp_path)
    cache = guard._cache

    def cache_then_write(key_id, entry):  # the read is cached; its waiters wake two loop steps later
        cache(key_id, entry)
        asyncio.get_running_loop().call_soon(write_batch)

    def write_batch():  # what the ledger's flush does, in one step: insert, then settle
        batch, ledger._pending = ledger._pending, []
        sqlite_store.insert(batch)
        ledger._settle(Counter(r.key_id for r in batch for _ in range(r.total_tokens)))

    guard._cache = cache_then_write

    async def main():
        ledger.record(usage_record(day="2026-12-01", prompt=100, completion=0))  # pending
        headers = await guard.check("k1")  # waits on the read; the batch lands before it decides
        assert ledger.pending_tokens("k1") == 0 and headers["x-budget-remaining-tokens-day"] == "200"

    asyncio.run(main())


def test_a_batch_written_after_midnight_counts_against_the_new_day_at_once(sqlite_store, tmp_path):
    sqlite_store.set_budget("k1", tokens_per_day=100, tokens_per_month=None)
    clock = Clock("2026-12-01T23:59:58")
    guard, ledger = _guard_with_ledger(sqlite_store, tmp_path, clock=clock)

    async def main():
        assert (await guard.check("k1"))["x-budget-remaining-tokens-day"] == "100"  # read for Dec 1
        clock.now += 3  # 00:00:01 on Dec 2, the entry still fresh
        ledger.record(usage_record(day="2026-12-02", at="00:00:00", prompt=100, completion=0))
        await ledger.flush()
        with pytest.raises(APIError) as refused:  # not "nothing spent today": the batch counts
            await guard.check("k1")
        assert refused.value.headers["x-budget-remaining-tokens-day"] == "0"

    asyncio.run(main())


def test_a_budget_set_on_a_busy_key_counts_what_this_router_wrote_before(sqlite_store, tmp_path):
    clock = Clock("2026-12-01T12:00:00")
    guard, ledger = _guard_with_ledger(sqlite_store, tmp_path, clock=clock)

    async def main():
        assert await guard.check("k1") == {}  # no budget (cached)
        ledger.record(usage_record(day="2026-12-01", prompt=100, completion=0))
        await ledger.flush()
        sqlite_store.set_budget("k1", tokens_per_day=150, tokens_per_month=None)
        clock.now += 6
        assert (await guard.check("k1"))["x-budget-remaining-tokens-day"] == "50"

    asyncio.run(main())
    assert sqlite_store.primary_reads == 1  # written 6 s ago: the replica may not have it


def test_the_written_totals_are_pruned_only_where_nothing_refers_to_them(sqlite_store, monkeypatch):
    monkeypatch.setattr(budgets, "MAX_ENTRIES", 4)
    clock = Clock("2026-12-01T12:00:00")
    guard = BudgetGuard(sqlite_store, None, clock=clock)
    sqlite_store.set_budget("k1", tokens_per_day=1000, tokens_per_month=None)
    release = threading.Event()
    read = sqlite_store.budget_state

    def held_read(key_id, **kwargs):
        if key_id == "reading":
            release.wait(5)
        return read(key_id, **kwargs)

    sqlite_store.budget_state = held_read

    async def main():
        assert (await guard.check("k1"))["x-budget-remaining-tokens-day"] == "1000"  # k1: a cached entry
        reading = asyncio.create_task(guard.check("reading"))  # a read under way
        await asyncio.sleep(0.05)
        guard.written({"k1": 100, "reading": 7, "old1": 1, "old2": 1})
        clock.now += 31  # those writes are old now
        guard.written({"new": 1})  # five totals: pruned to those something refers to
        assert guard._written_tokens == {"k1": 100, "reading": 7, "new": 1}
        assert guard._prune_at == 6  # all three in use: the next prune waits for twice as many
        release.set()
        await reading

    asyncio.run(main())


def test_a_key_whose_reread_fails_after_a_write_keeps_its_entry_with_the_write_counted(sqlite_store):
    sqlite_store.set_budget("k1", tokens_per_day=100, tokens_per_month=None)
    sqlite_store.insert([usage_record(day="2026-12-01", prompt=60, completion=0)])
    clock = Clock("2026-12-01T12:00:00")
    guard = BudgetGuard(sqlite_store, None, cache_ttl_s=5, clock=clock)
    assert _check(guard)["x-budget-remaining-tokens-day"] == "40"
    sqlite_store.insert([usage_record(day="2026-12-01", prompt=40, completion=0)])
    guard.written({"k1": 40})
    sqlite_store.database = unreachable(sqlite_store.database)
    clock.now += 10  # expired, and the store is away: the last known entry, with the write in it
    refused = _refusal(guard)
    assert refused.code == "budget_exceeded" and refused.headers["x-budget-remaining-tokens-day"] == "0"


def test_any_database_error_on_a_miss_admits_rather_than_failing_the_request(sqlite_store):
    def broken(*args, **kwargs):
        raise ValueError("a driver error that is not RegistryUnavailable")

    sqlite_store.budget_state = broken
    guard = BudgetGuard(sqlite_store, None, clock=Clock("2026-12-01T12:00:00"))
    assert _check(guard) == {}  # admitted unchecked (and logged), never a 500


# --- escrow: a request's worst case is held until it ends ----------------------------------------------
def _guard_with_ledger(store, tmp_path, name="a", clock=None):
    ledger = UsageLedger(store, tmp_path / f"spool-{name}", writer_id=name)
    guard = BudgetGuard(store, ledger, clock=clock or Clock("2026-12-01T12:00:00"))
    ledger.on_written = guard.written
    return guard, ledger


def test_a_request_whose_worst_case_does_not_fit_is_refused_with_its_cost_and_what_is_left(sqlite_store):
    """#22: one admitted request took a 50-token daily budget to 144 tokens."""
    sqlite_store.set_budget("k1", tokens_per_day=50, tokens_per_month=None)
    guard = BudgetGuard(sqlite_store, None, clock=Clock("2026-12-01T12:00:00"))
    with pytest.raises(APIError) as refused:
        asyncio.run(guard.reserve("k1", 144))
    assert refused.value.status == 429 and refused.value.code == "budget_exceeded"
    assert "144 tokens" in refused.value.message and "has 50 left" in refused.value.message
    assert refused.value.headers["Retry-After"] == "43200"  # it will not fit before midnight
    assert guard.held_tokens("k1") == 0
    assert asyncio.run(guard.reserve("k1", 50)).headers["x-budget-remaining-tokens-day"] == "50"


def test_concurrent_reservations_on_one_router_never_exceed_the_budget(sqlite_store, tmp_path):
    sqlite_store.set_budget("k1", tokens_per_day=1000, tokens_per_month=None)
    guard, _ = _guard_with_ledger(sqlite_store, tmp_path)

    async def main():  # 20 at once, on a cold cache: all wait on one load, then decide in turn
        return await asyncio.gather(*(guard.reserve("k1", 100) for _ in range(20)), return_exceptions=True)

    outcomes = asyncio.run(main())
    admitted = [o for o in outcomes if not isinstance(o, Exception)]
    refused = [o for o in outcomes if isinstance(o, APIError)]
    assert len(admitted) == 10 and len(refused) == 10 and guard.held_tokens("k1") == 1000
    # Held by requests in flight, not spent: worth retrying soon, not at midnight.
    assert {r.code for r in refused} == {"budget_exceeded"} and refused[0].headers["Retry-After"] == "1"
    assert "1000 more are reserved by its requests in flight" in refused[-1].message
    assert sqlite_store.reads == 1
    for reservation in admitted:
        reservation.release()
    assert guard.held_tokens("k1") == 0


def test_a_reservation_released_after_its_record_is_queued_leaves_no_gap_and_no_double_count(sqlite_store, tmp_path):
    sqlite_store.set_budget("k1", tokens_per_day=1000, tokens_per_month=None)
    guard, ledger = _guard_with_ledger(sqlite_store, tmp_path)

    async def main():
        held = await guard.reserve("k1", 600)
        assert (await guard.check("k1"))["x-budget-remaining-tokens-day"] == "400"
        with pytest.raises(APIError):
            await guard.reserve("k1", 500)
        ledger.record(usage_record(day="2026-12-01", prompt=200, completion=100))  # it used 300 of 600
        with pytest.raises(APIError):  # record queued, not yet released: counted twice, never zero times
            await guard.reserve("k1", 500)
        held.release()
        held.release()  # idempotent: releases nothing more
        assert guard.held_tokens("k1") == 0
        second = await guard.reserve("k1", 700)  # 300 recorded + 700 = the limit: fits
        await ledger.flush()  # the record reaches the database: counted there instead, once
        with pytest.raises(APIError) as full:
            await guard.reserve("k1", 1)
        assert full.value.headers["x-budget-remaining-tokens-day"] == "0"
        second.release()
        assert (await guard.check("k1"))["x-budget-remaining-tokens-day"] == "700"

    asyncio.run(main())


def test_a_reservation_dropped_without_release_is_released_and_logged(sqlite_store, caplog):
    sqlite_store.set_budget("k1", tokens_per_day=1000, tokens_per_month=None)
    guard = BudgetGuard(sqlite_store, None, clock=Clock("2026-12-01T12:00:00"))

    async def forgotten():
        await guard.reserve("k1", 400)  # the caller drops it: a bug

    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        asyncio.run(forgotten())
    assert guard.held_tokens("k1") == 0 and "never released" in caplog.text


def test_a_key_without_a_budget_reserves_nothing(sqlite_store):
    guard = BudgetGuard(sqlite_store, None, clock=Clock("2026-12-01T12:00:00"))

    async def main():
        return [await guard.reserve("k1", 10**6) for _ in range(3)]

    reservations = asyncio.run(main())
    assert [r.headers for r in reservations] == [{}] * 3 and guard._held == {} and sqlite_store.reads == 1
    reservations[0].release()  # harmless


def test_while_the_store_is_away_a_known_key_still_reserves_and_an_unknown_one_is_admitted(sqlite_store):
    sqlite_store.set_budget("k1", tokens_per_day=1000, tokens_per_month=None)
    clock = Clock("2026-12-01T12:00:00")
    guard = BudgetGuard(sqlite_store, None, cache_ttl_s=5, clock=clock)
    held = asyncio.run(guard.reserve("k1", 900))
    sqlite_store.database = unreachable(sqlite_store.database)
    clock.now += 10
    with pytest.raises(APIError):  # the stale entry, with this router's reservation on top
        asyncio.run(guard.reserve("k1", 200))
    assert asyncio.run(guard.reserve("k2", 10**6)).headers == {}  # fail open, nothing held
    held.release()


def test_the_overshoot_left_is_other_routers_reservations_in_flight(sqlite_store, tmp_path):
    """Two routers (two ledgers, one database) each see only their own reservations: past the
    limit, the key can get what the other router admitted in flight — at most the remaining
    budget that router saw — and nothing more once their records are written."""
    sqlite_store.set_budget("k1", tokens_per_day=1000, tokens_per_month=None)
    clock = Clock("2026-12-01T12:00:00")
    a, ledger_a = _guard_with_ledger(sqlite_store, tmp_path, "a", clock)
    b, ledger_b = _guard_with_ledger(sqlite_store, tmp_path, "b", clock)

    async def main():
        on_a = await a.reserve("k1", 800)
        seen_by_b = int((await b.check("k1"))["x-budget-remaining-tokens-day"])
        on_b = await b.reserve("k1", 800)  # a's 800 in flight are invisible here
        admitted = on_a.tokens + on_b.tokens
        assert admitted <= 1000 + seen_by_b  # the documented bound: limit + what b saw left
        for ledger, held in ((ledger_a, on_a), (ledger_b, on_b)):
            ledger.record(usage_record(day="2026-12-01", prompt=700, completion=100))
            held.release()
            await ledger.flush()
        clock.now += 6  # each router's cache TTL has passed: each reads the other's write
        for guard in (a, b):
            with pytest.raises(APIError):  # 1600 spent: neither router admits more
                await guard.reserve("k1", 1)

    asyncio.run(main())


def test_a_wall_clock_stepped_back_does_not_keep_a_cached_budget_past_its_ttl(sqlite_store):
    """The cache's lifetimes were on the wall clock: NTP or a resumed VM stepping it back an hour
    kept a spent key refused for that hour after its budget was raised (no re-read), and left other
    routers' spend unseen as long. They are on the monotonic clock now."""
    sqlite_store.set_budget("k1", tokens_per_day=100, tokens_per_month=None)
    sqlite_store.insert([usage_record(day="2026-12-01", prompt=100, completion=0)])
    wall, monotonic = Clock("2026-12-01T12:00:00"), Clock("2026-12-01T00:00:00")
    guard = BudgetGuard(sqlite_store, None, cache_ttl_s=5, clock=wall, monotonic=monotonic)
    assert _refusal(guard).code == "budget_exceeded"
    sqlite_store.set_budget("k1", tokens_per_day=1000, tokens_per_month=None)  # raised
    wall.now -= 3600  # stepped back an hour
    monotonic.now += 6  # past the entry's TTL
    reads = sqlite_store.reads
    assert _check(guard)["x-budget-remaining-tokens-day"] == "900"  # before: refused for an hour
    assert sqlite_store.reads == reads + 1

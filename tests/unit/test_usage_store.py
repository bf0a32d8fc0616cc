"""The usage ledger's tables on both registry databases (a SQLite file and a real PostgreSQL
server): idempotent batch inserts, the daily rollup they keep, and what reports and budgets read.

``open_test_database``, ``unreachable`` and ``usage_record`` are shared with the other usage tests."""

import datetime as dt
import threading
import uuid
from pathlib import Path

import pytest

from serve_app.auth.database import PostgresDatabase, SqliteDatabase, open_database
from serve_app.usage.records import UsageRecord
from serve_app.usage.store import MAX_PARAMS, UsageStore


def open_test_database(request, tmp_path: Path):
    if request.param == "sqlite":
        return open_database(tmp_path / "registry.sqlite3", create=True)
    return open_database(request.getfixturevalue("fresh_database"))


def unreachable(database):
    """A database of the same kind that cannot be reached (a closed port, a deleted file)."""
    if database.kind == "postgres":
        from tests.conftest import free_port

        return PostgresDatabase(f"postgresql://serve_app@127.0.0.1:{free_port()}/gone")
    gone = SqliteDatabase(database.path.parent / "gone.sqlite3", create=True)
    gone.path.unlink()
    return gone


def ms(iso: str) -> int:
    return int(dt.datetime.fromisoformat(iso).replace(tzinfo=dt.timezone.utc).timestamp() * 1000)


def usage_record(
    *, key_id="k1", day="2026-12-01", at="10:00:00", model="qwen-3.6-35b-a3b", region="yul-02",
    prompt=100, completion=20, cached=0, **extra,
) -> UsageRecord:
    started = ms(f"{day}T{at}")
    fields = dict(
        id=uuid.uuid4().hex, key_id=key_id, owner="acme", region=region, model=model,
        route="/v1/chat/completions", prompt_tokens=prompt, completion_tokens=completion,
        cached_tokens=cached, status=200, finish_reason="stop", started_at_ms=started, ended_at_ms=started + 1500,
    )
    return UsageRecord(**{**fields, **extra})


@pytest.fixture(params=["sqlite", "postgres"])
def store(request, tmp_path) -> UsageStore:
    return UsageStore(open_test_database(request, tmp_path))


def _by_day(store):
    return store.totals(key_id=None, since="2026-01-01", until="2026-12-31", group_by=("day",))


# --- records ---------------------------------------------------------------------------------------
def test_a_record_is_dated_by_the_utc_day_it_started_and_round_trips_through_json():
    late = usage_record(day="2026-12-01", at="23:59:59.999", failover_origin="yvr-01")
    assert late.day == "2026-12-01" and late.total_tokens == 120
    assert UsageRecord.from_json(late.to_json()) == late
    assert usage_record(day="2026-12-02", at="00:00:00").day == "2026-12-02"

def test_only_a_continuation_row_writes_the_continues_field_to_a_spool():
    """A release before the field refuses a spool line that has it (``UnknownFields``) and holds
    the whole file: a request's record leaves it out, so a rollback replays those files."""
    request, continuation = usage_record(), usage_record(continues="a" * 32)
    assert "continues" not in request.to_json() and UsageRecord.from_json(request.to_json()) == request
    assert continuation.to_json()["continues"] == "a" * 32
    assert UsageRecord.from_json(continuation.to_json()) == continuation



@pytest.mark.parametrize(
    "change, fragment",
    [
        (lambda raw: raw.pop("key_id"), "missing field 'key_id'"),
        (lambda raw: raw.update(prompt_tokens="100"), "'prompt_tokens' has the wrong type"),
        (lambda raw: raw.update(status=True), "'status' has the wrong type"),
        (lambda raw: raw.update(finish_reason=3), "'finish_reason' has the wrong type"),
        (lambda raw: raw.update(extra=1), "unknown fields ['extra']"),
    ],
)
def test_a_mistyped_record_is_refused_before_it_reaches_a_database(change, fragment):
    raw = usage_record().to_json()
    change(raw)
    with pytest.raises(ValueError) as refused:
        UsageRecord.from_json(raw)
    assert fragment in str(refused.value)


def test_a_record_without_its_optional_field_is_read_with_the_default():
    raw = usage_record().to_json()
    del raw["failover_origin"]
    assert UsageRecord.from_json(raw).failover_origin is None


# --- insert ----------------------------------------------------------------------------------------
def test_insert_is_idempotent_and_the_rollup_counts_each_record_once(store):
    batch = [usage_record(), usage_record(prompt=50, completion=5, cached=30, stored_bytes=4096), usage_record(model="other")]
    assert store.insert(batch) == 3
    before = store.totals(key_id="k1", since="2026-12-01", until="2026-12-01", group_by=("model",))
    assert before == [
        {"model": "other", "requests": 1, "prompt_tokens": 100, "completion_tokens": 20, "cached_tokens": 0,
         "stored_bytes": 0, "total_tokens": 120},
        {"model": "qwen-3.6-35b-a3b", "requests": 2, "prompt_tokens": 150, "completion_tokens": 25, "cached_tokens": 30,
         "stored_bytes": 4096, "total_tokens": 175},
    ]
    assert store.insert(batch) == 0  # a replay
    assert store.insert([batch[0], batch[0]]) == 0  # a duplicate inside one batch
    fresh = usage_record()
    assert store.insert([batch[1], fresh, fresh]) == 1  # only the new one counts, once
    after = store.totals(key_id="k1", since="2026-12-01", until="2026-12-01", group_by=("model",))
    assert after[0] == before[0]
    assert after[1]["requests"] == 3 and after[1]["total_tokens"] == 175 + 120
    assert store.insert([]) == 0


def test_a_peers_continuation_row_counts_its_tokens_but_not_a_request(store):
    """A stream a peer region continued: the request's record where it was admitted, and the
    peer's row that ``continues`` it (``router/resume.py``): one request, every token, in budgets too."""
    request = usage_record(prompt=100, completion=20, resumes=1, resumed_in="yvr-01")
    continuation = usage_record(region="yvr-01", prompt=0, completion=30, resume_prompt_tokens=120,
                                failover_origin="yul-02", continues=request.id)
    assert store.insert([request, continuation]) == 2
    by_region = store.totals(key_id="k1", since="2026-12-01", until="2026-12-01", group_by=("region",))
    by_region = [(r["region"], r["requests"], r["total_tokens"]) for r in by_region]
    assert by_region == [("yul-02", 1, 120), ("yvr-01", 0, 30)]
    (day,) = store.totals(key_id="k1", since="2026-12-01", until="2026-12-01", group_by=("day",))
    assert (day["requests"], day["prompt_tokens"], day["completion_tokens"]) == (1, 100, 50)
    assert store.spent("k1", "2026-12-01") == 150
    assert store.insert([continuation]) == 0  # a replay of the peer's spool: counted once


def test_a_batch_larger_than_one_statement_is_written_whole(store):
    count = MAX_PARAMS // 20 * 2 + 7  # three INSERT statements of records (20 columns each)
    batch = [usage_record(key_id=f"k{i % 3}", completion=1, prompt=0) for i in range(count)]
    assert store.insert(batch) == count
    rows = store.totals(key_id=None, since="2026-12-01", until="2026-12-01", group_by=("key_id",))
    assert sum(row["requests"] for row in rows) == count and [row["key_id"] for row in rows] == ["k0", "k1", "k2"]
    assert store.insert(list(reversed(batch))) == 0


def test_a_report_can_be_one_owners(store):
    store.insert([usage_record(key_id="k1"), usage_record(key_id="k2", owner="globex"), usage_record(key_id="k3")])
    acme = store.totals(key_id=None, owner="acme", since="2026-12-01", until="2026-12-01", group_by=("key_id",))
    assert [row["key_id"] for row in acme] == ["k1", "k3"]
    assert store.totals(key_id="k2", owner="acme", since="2026-12-01", until="2026-12-01", group_by=("day",)) == []


def test_an_owners_report_and_an_operators_read_their_days_by_index_not_every_tenants_history(tmp_path):
    """An owner admin's report filters by owner and days, an operator's by days: the rollup's
    primary key starts with key_id, so both scanned every tenant's whole history (SQLite's plan,
    as the query runs; PostgreSQL picks by its statistics, from the same indexes)."""
    store = UsageStore(SqliteDatabase(tmp_path / "usage.sqlite3", create=True))
    store.insert([usage_record(key_id=f"k{i}", owner=f"owner-{i % 7}", day=f"2026-11-{1 + i % 28:02d}")
                  for i in range(200)])
    plans = []
    with store.database.connect() as db:
        for where, params in (("day >= ? AND day <= ? AND owner = ?", ("2026-11-01", "2026-11-30", "owner-3")),
                              ("day >= ? AND day <= ?", ("2026-11-01", "2026-11-02"))):
            rows = db.execute(f"EXPLAIN QUERY PLAN SELECT key_id, SUM(prompt_tokens) FROM usage_daily "
                              f"WHERE {where} GROUP BY key_id", params).fetchall()
            plans.append(" ".join(str(tuple(row)[-1]) for row in rows))
    owner_plan, days_plan = plans
    assert "SEARCH usage_daily USING INDEX usage_daily_owner_day (owner=? AND day>? AND day<?)" in owner_plan
    assert "SEARCH usage_daily USING INDEX usage_daily_day (day>? AND day<?)" in days_plan
    by_owner = store.totals(key_id=None, owner="owner-3", since="2026-11-01", until="2026-11-30", group_by=("key_id",))
    assert sorted(row["key_id"] for row in by_owner) == sorted(f"k{i}" for i in range(200) if i % 7 == 3)


def test_two_regions_writing_the_same_records_at_once_count_them_once(store):
    other = UsageStore(open_database(getattr(store.database, "dsn", None) or store.database.path))
    batch = [usage_record(key_id=f"k{i % 4}", model=f"m{i % 3}") for i in range(300)]
    new = []
    threads = [threading.Thread(target=lambda s=s: new.append(s.insert(batch))) for s in (store, other)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(new) == [0, 300]
    assert sum(row["requests"] for row in _by_day(store)) == 300


# --- reads -----------------------------------------------------------------------------------------
def _month_of_usage(store):
    store.insert([
        usage_record(day="2026-11-30", region="yvr-01", prompt=10, completion=1),
        usage_record(day="2026-12-01", prompt=100, completion=20, cached=60),
        usage_record(day="2026-12-01", model="small", prompt=30, completion=3),
        usage_record(day="2026-12-02", region="yvr-01", prompt=7, completion=2),
        usage_record(day="2026-12-02", key_id="k2", prompt=1000, completion=100),
    ])


def test_totals_group_by_day_model_region_and_month_within_inclusive_days(store):
    _month_of_usage(store)
    by_day = store.totals(key_id="k1", since="2026-11-30", until="2026-12-02", group_by=("day",))
    assert [(r["day"], r["requests"], r["total_tokens"]) for r in by_day] == [
        ("2026-11-30", 1, 11), ("2026-12-01", 2, 153), ("2026-12-02", 1, 9)
    ]
    assert by_day[1]["cached_tokens"] == 60
    one_day = store.totals(key_id="k1", since="2026-12-01", until="2026-12-01", group_by=("model", "region"))
    assert [(r["model"], r["region"], r["requests"]) for r in one_day] == [("qwen-3.6-35b-a3b", "yul-02", 1), ("small", "yul-02", 1)]
    by_region = store.totals(key_id=None, since="2026-12-01", until="2026-12-02", group_by=("region",))
    assert [(r["region"], r["total_tokens"]) for r in by_region] == [("yul-02", 1253), ("yvr-01", 9)]
    by_month = store.totals(key_id=None, since="2026-11-01", until="2026-12-31", group_by=("month", "key_id"))
    assert [(r["month"], r["key_id"], r["requests"]) for r in by_month] == [("2026-11", "k1", 1), ("2026-12", "k1", 3), ("2026-12", "k2", 1)]
    assert store.totals(key_id="nobody", since="2026-11-01", until="2026-12-31", group_by=("day",)) == []
    with pytest.raises(ValueError, match="group_by"):
        store.totals(key_id=None, since="2026-11-01", until="2026-12-31", group_by=("owner",))


def test_spent_is_prompt_plus_completion_since_a_day(store):
    _month_of_usage(store)
    assert store.spent("k1", "2026-11-30") == 11 + 153 + 9
    assert store.spent("k1", "2026-12-01") == 153 + 9  # cached tokens are inside prompt_tokens already
    assert store.spent("k1", "2026-12-03") == 0 and store.spent("k2", "2026-12-01") == 1100


def test_budgets_are_set_replaced_read_and_cleared(store):
    assert store.budget("k1") is None and not store.clear_budget("k1")
    store.set_budget("k1", tokens_per_day=1000, tokens_per_month=None)
    store.set_budget("k1", tokens_per_day=None, tokens_per_month=30_000)  # replaces both limits
    budget = store.budget("k1")
    assert (budget.tokens_per_day, budget.tokens_per_month) == (None, 30_000) and budget.updated_at > 0
    _month_of_usage(store)
    assert store.budget_state("k1", day="2026-12-02", month_start="2026-12-01") == (budget, 9, 162)
    assert store.budget_state("k2", day="2026-12-02", month_start="2026-12-01") == (None, 0, 0)
    with pytest.raises(ValueError, match="daily or a monthly"):
        store.set_budget("k1", tokens_per_day=None, tokens_per_month=None)
    with pytest.raises(ValueError, match="negative"):
        store.set_budget("k1", tokens_per_day=-1, tokens_per_month=None)
    assert store.clear_budget("k1") and store.budget("k1") is None


def test_a_row_dated_after_today_counts_on_its_own_day_not_on_today_too(store):
    """A router whose clock is ahead, or a continuation a peer dated past midnight, writes a row
    for tomorrow: it counted against today's and this month's spend, then against its own day's."""
    store.set_budget("k1", tokens_per_day=1000, tokens_per_month=None)
    store.insert([usage_record(day="2026-12-02", prompt=5, completion=4),
                  usage_record(day="2026-12-03", at="00:02:00", prompt=70, completion=30)])
    (_, today, month) = store.budget_state("k1", day="2026-12-02", month_start="2026-12-01")
    assert (today, month) == (9, 9)  # before: 109 and 109
    (_, tomorrow, month) = store.budget_state("k1", day="2026-12-03", month_start="2026-12-01")
    assert (tomorrow, month) == (100, 109)


def test_records_are_written_to_the_primary_and_reports_read_from_the_replica(postgres_dsn):
    from tests.postgres_server import new_database

    primary, replica = new_database(postgres_dsn), new_database(postgres_dsn)
    UsageStore(open_database(replica))  # the replica's schema (replication would bring it)
    here = UsageStore(open_database(primary, replica=replica))
    assert here.insert([usage_record()]) == 1
    here.set_budget("k1", tokens_per_day=10, tokens_per_month=None)
    assert _by_day(UsageStore(open_database(primary))) == [
        {"day": "2026-12-01", "requests": 1, "prompt_tokens": 100, "completion_tokens": 20, "cached_tokens": 0,
         "stored_bytes": 0, "total_tokens": 120}
    ]
    assert _by_day(here) == [] and here.budget("k1") is None  # reads: the replica, which lags behind
    assert here.budget_state("k1", day="2026-12-01", month_start="2026-12-01") == (None, 0, 0)


# --- an upgrade ------------------------------------------------------------------------------------
_BEFORE_STORED_BYTES = """
CREATE TABLE usage_records (
    id TEXT PRIMARY KEY, key_id TEXT NOT NULL, owner TEXT NOT NULL, region TEXT NOT NULL, model TEXT NOT NULL,
    route TEXT NOT NULL, prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL, status INTEGER NOT NULL, finish_reason TEXT, started_at_ms INTEGER NOT NULL,
    ended_at_ms INTEGER NOT NULL, failover_origin TEXT, day TEXT NOT NULL
);
CREATE TABLE usage_daily (
    key_id TEXT NOT NULL, day TEXT NOT NULL, model TEXT NOT NULL, region TEXT NOT NULL, owner TEXT NOT NULL,
    requests INTEGER NOT NULL, prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL, PRIMARY KEY (key_id, day, model, region)
);
INSERT INTO usage_records VALUES ('old', 'k1', 'acme', 'yul-02', 'm', '/v1/chat/completions', 10, 2, 0, 200, 'stop',
    1796119200000, 1796119201000, NULL, '2026-12-01');
INSERT INTO usage_daily VALUES ('k1', '2026-12-01', 'm', 'yul-02', 'acme', 1, 10, 2, 0);
"""


@pytest.fixture(params=["sqlite", "postgres"])
def empty_database(request, tmp_path):
    return open_test_database(request, tmp_path)


def test_tables_of_the_release_before_stored_bytes_gain_the_column_and_keep_their_rows(empty_database):
    database = empty_database
    database.create_schema(_BEFORE_STORED_BYTES)

    store = UsageStore(database)
    UsageStore(database)  # a second router starting on the upgraded tables changes nothing
    assert store.insert([usage_record(model="m", stored_bytes=300)]) == 1

    (row,) = store.totals(key_id="k1", since="2026-12-01", until="2026-12-01", group_by=("day",))
    assert (row["requests"], row["total_tokens"], row["stored_bytes"]) == (2, 132, 300)
    with database.connect() as db:
        old = db.execute("SELECT stored_bytes FROM usage_records WHERE id = 'old'").fetchone()
    assert old["stored_bytes"] == 0

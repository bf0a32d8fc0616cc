"""The usage ledger's tables, in the key registry's database (one registry for every region).

``usage_records`` holds one row per request, keyed by the router's record id, so a replayed or
doubly written record is a no-op — and, for a stream a peer region continued, the peer's row
that ``continues`` it (its engine's tokens, no request: ``requests`` counts the others).
``usage_daily`` is the rollup every report and budget check
reads — per (key, UTC day, model, region) — so neither ever scans the per-request table; it is
updated in the same transaction as the insert, with exactly the rows the insert added, so the two
never disagree. Besides tokens, both count ``stored_bytes``: what the requests stored (Responses
objects), which budgets do not limit (the response store's per-owner quota does).
``usage_budgets`` holds the per-key token limits ``budgets.py`` enforces.

Writes are batched: a few statements per batch, never one per row, because a region's router
may be a WAN round trip from the primary. The SQL is the subset SQLite (3.35+) and PostgreSQL
both speak: multi-row ``INSERT … ON CONFLICT … RETURNING`` and ``… DO UPDATE``.

Database errors are not caught here: the adapter turns an unreachable database into
``RegistryUnavailable``, and callers decide (the ledger spools, the budget guard uses what it
knew, the CLI prints the error).
"""

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from serve_app.usage.records import COLUMNS, UsageRecord

GROUPS = ("day", "month", "model", "region", "key_id")
COUNTERS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "total_tokens", "stored_bytes")

# Parameters per statement: SQLite builds before 3.32 allow 999, later ones 32766, psycopg
# 65535. 8000 keeps a 500-record batch (20 columns) in two statements, far from every limit.
MAX_PARAMS = 8000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage_records (
    id                TEXT PRIMARY KEY,  -- the router's record id: a replay is a no-op
    key_id            TEXT NOT NULL,
    owner             TEXT NOT NULL,
    region            TEXT NOT NULL,
    model             TEXT NOT NULL,
    route             TEXT NOT NULL,
    prompt_tokens     INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    cached_tokens     INTEGER NOT NULL,
    status            INTEGER NOT NULL,
    finish_reason     TEXT,
    started_at_ms     INTEGER NOT NULL,
    ended_at_ms       INTEGER NOT NULL,
    failover_origin   TEXT,
    day               TEXT NOT NULL,     -- UTC YYYY-MM-DD of started_at_ms
    stored_bytes      INTEGER NOT NULL DEFAULT 0,
    resumes           INTEGER NOT NULL DEFAULT 0,
    resume_prompt_tokens INTEGER NOT NULL DEFAULT 0,
    resumed_in        TEXT,
    continues         TEXT               -- a peer's part of another record's request: no request
);
CREATE INDEX IF NOT EXISTS usage_records_key_day ON usage_records (key_id, day);
CREATE TABLE IF NOT EXISTS usage_daily (
    key_id            TEXT NOT NULL,
    day               TEXT NOT NULL,
    model             TEXT NOT NULL,
    region            TEXT NOT NULL,
    owner             TEXT NOT NULL,
    requests          INTEGER NOT NULL,
    prompt_tokens     INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    cached_tokens     INTEGER NOT NULL,
    stored_bytes      INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (key_id, day, model, region)
);
-- An owner admin's report (every key of the owner) and an operator's (every key) read by day
-- range, not by key: without these they scanned every tenant's whole history.
CREATE INDEX IF NOT EXISTS usage_daily_owner_day ON usage_daily (owner, day);
CREATE INDEX IF NOT EXISTS usage_daily_day ON usage_daily (day);
CREATE TABLE IF NOT EXISTS usage_budgets (
    key_id            TEXT PRIMARY KEY,
    tokens_per_day    INTEGER,           -- NULL: no daily limit
    tokens_per_month  INTEGER,           -- NULL: no monthly limit
    updated_at        INTEGER NOT NULL
);
"""
# Columns added after the tables first shipped: existing tables get them on the next start.
_ADDED_COLUMNS = {
    "usage_records": {
        "stored_bytes": "INTEGER NOT NULL DEFAULT 0",
        "resumes": "INTEGER NOT NULL DEFAULT 0",
        "resume_prompt_tokens": "INTEGER NOT NULL DEFAULT 0",
        "resumed_in": "TEXT",
        "continues": "TEXT",
    },
    "usage_daily": {"stored_bytes": "INTEGER NOT NULL DEFAULT 0"},
}

_RECORD_COLUMNS = (*COLUMNS, "day")
_ROLLUP_KEY = ("key_id", "day", "model", "region")
_SUMMED = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "stored_bytes")
_ROLLUP_COLUMNS = (*_ROLLUP_KEY, "owner", *_SUMMED)
_GROUP_SQL = {"day": "day", "month": "substr(day, 1, 7)", "model": "model", "region": "region", "key_id": "key_id"}

T = TypeVar("T")


@dataclass(frozen=True)
class Budget:
    key_id: str
    tokens_per_day: int | None
    tokens_per_month: int | None
    updated_at: int


class UsageStore:
    """``database``: what ``serve_app.auth.database.open_database`` returns (the registry's)."""

    def __init__(self, database):
        self.database = database
        self.database.create_schema(_SCHEMA)
        self.database.add_columns(_ADDED_COLUMNS)

    # --- the ledger's writes ------------------------------------------------------------------
    def insert(self, records: Iterable[UsageRecord]) -> int:
        """Insert a batch in one transaction; return how many records were new.

        Only the rows the insert really added (``RETURNING id``) go into the rollup, so writing
        the same records again changes nothing. Rows are sorted (records by id, rollup rows by
        key) so two routers writing overlapping batches take row locks in the same order and
        cannot deadlock each other on PostgreSQL.
        """
        by_id = {r.id: r for r in records}
        if not by_id:
            return 0
        unique = sorted(by_id.values(), key=lambda r: r.id)
        with self.database.connect() as db:
            new: list[UsageRecord] = []
            for chunk in _chunks(unique, MAX_PARAMS // len(_RECORD_COLUMNS)):
                rows = db.execute(
                    f"INSERT INTO usage_records ({', '.join(_RECORD_COLUMNS)}) VALUES {_values(chunk, _RECORD_COLUMNS)}"
                    " ON CONFLICT (id) DO NOTHING RETURNING id",
                    tuple(value for r in chunk for value in (*(getattr(r, c) for c in COLUMNS), r.day)),
                ).fetchall()
                new.extend(by_id[row["id"]] for row in rows)
            rollup = _rollup(new)
            updates = ", ".join(f"{c} = usage_daily.{c} + excluded.{c}" for c in _SUMMED)
            for chunk in _chunks(rollup, MAX_PARAMS // len(_ROLLUP_COLUMNS)):
                db.execute(
                    f"INSERT INTO usage_daily ({', '.join(_ROLLUP_COLUMNS)}) VALUES {_values(chunk, _ROLLUP_COLUMNS)}"
                    f" ON CONFLICT ({', '.join(_ROLLUP_KEY)}) DO UPDATE SET {updates}",
                    tuple(value for row in chunk for value in row),
                )
        return len(new)

    # --- reads (reports, budgets): from the region's read replica when it has one ---------------
    def totals(
        self, *, key_id: str | None, since: str, until: str, group_by: tuple[str, ...], owner: str | None = None
    ) -> list[dict[str, Any]]:
        """Counters per group over the inclusive UTC days ``since``..``until``, ordered by the
        group columns. ``group_by``: a non-empty subset of ``GROUPS`` ("month" is YYYY-MM).
        ``key_id``, ``owner``: only that key's, only that owner's rows (the owner the request
        was billed to)."""
        unknown = [g for g in group_by if g not in GROUPS]
        if not group_by or unknown:
            raise ValueError(f"group_by must be a non-empty subset of {', '.join(GROUPS)}; got {list(group_by)}")
        groups = ", ".join(_GROUP_SQL[g] for g in group_by)
        selected = ", ".join(f"{_GROUP_SQL[g]} AS {g}" for g in group_by)
        sums = ", ".join(f"SUM({c}) AS {c}" for c in _SUMMED)
        where, params = "day >= ? AND day <= ?", (since, until)
        if key_id is not None:
            where, params = where + " AND key_id = ?", (*params, key_id)
        if owner is not None:
            where, params = where + " AND owner = ?", (*params, owner)
        with self.database.connect(read=True) as db:
            rows = db.execute(
                f"SELECT {selected}, {sums} FROM usage_daily WHERE {where} GROUP BY {groups} ORDER BY {groups}",
                params,
            ).fetchall()
        # int(): PostgreSQL's SUM of a BIGINT is a NUMERIC, which psycopg reads as a Decimal.
        result = []
        for row in rows:
            counters = {c: int(row[c]) for c in _SUMMED}
            counters["total_tokens"] = counters["prompt_tokens"] + counters["completion_tokens"]
            result.append({**{g: row[g] for g in group_by}, **counters})
        return result

    def spent(self, key_id: str, since_day: str) -> int:
        """Prompt + completion tokens ``key_id`` used from ``since_day`` (inclusive) on."""
        with self.database.connect(read=True) as db:
            row = db.execute(
                "SELECT COALESCE(SUM(prompt_tokens + completion_tokens), 0) AS spent FROM usage_daily"
                " WHERE key_id = ? AND day >= ?",
                (key_id, since_day),
            ).fetchone()
        return int(row["spent"])

    def budget_state(
        self, key_id: str, *, day: str, month_start: str, primary: bool = False
    ) -> tuple[Budget | None, int, int]:
        """``(budget, spent on day, spent since month_start)`` on one connection: what a budget
        check needs, for one connect (+ TLS) to the nearest replica (or the primary) instead of three.
        A key without a budget costs one indexed lookup and no spend query. ``primary``: read the
        primary even when a replica is named (right after this router wrote the key's records,
        which the replica may not have yet)."""
        with self.database.connect(read=not primary) as db:
            budget = _budget(db, key_id)
            if budget is None:
                return None, 0, 0
            # Up to ``day``: a row dated later (a router's clock ahead, a continuation a peer dated
            # across midnight) counts on its own day, not on today's and then on its own again.
            row = db.execute(
                "SELECT COALESCE(SUM(CASE WHEN day = ? THEN prompt_tokens + completion_tokens ELSE 0 END), 0)"
                " AS today, COALESCE(SUM(prompt_tokens + completion_tokens), 0) AS month"
                " FROM usage_daily WHERE key_id = ? AND day >= ? AND day <= ?",
                (day, key_id, month_start, day),
            ).fetchone()
        return budget, int(row["today"]), int(row["month"])

    # --- budgets (the CLI) ----------------------------------------------------------------------
    def set_budget(self, key_id: str, *, tokens_per_day: int | None, tokens_per_month: int | None) -> Budget:
        """Replace ``key_id``'s budget with exactly these limits (None: no limit for that period)."""
        if tokens_per_day is None and tokens_per_month is None:
            raise ValueError("a budget needs a daily or a monthly limit (clear_budget removes one)")
        if any(limit is not None and limit < 0 for limit in (tokens_per_day, tokens_per_month)):
            raise ValueError("token limits cannot be negative")
        budget = Budget(key_id, tokens_per_day, tokens_per_month, int(time.time()))
        with self.database.connect() as db:
            db.execute(
                "INSERT INTO usage_budgets VALUES (?, ?, ?, ?) ON CONFLICT (key_id) DO UPDATE SET"
                " tokens_per_day = excluded.tokens_per_day, tokens_per_month = excluded.tokens_per_month,"
                " updated_at = excluded.updated_at",
                (key_id, tokens_per_day, tokens_per_month, budget.updated_at),
            )
        return budget

    def budget(self, key_id: str) -> Budget | None:
        with self.database.connect(read=True) as db:
            return _budget(db, key_id)

    def clear_budget(self, key_id: str) -> bool:
        """Remove ``key_id``'s budget; True if it had one."""
        with self.database.connect() as db:
            return db.execute("DELETE FROM usage_budgets WHERE key_id = ?", (key_id,)).rowcount > 0


def _budget(db, key_id: str) -> Budget | None:
    row = db.execute("SELECT * FROM usage_budgets WHERE key_id = ?", (key_id,)).fetchone()
    if row is None:
        return None
    return Budget(row["key_id"], row["tokens_per_day"], row["tokens_per_month"], row["updated_at"])


def _rollup(records: Iterable[UsageRecord]) -> list[tuple]:
    """One row per rollup key: PostgreSQL refuses an upsert that touches one row twice."""
    rows: dict[tuple, list] = {}
    for r in records:
        row = rows.setdefault((r.key_id, r.day, r.model, r.region), [r.owner, 0, 0, 0, 0, 0])
        row[1] += int(r.continues is None)  # a peer's continuation: tokens of a request counted once
        row[2] += r.prompt_tokens
        row[3] += r.completion_tokens
        row[4] += r.cached_tokens
        row[5] += r.stored_bytes
    return [(*key, *row) for key, row in sorted(rows.items())]


def _values(rows: Sequence[Any], columns: Sequence[str]) -> str:
    one = f"({', '.join(['?'] * len(columns))})"
    return ", ".join([one] * len(rows))


def _chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]

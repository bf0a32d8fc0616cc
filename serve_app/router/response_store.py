"""Stored OpenAI Responses objects, in the key registry's database, so a follow-up with
``previous_response_id`` continues a conversation on whichever router replica it reaches, in this
region or, after a failover, in a peer: every region's routers use the one registry (PostgreSQL;
locally, the key store's SQLite file) and see the same rows. Reads and writes go to the primary,
so a response is readable, and a deletion seen, everywhere as soon as the call returns.

What keeps one owner's data its own (docs/threat-model.md, "Stored Responses"):
  * Ids are the server's. A Response's id is the engine's request id, which no client may set
    (``strict.Body`` refuses ``request_id``), and rows are only ever inserted: a put whose id is
    stored already changes nothing and raises ResponseIdTaken.
  * A row is read and deleted by (id, owner): another owner's id looks exactly like a missing one.
  * An owner's quota (rows and bytes) is kept by the owner's own puts, in the put's transaction:
    an owner past it loses its own oldest rows, never anyone else's.
  * Every transaction that changes an owner's rows (a put, a sweep's batch) first locks that
    owner's row in ``stored_response_owners`` and touches no other owner's rows. So one owner's
    puts, from any replica or region, count each other's rows, and no two transactions can wait
    on each other (a deadlock needs two owners' rows, or two orders, in one transaction).
  * The global bound (``max_responses``) is a backstop the sweep keeps: past it, rows are taken
    from the owners holding the most, oldest first, down to a common level (``fair_eviction``).
    An owner holding at most ``max_responses / owners`` rows never loses one to anyone's traffic.

The sweep (``start()`` / ``aclose()``, on the router's event loop) runs every SWEEP_INTERVAL_S:
expired rows first, then rows past the global bound, SWEEP_BATCH rows per transaction and at most
SWEEP_MAX_ROWS per run. One sweep runs at a time across every replica and region (a lease row in
``stored_response_sweeps``, renewed in each batch's transaction), so two routers never evict the
same excess twice. An expired row is
invisible at once, whenever the sweep deletes it; the table may exceed ``max_responses`` by the
puts of one interval (more if a run's SWEEP_MAX_ROWS left a backlog). Each database call runs on
the store's own threads, never on the event loop: reads on threads of their own, and one put per
owner at a time (``_owner_turn``), so one owner's puts never hold another owner's answer.
"""

import asyncio
import contextlib
import json
import random
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from serve_app.auth.database import RegistryUnavailable
from serve_app.config import MAX_STORED_RESPONSE_BYTES, ResponsesArgs
from serve_app.router.owner_share import OwnerShares
from serve_app.telemetry.logs import module_logger

logger = module_logger(__name__)

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS stored_responses (
    id           TEXT PRIMARY KEY,  -- the server's resp_ id: a row is never replaced
    owner        TEXT NOT NULL,     -- the API key's owner: the only one who reads it
    model        TEXT NOT NULL,
    created_at   INTEGER NOT NULL,  -- the Response's own field, returned as given
    stored_at_ms INTEGER NOT NULL,  -- the store's clock: retention and eviction order
    size         INTEGER NOT NULL,  -- UTF-8 bytes of response + conversation: the quota's unit
    response     TEXT NOT NULL,     -- JSON object
    conversation TEXT NOT NULL      -- JSON list of input items
);
CREATE INDEX IF NOT EXISTS stored_responses_by_owner ON stored_responses (owner, stored_at_ms, id, size);
CREATE INDEX IF NOT EXISTS stored_responses_by_age ON stored_responses (stored_at_ms);
CREATE TABLE IF NOT EXISTS stored_response_owners (
    owner        TEXT PRIMARY KEY,  -- locked by each transaction that changes this owner's rows
    locked_at_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS stored_response_sweeps (
    name         TEXT PRIMARY KEY,  -- one lease: the sweep that holds it runs, others skip
    started_ms   INTEGER NOT NULL
);
"""
_COLUMNS = ("id", "owner", "model", "created_at", "stored_at_ms", "size", "response", "conversation")


@dataclass(frozen=True)
class StoredResponse:
    id: str
    owner: str  # who may read it (the API key's owner)
    model: str
    created_at: int  # unix seconds
    response: dict  # the Response object as returned to the client
    conversation: list  # input items that produced it (full history, without instructions)


class ResponseIdTaken(Exception):
    """A put whose id is stored already (whoever's): nothing was stored, nothing replaced."""


@dataclass(frozen=True)
class Sweep:
    """What one sweep deleted."""

    expired: int = 0
    evicted: dict[str, int] = field(default_factory=dict)  # owner -> rows past the global bound


# Longest id a lookup sends to the database: the server's are ``resp_`` and 32 hex digits (a 2 MiB
# one, from a client, was a 2 MiB query parameter on the shared primary).
MAX_ID_CHARS = 128
LOOKUPS_PER_OWNER = 2  # of the 4 lookup threads (``__init__``)


def could_be_stored(response_id: str) -> bool:
    """Whether a client's id could name a stored row. Ids are the server's (``resp_`` and hex): one
    that is not ASCII, or has a NUL, was never stored, and PostgreSQL refuses to even look up a NUL
    or a lone surrogate (an error, not "not found"): such an id is missing, found without a query."""
    return len(response_id) <= MAX_ID_CHARS and response_id.isascii() and "\x00" not in response_id


def _of_models(models: frozenset[str] | None) -> tuple[str, tuple[str, ...]]:
    """The filter of a key restricted to some models (None: every model): it sees only responses
    of those, as it can call no other (it continued, read or deleted any of its owner's before)."""
    if models is None:
        return "", ()
    if not models:
        return " AND 1 = 0", ()
    return f" AND model IN ({', '.join('?' * len(models))})", tuple(sorted(models))


class ResponseStore:
    # Class attributes rather than arguments: they tune cost, not behaviour (tests override them).
    SWEEP_INTERVAL_S = 60.0
    SWEEP_BATCH = 500  # rows per delete statement (and transaction)
    SWEEP_MAX_ROWS = 20_000  # rows one sweep deletes at most; the rest wait for the next

    def __init__(self, database, args: ResponsesArgs, *, clock: Callable[[], float] = time.time):
        """``database``: the key registry's (``serve_app.auth.database.open_database``)."""
        self.database = database
        self.apply(args)
        self.max_bytes = MAX_STORED_RESPONSE_BYTES
        self._clock = clock
        # Our own few threads, not asyncio.to_thread's default pool: puts waiting on a busy
        # database would otherwise hold the threads that the authenticator's lookups need.
        # Lookups by id (a follow-up's history, GET, DELETE: one row, no owner lock) have threads
        # of their own, and each owner has one put at a time on the others (``_owner_turn``): an
        # owner's puts wait on its row lock in the database anyway, one after another, so a busy
        # owner (or its puts held by a slow primary, up to the 15 s statement timeout) fills no
        # thread that another owner's answer waits for.
        self._executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="response-store")
        self._lookups = ThreadPoolExecutor(max_workers=4, thread_name_prefix="response-store-lookup")
        self._owner_puts = OwnerShares(per_owner=1)
        # An owner's lookups: half of their threads at most (a tenant looping GET on its 4 MiB
        # rows, or a burst of its follow-ups, held all four, and every other owner's follow-up
        # waited behind them).
        self._owner_lookups = OwnerShares(per_owner=LOOKUPS_PER_OWNER)
        self._schema_lock = threading.Lock()
        self._schema_ready = False
        self._sweeper: asyncio.Task | None = None

    def apply(self, args: ResponsesArgs) -> None:
        """The retention and the bounds, from now on (the router was reconfigured): the next put
        and the next sweep keep to them."""
        self.retention_ms = round(args.retention_hours * 3_600_000)
        self.max_responses = args.max_responses
        self.max_rows_per_owner = args.max_responses_per_owner
        self.max_bytes_per_owner = int(args.max_mib_per_owner * 2**20)

    # --- the API ---------------------------------------------------------------------------
    async def put(self, stored: StoredResponse) -> int:
        """Store a finished response; return the bytes stored (its request's ``stored_bytes``).
        ValueError when its JSON is over ``max_bytes`` or not valid Unicode; ResponseIdTaken when
        its id is stored already. Either way nothing was stored or changed."""
        # The owner's one put at a time (``__init__``), on the store's threads.
        return await self._owner_puts.run(stored.owner, self._executor, self._with_schema, self._put,
                                          (stored, self._now_ms()))

    async def get(self, response_id: str, owner: str, models: frozenset[str] | None = None) -> StoredResponse | None:
        """None when missing, expired, another owner's or of a model ``models`` (the caller's key's,
        None: every one) leaves out: they look the same from outside, so nobody learns whether
        someone else's response id exists."""
        if not could_be_stored(response_id):
            return None
        return await self._run_lookup(owner, self._get, response_id, owner, self._now_ms(), models)

    async def response_text(self, response_id: str, owner: str, models: frozenset[str] | None = None) -> str | None:
        """The stored Response object's JSON as stored (what ``GET`` answers), None like get(): the
        response column alone, never decoded (a 4 MiB row's decode and re-encode held the lookup
        thread and the event loop ~0.2 s each)."""
        if not could_be_stored(response_id):
            return None
        return await self._run_lookup(owner, self._response_text, response_id, owner, self._now_ms(), models)

    async def exists(self, response_id: str, owner: str, models: frozenset[str] | None = None) -> bool:
        """Whether get() would find it, reading no column of it."""
        if not could_be_stored(response_id):
            return False
        return await self._run_lookup(owner, self._exists, response_id, owner, self._now_ms(), models)

    async def delete(self, response_id: str, owner: str, models: frozenset[str] | None = None) -> bool:
        """True if a row was deleted. False in exactly the cases where get() would return None."""
        if not could_be_stored(response_id):
            return False
        return await self._run_lookup(owner, self._delete, response_id, owner, self._now_ms(), models)

    async def history(self, response_id: str, owner: str,
                      models: frozenset[str] | None = None) -> tuple[list, int] | None:
        """The input a follow-up with ``previous_response_id`` continues from: the conversation,
        then the response's output items, and its size in bytes (what it adds to the request's
        price); None like get(). Decoded and measured on the store's threads: up to 4 MiB of
        JSON is no work for the router's event loop."""
        if not could_be_stored(response_id):
            return None
        return await self._run_lookup(owner, self._history, response_id, owner, self._now_ms(), models)

    async def footprint(self, owner: str) -> tuple[int, int]:
        """``(rows, bytes)`` the owner holds now (expired rows included until swept)."""
        return await self._run_lookup(owner, self._footprint, owner)

    # --- the sweep --------------------------------------------------------------------------
    def start(self) -> None:
        """Run the sweep now and every SWEEP_INTERVAL_S (called once, from the router's loop)."""
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever(), name="response-store-sweep")

    async def aclose(self) -> None:
        """Stop the sweep; calls already running on the store's threads finish on their own."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        self._executor.shutdown(wait=False)
        self._lookups.shutdown(wait=False)

    async def sweep(self) -> Sweep | None:
        """One run now; None when another router's run holds the lease."""
        return await self._run(self._sweep, self._now_ms())

    async def _sweep_forever(self) -> None:
        while True:
            try:
                swept = await self.sweep()
                if swept and (swept.expired or swept.evicted):
                    logger.info("response store sweep: %d expired, %d past the global bound deleted",
                                swept.expired, sum(swept.evicted.values()))
            except RegistryUnavailable as away:  # down or busy: the next run tries again
                logger.warning("response store sweep failed; retrying in %.0f s: %s", self.SWEEP_INTERVAL_S, away)
            except Exception:
                logger.exception("response store sweep failed; retrying in %.0f s", self.SWEEP_INTERVAL_S)
            # Jitter, so routers started together do not all ask for the lease at once.
            await asyncio.sleep(self.SWEEP_INTERVAL_S * random.uniform(0.9, 1.1))

    # --- blocking parts (the store's threads only) --------------------------------------------
    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._with_schema, fn, args)

    async def _run_lookup(self, owner: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the lookups' threads, within ``owner``'s share of them."""
        return await self._owner_lookups.run(owner, self._lookups, self._with_schema, fn, args)

    def _with_schema(self, fn: Callable[..., T], args: tuple) -> T:
        # On first use rather than in __init__, so building the router does no I/O; every
        # statement is idempotent, so routers racing here are harmless.
        with self._schema_lock:
            if not self._schema_ready:
                self.database.create_schema(_SCHEMA)
                self._schema_ready = True
        return fn(*args)

    def _put(self, stored: StoredResponse, now_ms: int) -> int:
        # Serialised here, not on the event loop: a 4 MiB dumps blocks for milliseconds.
        response, conversation = _compact(stored.response), _compact(stored.conversation)
        size = len(response.encode()) + len(conversation.encode())  # UnicodeEncodeError is a ValueError
        if size > self.max_bytes:
            raise ValueError(f"response {stored.id} is {size} bytes stored; the limit is {self.max_bytes}")
        row = (stored.id, stored.owner, stored.model, stored.created_at, now_ms, size, response, conversation)
        with self.database.connect() as db:
            _lock_owner(db, stored.owner, now_ms)
            inserted = db.execute(
                f"INSERT INTO stored_responses ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})"
                " ON CONFLICT (id) DO NOTHING",
                row,
            ).rowcount
            if inserted != 1:  # rolls the transaction back: not even the lock's time is written
                raise ResponseIdTaken(f"response id {stored.id} is stored already; it is never replaced")
            evicted = self._evict_over_quota(db, stored, size)
        if evicted:
            logger.info("response %s: its owner was over quota and lost its %d oldest", stored.id, evicted)
        return size

    def _evict_over_quota(self, db, stored: StoredResponse, size: int) -> int:
        """Delete the owner's oldest rows until it is within its quota with the row just stored.
        Its other rows are ranked newest first, and every row from the first that no longer fits
        goes: one statement, whatever the owner holds (a round trip counts when the primary is a
        WAN away)."""
        return db.execute(
            "DELETE FROM stored_responses WHERE id IN (SELECT id FROM ("
            " SELECT id, ROW_NUMBER() OVER newest AS rows_upto, SUM(size) OVER newest AS bytes_upto"
            " FROM stored_responses WHERE owner = ? AND id <> ?"
            " WINDOW newest AS (ORDER BY stored_at_ms DESC, id DESC ROWS UNBOUNDED PRECEDING)"
            ") AS ranked WHERE rows_upto > ? OR bytes_upto > ?)",
            (stored.owner, stored.id, self.max_rows_per_owner - 1, self.max_bytes_per_owner - size),
        ).rowcount

    def _select(self, columns: str, response_id: str, owner: str, now_ms: int, models: frozenset[str] | None):
        in_models, model_params = _of_models(models)
        with self.database.connect() as db:
            return db.execute(
                f"SELECT {columns} FROM stored_responses WHERE id = ? AND owner = ? AND stored_at_ms >= ?{in_models}",
                (response_id, owner, now_ms - self.retention_ms, *model_params),
            ).fetchone()

    def _get(self, response_id: str, owner: str, now_ms: int, models: frozenset[str] | None) -> StoredResponse | None:
        row = self._select("id, owner, model, created_at, response, conversation", response_id, owner, now_ms, models)
        if row is None:
            return None
        return StoredResponse(
            row["id"], row["owner"], row["model"], int(row["created_at"]),
            json.loads(row["response"]), json.loads(row["conversation"]),
        )

    def _response_text(self, response_id: str, owner: str, now_ms: int, models: frozenset[str] | None) -> str | None:
        row = self._select("response", response_id, owner, now_ms, models)
        return None if row is None else row["response"]

    def _exists(self, response_id: str, owner: str, now_ms: int, models: frozenset[str] | None) -> bool:
        return self._select("1 AS found", response_id, owner, now_ms, models) is not None

    def _history(self, response_id: str, owner: str, now_ms: int,
                 models: frozenset[str] | None) -> tuple[list, int] | None:
        stored = self._get(response_id, owner, now_ms, models)
        if stored is None:
            return None
        output = stored.response.get("output") or []
        history = stored.conversation + [_as_input(item) for item in output]
        # Its size as the request's own body is counted: UTF-8 bytes, not JSON's ``\uXXXX`` escapes
        # (6 bytes for a character of CJK text where the client's body spends 3).
        return history, len(_compact(history).encode())

    def _delete(self, response_id: str, owner: str, now_ms: int, models: frozenset[str] | None) -> bool:
        in_models, model_params = _of_models(models)
        with self.database.connect() as db:
            cursor = db.execute(
                f"DELETE FROM stored_responses WHERE id = ? AND owner = ? AND stored_at_ms >= ?{in_models}",
                (response_id, owner, now_ms - self.retention_ms, *model_params),
            )
        return cursor.rowcount > 0

    def _footprint(self, owner: str) -> tuple[int, int]:
        with self.database.connect() as db:
            held = db.execute(
                "SELECT COUNT(*) AS n, COALESCE(SUM(size), 0) AS bytes FROM stored_responses WHERE owner = ?", (owner,)
            ).fetchone()
        return int(held["n"]), int(held["bytes"])

    def _sweep(self, now_ms: int) -> Sweep | None:
        if not self._claim_sweep(now_ms):
            return None
        lease = _Lease(now_ms)
        budget, cutoff = self.SWEEP_MAX_ROWS, now_ms - self.retention_ms
        expired = 0
        for owner in sorted(self._counts(before_ms=cutoff)):
            if expired >= budget or lease.lost:
                break
            expired += self._delete_oldest(owner, budget - expired, now_ms, lease, before_ms=cutoff)
        evicted: dict[str, int] = {}
        counts = self._counts() if expired < budget and not lease.lost else {}
        excess = min(sum(counts.values()) - self.max_responses, budget - expired)
        for owner, rows in sorted(fair_eviction(counts, excess).items()):
            if lease.lost:
                break
            evicted[owner] = self._delete_oldest(owner, rows, now_ms, lease)
        return Sweep(expired, evicted)

    def _claim_sweep(self, now_ms: int) -> bool:
        """The lease: a run may start when the last one renewed it over half an interval ago."""
        with self.database.connect() as db:
            return db.execute(
                "INSERT INTO stored_response_sweeps (name, started_ms) VALUES ('sweep', ?)"
                " ON CONFLICT (name) DO UPDATE SET started_ms = excluded.started_ms"
                " WHERE stored_response_sweeps.started_ms <= ?",
                (now_ms, now_ms - int(self.SWEEP_INTERVAL_S * 500)),
            ).rowcount == 1

    def _counts(self, before_ms: int | None = None) -> dict[str, int]:
        """Rows per owner (stored before ``before_ms``, if given)."""
        where, params = ("WHERE stored_at_ms < ?", (before_ms,)) if before_ms is not None else ("", ())
        with self.database.connect() as db:
            rows = db.execute(f"SELECT owner, COUNT(*) AS n FROM stored_responses {where} GROUP BY owner", params)
            return {row["owner"]: int(row["n"]) for row in rows.fetchall()}

    def _delete_oldest(self, owner: str, limit: int, now_ms: int, lease: "_Lease", *,
                       before_ms: int | None = None) -> int:
        """Delete up to ``limit`` of the owner's oldest rows (stored before ``before_ms``, if
        given), SWEEP_BATCH per transaction, each under the owner's lock and with the sweep's lease
        renewed in it: a run longer than half an interval (a hundred owners a WAN away, one owner's
        40 batches) would otherwise be joined by a second, which sized its evictions on counts the
        first was still lowering — an owner within its share lost rows. A run whose lease another
        took (it stalled past half an interval) deletes nothing more."""
        age, params = (" AND stored_at_ms < ?", (before_ms,)) if before_ms is not None else ("", ())
        deleted = 0
        while deleted < limit:
            batch = min(self.SWEEP_BATCH, limit - deleted)
            renewed = max(self._now_ms(), lease.stamp + 1)
            with self.database.connect() as db:
                renew = "UPDATE stored_response_sweeps SET started_ms = ? WHERE name = 'sweep' AND started_ms = ?"
                if db.execute(renew, (renewed, lease.stamp)).rowcount != 1:
                    lease.lost = True
                    logger.warning("response store sweep: another router took the lease; this run stops")
                    break
                _lock_owner(db, owner, now_ms)
                done = db.execute(
                    "DELETE FROM stored_responses WHERE id IN (SELECT id FROM stored_responses"
                    f" WHERE owner = ?{age} ORDER BY stored_at_ms, id LIMIT ?)",
                    (owner, *params, batch),
                ).rowcount
            lease.stamp = renewed  # committed with the batch
            deleted += done
            if done < batch:
                break
        return deleted


@dataclass
class _Lease:
    """The sweep lease a run holds: the stamp it last wrote, and whether another run took it."""

    stamp: int
    lost: bool = False


def fair_eviction(counts: Mapping[str, int], excess: int) -> dict[str, int]:
    """How many rows each owner loses so that ``excess`` rows go: taken from the owners holding the
    most, down to a common level (max-min fairness), so one owner's traffic evicts its own rows
    first. The level is at least ``(total - excess) / owners``: an owner holding no more than its
    share of what stays loses nothing. Ties (who keeps the odd row) go by owner name."""
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    excess = min(excess, sum(counts.values()))
    if excess <= 0:
        return {}
    held = 0
    for top, (_, rows) in enumerate(ranked, start=1):
        held += rows
        following = ranked[top][1] if top < len(ranked) else 0
        if held - top * following >= excess:  # levelling the top owners to the next one frees enough
            break
    level, odd = divmod(held - excess, top)
    losses = {owner: rows - level - (1 if rank < odd else 0) for rank, (owner, rows) in enumerate(ranked[:top])}
    return {owner: lost for owner, lost in losses.items() if lost > 0}


def _lock_owner(db, owner: str, now_ms: int) -> None:
    """Lock the owner's row until the transaction ends (SQLite: the write lock is the file's)."""
    db.execute(
        "INSERT INTO stored_response_owners (owner, locked_at_ms) VALUES (?, ?)"
        " ON CONFLICT (owner) DO UPDATE SET locked_at_ms = excluded.locked_at_ms",
        (owner, now_ms),
    )


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _as_input(value: Any) -> Any:
    """An output item as the next turn's input: minus keys whose value is None, at any depth (vLLM
    writes nulls in its output, ``"status": null``, ``"logprobs": null``, that its own input parser
    may reject), and minus an ``output_text`` part's per-token ``logprobs``: the engine never renders
    them into the prompt, yet as history they were priced as prompt — a 300-token answer with
    ``top_logprobs: 20`` stores ~550 KB of them, which priced its follow-up at ~137,000 tokens."""
    if isinstance(value, dict):
        dropped = "logprobs" if value.get("type") == "output_text" else None
        return {k: _as_input(v) for k, v in value.items() if v is not None and k != dropped}
    if isinstance(value, list):
        return [_as_input(v) for v in value]
    return value

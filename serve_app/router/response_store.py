"""Stored OpenAI Responses objects, so a follow-up with ``previous_response_id`` can continue a
conversation on whichever router replica of the region it reaches.

One SQLite file is shared by every replica, and by every process that opens it (in production it
sits on the region's ReadWriteMany volume next to the key store). WAL lets readers run while one
writer commits. WAL relies on shared memory, so every process that opens the file must run on the
same host, which holds while the routers all run in the head pod. Two pods on different nodes
(for example during a rolling restart) must not open it at the same time. The interface is small
and has no SQL in it, so the Postgres-backed registry can replace this class later.

Bounds:
  * A row can be seen for ``retention_s`` seconds after it was stored. The store's own clock sets
    that time, not ``created_at``, so a wrong ``created_at`` from a caller cannot make a row
    immortal or dead on arrival.
  * Each put's JSON (response + conversation) is at most ``max_bytes`` (default 4 MiB), or the put
    raises ValueError.
  * Expired rows, and the oldest rows beyond ``max_responses``, are deleted by a purge. Each
    instance runs one after a put at most every ``PURGE_INTERVAL_S`` seconds, and always after
    ``PURGE_EVERY_PUTS`` puts, so the table holds at most
    ``max_responses + P * (PURGE_EVERY_PUTS - 1)`` rows, where P is the number of writing
    instances. At worst the disk use is that many rows times ``max_bytes``, and the file never
    shrinks (SQLite reuses freed pages), so size ``max_responses`` for the volume.
"""

import asyncio
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from serve_app.telemetry.logs import module_logger

logger = module_logger(__name__)

T = TypeVar("T")

DEFAULT_MAX_BYTES = 4 * 1024 * 1024

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id           TEXT PRIMARY KEY,
    owner        TEXT NOT NULL,
    model        TEXT NOT NULL,
    created_at   INTEGER NOT NULL,  -- the Response's own field, returned as given
    stored_at    REAL NOT NULL,     -- the store's clock: retention and eviction order
    response     TEXT NOT NULL,     -- JSON object
    conversation TEXT NOT NULL      -- JSON list of input items
);
CREATE INDEX IF NOT EXISTS responses_stored_at ON responses (stored_at);
"""


@dataclass(frozen=True)
class StoredResponse:
    id: str
    owner: str  # who may read it (the API key's owner)
    model: str
    created_at: int  # unix seconds
    response: dict  # the Response object as returned to the client
    conversation: list  # input items that produced it (full history, without instructions)


class ResponseStore:
    # Class attributes rather than arguments: they tune cost, not behaviour (tests override them).
    PURGE_INTERVAL_S = 60.0
    PURGE_EVERY_PUTS = 100

    def __init__(
        self,
        path: Path | str,
        *,
        retention_s: float,
        max_responses: int,
        max_bytes: int = DEFAULT_MAX_BYTES,
        clock: Callable[[], float] = time.time,
    ):
        if retention_s <= 0 or max_responses < 1 or max_bytes < 1:
            raise ValueError("retention_s, max_responses and max_bytes must be positive")
        self.path = Path(path)
        self.retention_s, self.max_responses, self.max_bytes = retention_s, max_responses, max_bytes
        self._clock = clock
        # Our own few threads, not asyncio.to_thread's default pool. SQLite runs one writer at a
        # time, and puts waiting out the busy timeout would otherwise hold the threads that the
        # authenticator's to_thread calls need.
        self._executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="response-store")
        self._schema_lock = threading.Lock()
        self._schema_ready = False
        self._puts_since_purge = 0
        self._next_purge = 0.0  # the first put purges whatever an earlier process left behind

    # --- the API ---------------------------------------------------------------------------
    async def put(self, stored: StoredResponse) -> None:
        """Store (or replace: ids are server-generated ``resp_<uuid>``, unique) a response.
        ValueError when its JSON exceeds ``max_bytes``: the caller logs and does not store it."""
        now = self._clock()
        self._puts_since_purge += 1
        purge = self._puts_since_purge >= self.PURGE_EVERY_PUTS or now >= self._next_purge
        if purge:
            # The schedule moves forward before the purge runs, so concurrent puts do not all
            # purge at once. If the purge fails, it runs again after the next put.
            self._puts_since_purge, self._next_purge = 0, now + self.PURGE_INTERVAL_S
        try:
            await self._run(self._put, stored, now)
        finally:  # a refused (too large) put still runs the purge that was due
            if purge:
                try:
                    await self._run(self._purge, now)
                except sqlite3.Error:
                    logger.warning("response store purge failed; retrying on the next put", exc_info=True)
                    self._next_purge = 0.0

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """None when missing, expired or another owner's: the three look the same from outside, so
        nobody learns whether someone else's response id exists."""
        return await self._run(self._get, response_id, owner, self._clock())

    async def delete(self, response_id: str, owner: str) -> bool:
        """True if a row was deleted. False in exactly the cases where get() would return None."""
        return await self._run(self._delete, response_id, owner, self._clock())

    async def history(self, response_id: str, owner: str) -> list | None:
        """The input a follow-up with ``previous_response_id`` continues from: the conversation,
        then the response's output items; None like get()."""
        return await self._run(self._history, response_id, owner, self._clock())

    # --- blocking parts (executor threads only) ----------------------------------------------
    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        # One connection per operation, like the key store (serve_app/auth/keys.py), so it stays
        # correct across threads and processes. timeout= is SQLite's busy timeout. mode=rw never
        # creates a file, so it cannot get the default (world-readable) mode: _ensure_schema does.
        self._ensure_schema()
        db = self._open()
        try:
            with db:
                yield db
        finally:
            db.close()

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=rw", uri=True, timeout=5)
        # NORMAL is safe with WAL: a power cut can drop the last commits but never corrupts the
        # file. Without journal_size_limit, the WAL keeps its largest size (several 4 MiB rows).
        db.execute("PRAGMA synchronous = NORMAL")
        db.execute("PRAGMA journal_size_limit = 67108864")
        return db

    def _ensure_schema(self) -> None:
        # On first use rather than in __init__, so building the router deployment does no I/O.
        # Every statement is idempotent, so processes racing here on a new file are harmless.
        with self._schema_lock:
            if self._schema_ready:
                return
            # Conversations are user content: owner-only, like the key store.
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.path.touch(mode=0o600, exist_ok=True)
            db = self._open()
            try:
                db.execute("PRAGMA journal_mode = WAL")  # persistent: stored in the file
                db.executescript(_SCHEMA)
            finally:
                db.close()
            self._schema_ready = True

    def _put(self, stored: StoredResponse, now: float) -> None:
        # Serialised here, not on the event loop: a 4 MiB dumps blocks for milliseconds.
        response = json.dumps(stored.response, ensure_ascii=False, separators=(",", ":"))
        conversation = json.dumps(stored.conversation, ensure_ascii=False, separators=(",", ":"))
        size = len(response.encode()) + len(conversation.encode())
        if size > self.max_bytes:
            raise ValueError(f"response {stored.id} is {size} bytes stored; the limit is {self.max_bytes}")
        with self._connect() as db:
            db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)",
                (stored.id, stored.owner, stored.model, stored.created_at, now, response, conversation),
            )

    def _purge(self, now: float) -> None:
        # Two single-statement writes: each takes the write lock at its start, so it waits for the
        # busy timeout. A read followed by a write could fail with SQLITE_BUSY at once under WAL.
        with self._connect() as db:
            db.execute("DELETE FROM responses WHERE stored_at < ?", (now - self.retention_s,))
            db.execute(
                "DELETE FROM responses WHERE rowid IN (SELECT rowid FROM responses"
                " ORDER BY stored_at DESC, rowid DESC LIMIT -1 OFFSET ?)",
                (self.max_responses,),
            )

    def _get(self, response_id: str, owner: str, now: float) -> StoredResponse | None:
        with self._connect() as db:
            row = db.execute(
                "SELECT id, owner, model, created_at, response, conversation FROM responses"
                " WHERE id = ? AND owner = ? AND stored_at >= ?",
                (response_id, owner, now - self.retention_s),
            ).fetchone()
        if row is None:
            return None
        return StoredResponse(row[0], row[1], row[2], row[3], json.loads(row[4]), json.loads(row[5]))

    def _delete(self, response_id: str, owner: str, now: float) -> bool:
        with self._connect() as db:
            cursor = db.execute(
                "DELETE FROM responses WHERE id = ? AND owner = ? AND stored_at >= ?",
                (response_id, owner, now - self.retention_s),
            )
        return cursor.rowcount > 0

    def _history(self, response_id: str, owner: str, now: float) -> list | None:
        stored = self._get(response_id, owner, now)
        if stored is None:
            return None
        output = stored.response.get("output") or []
        return stored.conversation + [_without_nulls(item) for item in output]


def _without_nulls(value: Any) -> Any:
    """Output items as stored, minus keys whose value is None, at any depth. vLLM writes nulls in
    its output (``"status": null``, ``"logprobs": null``) that its own input parser may reject."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value

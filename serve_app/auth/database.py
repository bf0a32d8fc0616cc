"""Where the key registry lives: a SQLite file (the embedded default) or PostgreSQL (regions).

One small adapter so ``KeyStore`` and ``UsageStore`` are written once: both give each operation
a connection (SQLite: the thread's own, kept; PostgreSQL: a new one) in a transaction, whose
``execute(sql, params)`` takes ``?`` placeholders and returns rows readable by column name.
``connect(read=True)`` is for a read that may be a little stale: PostgreSQL sends it to the
region's nearest read replica when one is named (key lookups, revocation checks, reports, budget
spend), every write goes to the primary. The SQL the store runs is the subset both speak
(``INSERT … ON CONFLICT … DO UPDATE``, ``COALESCE``); only the DDL differs (``BLOB`` / ``BYTEA``,
``INTEGER`` / ``BIGINT``).
A column a release adds to an existing table comes through ``add_columns``.

PostgreSQL is reached with psycopg 3, synchronously: every call already runs off the event loop
(the authenticator's cache answers in the loop; a miss retries the whole check in a thread), and
the CLI is synchronous. Each operation has a connection of its own for its transaction; one that
ended cleanly is kept for the next (``_KeptConnections``): a router writes its ledger every second
and a stored response on every Responses call, and a new connection costs a backend process on
the server and, to a managed primary, a TLS handshake and several round trips. A connection that
cannot be made fails at once (``RegistryUnavailable``), as before: nothing waits for a pool.
"""

import re
import select
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from serve_app.telemetry.logs import module_logger

logger = module_logger(__name__)

# A DSN names PostgreSQL; anything else is a SQLite file path.
# A PostgreSQL DSN: a URL, or libpq's keywords ("host=db user=app ..."), which were taken for a
# SQLite path until 2026-12-07, and the path's "does not exist" error showed the password.
_DSN = re.compile(r"^(postgres(ql)?://|\s*[A-Za-z_]+\s*=)")


class RegistryUnavailable(Exception):
    """The registry could not be reached or used (down, unreachable, locked): the caller answers
    503 with Retry-After, not 500; the cause stays in the log, never in a response."""


class Connection(Protocol):
    def execute(self, sql: str, params: tuple[Any, ...] = ()) -> Any: ...


class _Kept(threading.local):
    """One thread's kept connection (``SqliteDatabase._connection``), the file it opened, and how
    many of its operations are under way (a nested one gets a connection of its own)."""

    connection: sqlite3.Connection | None = None
    file: tuple[int, int] | None = None
    depth = 0


class SqliteDatabase:
    kind = "sqlite"

    def __init__(self, path: Path | str, *, create: bool):
        self.path = Path(path)
        if not self.path.exists():
            if not create:
                raise FileNotFoundError(
                    f"API key store {self.path} does not exist; create it with "
                    "`serve-app keys create` (see docs/auth.md)"
                )
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.path.touch(mode=0o600)
        self._kept = _Kept()

    def describe(self) -> str:
        return str(self.path)

    @contextmanager
    def connect(self, read: bool = False) -> Iterator[sqlite3.Connection]:
        # One file: reads and writes alike, each operation a transaction on this thread's
        # connection; one nested in another gets its own, whose commit is not the outer one's.
        nested = self._kept.depth > 0
        db = self._open() if nested else self._connection()
        self._kept.depth += 1
        try:
            with db:
                yield db
        except sqlite3.OperationalError as err:  # "database is locked" past the 5 s busy timeout
            raise RegistryUnavailable(f"key store {self.path}: {err}") from err
        finally:
            self._kept.depth -= 1
            if nested:
                db.close()
            elif db.in_transaction:  # neither its commit nor its rollback went through: not kept
                self._forget()

    def _connection(self) -> sqlite3.Connection:
        """This thread's connection, opened on first use and kept: opening one (and parsing the
        schema again) cost more CPU than the usage ledger's insert it was opened for, once a
        second in a busy router (docs/benchmarks.md, "The local key store's connection"). Opened
        again when the path no longer names the file it opened (deleted, or replaced by a
        restore): a kept connection would go on writing into the old one."""
        try:
            stat = self.path.stat()
        except OSError as err:
            self._forget()
            raise RegistryUnavailable(f"cannot open the key store {self.path}: {err}") from err
        file = (stat.st_dev, stat.st_ino)
        if self._kept.file != file:
            self._forget()
            self._kept.connection, self._kept.file = self._open(), file
        return self._kept.connection

    def _open(self) -> sqlite3.Connection:
        # mode=rw never creates a file by accident. The rollback journal stays (no write-ahead
        # log): the store remains the one file an operator copies or restores; a -wal file left
        # beside a restored copy would be replayed into it.
        try:
            db = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=rw", uri=True, timeout=5)
        except sqlite3.OperationalError as err:
            raise RegistryUnavailable(f"cannot open the key store {self.path}: {err}") from err
        db.row_factory = sqlite3.Row
        return db

    def _forget(self) -> None:
        """Close this thread's kept connection, if any."""
        if self._kept.connection is not None:
            self._kept.connection.close()
        self._kept.connection = self._kept.file = None

    def create_schema(self, ddl: str) -> None:
        with self.connect() as db:
            db.executescript(ddl)

    def add_columns(self, columns: Mapping[str, Mapping[str, str]]) -> None:
        """``{table: {column: declaration}}``: the columns a newer release added to a table that
        ``CREATE TABLE IF NOT EXISTS`` left as an older release made it. SQLite has no
        ``ADD COLUMN IF NOT EXISTS``: the write lock is taken first (``BEGIN IMMEDIATE``), so two
        processes upgrading one file cannot both add a column."""
        with self.connect() as db:
            db.execute("BEGIN IMMEDIATE")
            for table, wanted in columns.items():
                present = {row["name"] for row in db.execute(f"PRAGMA table_info({table})")}
                for name, declaration in wanted.items():
                    if name not in present:
                        db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {declaration}")


@dataclass
class _Opened:
    """A PostgreSQL connection and when it was opened."""

    connection: Any
    born: float = field(default_factory=time.monotonic)


class _KeptConnections:
    """PostgreSQL connections whose operation ended cleanly, kept for the next one: the most recent
    first (a quiet spell lets the others age out), at most ``MAX_KEPT``. One is handed out again
    only while it is still good: not closed, in no transaction, used within ``MAX_IDLE_S`` (below
    the idle timeouts of the load balancers and poolers in front of managed servers, and a multiple
    of the ledger's one-second flush), opened within ``MAX_AGE_S`` (so a busy router follows a
    primary's or replica's endpoint to a new address within minutes), and with nothing to read on
    its socket — a server that restarted or ended the session has sent a FIN or a FATAL notice,
    which makes it readable (a silent network loss is TCP keepalive's, as for any connection). One
    the server ends in the instant between that check and the operation's first statement fails
    the operation (``RegistryUnavailable``), as a server restart mid-operation does."""

    MAX_KEPT = 4
    MAX_IDLE_S = 60.0
    MAX_AGE_S = 600.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: list[tuple[float, _Opened]] = []  # (when it was given back, the connection)

    def take(self) -> _Opened | None:
        """A kept connection that is still good, or None."""
        while True:
            with self._lock:
                if not self._kept:
                    return None
                given_back, opened = self._kept.pop()
            now = time.monotonic()
            if (now - given_back < self.MAX_IDLE_S and now - opened.born < self.MAX_AGE_S
                    and not opened.connection.closed and not _readable(opened.connection)):
                return opened
            opened.connection.close()

    def give_back(self, opened: _Opened) -> None:
        from psycopg.pq import TransactionStatus

        connection = opened.connection
        if not connection.closed and connection.info.transaction_status == TransactionStatus.IDLE:
            with self._lock:
                if len(self._kept) < self.MAX_KEPT:
                    self._kept.append((time.monotonic(), opened))
                    return
        connection.close()

    def close(self) -> None:
        with self._lock:
            kept, self._kept = self._kept, []
        for _, opened in kept:
            opened.connection.close()

    __del__ = close


def _readable(connection) -> bool:
    """Whether the server sent something to an idle connection: a FIN, or a notice it ends on.
    poll, not select: a router's sockets may number past select's 1,024."""
    import psycopg

    try:
        poller = select.poll()
        poller.register(connection.fileno(), select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError, psycopg.Error):  # psycopg: no socket left
        return True


class _PostgresConnection:
    """psycopg's connection with the store's ``?`` placeholders (psycopg's are ``%s``)."""

    def __init__(self, connection):
        self._connection = connection

    def execute(self, sql: str, params: tuple[Any, ...] = ()):
        return self._connection.execute(sql.replace("?", "%s"), params)


_SECRET_PARAMS = ("password", "sslpassword")  # libpq's keywords that carry a secret


class PostgresDatabase:
    kind = "postgres"
    CONNECT_TIMEOUT_S = 5
    # No statement may hold a router's worker thread (a usage batch, a key lookup) for longer: a
    # server that stopped answering mid-query becomes RegistryUnavailable, and the ledger spools.
    STATEMENT_TIMEOUT_MS = 15_000

    # A read replica that could not be reached is not asked again for this long: its reads go to
    # the primary meanwhile (a replica a WAN link away, or failing over, would otherwise cost every
    # key lookup its 5 s connect timeout, then a 503 — while /health still says the region serves).
    REPLICA_AWAY_S = 30.0

    def __init__(self, dsn: str, replica: str | None = None):
        """``dsn``: the primary; ``replica``: the region's nearest read replica, if any."""
        self.dsn, self.replica = dsn, replica
        self._kept = {dsn: _KeptConnections()} | ({replica: _KeptConnections()} if replica else {})
        self._replica_away_until = 0.0

    def describe(self, dsn: str | None = None) -> str:
        """A DSN without its secrets (for logs and errors): read as libpq reads it, whatever its
        form (a URL's user info or query, keywords, quoting), its password and the client key's
        passphrase masked, written back as keywords. One libpq cannot read is not shown at all."""
        from psycopg.conninfo import conninfo_to_dict, make_conninfo

        try:
            parts = conninfo_to_dict(dsn or self.dsn)
        except Exception:
            return "(a DSN libpq cannot read)"
        return make_conninfo(**(parts | {name: "***" for name in _SECRET_PARAMS if name in parts}))

    @contextmanager
    def connect(self, read: bool = False) -> Iterator[_PostgresConnection]:
        import psycopg

        dsn = self.replica if read and self.replica and time.monotonic() >= self._replica_away_until else self.dsn
        opened = self._kept[dsn].take()
        if opened is None:
            try:
                opened = self._open(dsn)
            except RegistryUnavailable as away:
                if dsn != self.replica:
                    raise
                self._replica_away_until = time.monotonic() + self.REPLICA_AWAY_S
                logger.warning("%s; reading from the primary for %.0f s", away, self.REPLICA_AWAY_S)
                dsn = self.dsn
                opened = self._kept[dsn].take() or self._open(dsn)
        kept = self._kept[dsn]
        db = opened.connection
        try:
            yield _PostgresConnection(db)
            db.commit()
        except psycopg.OperationalError as err:  # the server went away mid-query, or timed it out
            db.close()
            # A kept connection to a replica that vanished, or one that answers no statement
            # within the timeout (a replayed lock, a stalled disk): the next reads go to the
            # primary. A long report cancelled there counts too: rare with its indexes, and a
            # replica that cannot answer a point read in 15 s is one key lookups must leave.
            if dsn == self.replica:
                self._replica_away_until = time.monotonic() + self.REPLICA_AWAY_S
            raise RegistryUnavailable(f"key registry at {self.describe(dsn)}: {err}") from err
        except BaseException:
            try:
                db.rollback()
            except psycopg.Error:
                db.close()
            raise
        finally:
            kept.give_back(opened)  # kept if it ended cleanly and is idle, else closed

    def _open(self, dsn: str) -> "_Opened":
        import psycopg
        from psycopg.rows import dict_row

        try:
            return _Opened(psycopg.connect(
                dsn, row_factory=dict_row, connect_timeout=self.CONNECT_TIMEOUT_S,
                options=f"-c statement_timeout={self.STATEMENT_TIMEOUT_MS}",
                # A server that vanished (no FIN, no RST) is found by TCP keepalive while the
                # connection waits or is kept, not the kernel's two hours, and a statement sent
                # to it fails once unacknowledged for the statement's own bound, not after ~15
                # minutes of retransmits: statement_timeout is the server's, and it is gone.
                keepalives=1, keepalives_idle=10, keepalives_interval=5, keepalives_count=3,
                tcp_user_timeout=self.STATEMENT_TIMEOUT_MS,
                # Never prepared on the server: a kept connection's prepared `SELECT *` would
                # fail once a release adds a column, and PgBouncer's transaction mode has none.
                prepare_threshold=None,
            ))
        except psycopg.OperationalError as err:
            raise RegistryUnavailable(f"cannot reach the key registry at {self.describe(dsn)}: {err}") from err
        except psycopg.ProgrammingError:  # libpq cannot read the DSN: its message quotes the DSN, password and all
            raise RegistryUnavailable(f"the key registry's DSN cannot be read: {self.describe(dsn)}") from None

    def create_schema(self, ddl: str) -> None:
        with self.connect() as db:
            # One statement per execute (the extended protocol takes one at a time); an advisory
            # lock so routers of several regions starting at once do not race on CREATE TABLE.
            db.execute("SELECT pg_advisory_xact_lock(7307)")
            for statement in filter(None, (part.strip() for part in _without_comments(_types(ddl)).split(";"))):
                if (index := _CREATE_INDEX.match(statement)) is not None:
                    # CREATE INDEX IF NOT EXISTS takes a SHARE lock on the table even when the
                    # index exists, held to this transaction's end: every router start queued the
                    # ledger's writes behind it. An index a release adds is built once, on a table
                    # that may be large: without the statement bound, which would fail the start
                    # (the ledger's writes wait meanwhile, and spool past their own bound).
                    if db.execute("SELECT to_regclass(?) AS found", (index.group(1),)).fetchone()["found"]:
                        continue
                    db.execute("SET LOCAL statement_timeout = 0")
                    logger.warning("key registry: building index %s (once, for this release)", index.group(1))
                db.execute(statement)

    def add_columns(self, columns: Mapping[str, Mapping[str, str]]) -> None:
        """As ``SqliteDatabase.add_columns``. The catalog is read first: ``ALTER TABLE`` takes an
        exclusive lock on the table even when the column exists, and every router start would
        otherwise queue the ledger's writes behind it."""
        with self.connect() as db:
            db.execute("SELECT pg_advisory_xact_lock(7307)")
            for table, wanted in columns.items():
                present = {
                    row["column_name"]
                    for row in db.execute(
                        "SELECT column_name FROM information_schema.columns"
                        " WHERE table_schema = current_schema() AND table_name = ?",
                        (table,),
                    )
                }
                for name, declaration in wanted.items():
                    if name not in present:
                        db.execute(_types(f"ALTER TABLE {table} ADD COLUMN {name} {declaration}"))


def _types(ddl: str) -> str:
    """SQLite's column types as PostgreSQL spells them."""
    return ddl.replace(" BLOB ", " BYTEA ").replace(" INTEGER", " BIGINT")


def _without_comments(ddl: str) -> str:
    return "\n".join(line.split("--", 1)[0] for line in ddl.splitlines())


_CREATE_INDEX = re.compile(r"^CREATE INDEX IF NOT EXISTS (\w+) ON ", re.IGNORECASE)


def is_dsn(location: str | Path) -> bool:
    """Whether ``location`` names PostgreSQL (a DSN) rather than a SQLite file."""
    return isinstance(location, str) and _DSN.match(location) is not None


def open_database(
    location: str | Path, *, create: bool = False, replica: str | None = None
) -> SqliteDatabase | PostgresDatabase:
    """A ``postgresql://`` DSN (``replica``: its read replica's), or a SQLite path (``create``:
    make the file if it is missing)."""
    if is_dsn(location):
        return PostgresDatabase(location, replica)
    return SqliteDatabase(location, create=create)

"""PostgreSQL connections kept between operations (``serve_app/auth/database.py``,
``_KeptConnections``), on a real server: the next operation reuses the last one's connection,
never one the server has ended, one still inside a transaction or one idle too long; an operation
that fails leaves nothing half-done on the connection it gives back; and an unreachable server
still fails with the connect's own error."""

import os
import threading
import time

import pytest

from serve_app.auth.database import PostgresDatabase, RegistryUnavailable


def backend(database: PostgresDatabase) -> int:
    with database.connect() as db:
        return db.execute("SELECT pg_backend_pid() AS pid").fetchone()["pid"]


@pytest.fixture
def database(fresh_database):
    database = PostgresDatabase(fresh_database)
    with database.connect() as db:
        db.execute("CREATE TABLE t (n INTEGER)")
    return database


def test_the_next_operation_reuses_the_last_ones_connection(database):
    assert backend(database) == backend(database) == backend(database)


def test_a_connection_the_server_ended_is_never_handed_out(database, fresh_database):
    first = backend(database)
    other = PostgresDatabase(fresh_database)
    with other.connect() as db:
        assert db.execute("SELECT pg_terminate_backend(?) AS ok", (first,)).fetchone()["ok"]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # the kept connection's socket has the server's FATAL and FIN
        with other.connect() as db:
            if not db.execute("SELECT 1 FROM pg_stat_activity WHERE pid = ?", (first,)).fetchall():
                break
    assert backend(database) != first  # a new connection, and no error for the operation


def test_a_failed_operation_leaves_nothing_half_done_and_its_connection_serves_the_next(database):
    before = backend(database)
    with pytest.raises(ZeroDivisionError):
        with database.connect() as db:
            db.execute("INSERT INTO t VALUES (1)")
            1 / 0  # the caller's own failure, mid-transaction
    with pytest.raises(Exception, match="no_such_table"):
        with database.connect() as db:
            db.execute("SELECT * FROM no_such_table")  # the server's refusal
    with database.connect() as db:
        assert db.execute("SELECT count(*) AS n FROM t").fetchone()["n"] == 0  # rolled back
        assert db.execute("SELECT pg_backend_pid() AS pid").fetchone()["pid"] == before


def test_a_committed_operation_is_seen_by_every_later_connection(database, fresh_database):
    with database.connect() as db:
        db.execute("INSERT INTO t VALUES (7)")
    with PostgresDatabase(fresh_database).connect() as db:
        assert db.execute("SELECT n FROM t").fetchall() == [{"n": 7}]


def test_a_connection_idle_too_long_is_closed_not_reused(database, monkeypatch):
    first = backend(database)
    monkeypatch.setattr(database._kept[database.dsn], "MAX_IDLE_S", 0.0)
    assert backend(database) != first


def test_a_connection_opened_long_ago_is_closed_not_reused(database, monkeypatch):
    first = backend(database)
    monkeypatch.setattr(database._kept[database.dsn], "MAX_AGE_S", 0.0)  # however busy it kept
    assert backend(database) != first


def test_a_column_a_release_adds_is_read_by_a_kept_connection(database, fresh_database):
    for n in range(10):  # past psycopg's default threshold for preparing a query on the server
        with database.connect() as db:
            db.execute("INSERT INTO t VALUES (?)", (n,))
            db.execute("SELECT * FROM t").fetchall()
    with PostgresDatabase(fresh_database).connect() as db:
        db.execute("ALTER TABLE t ADD COLUMN m TEXT")
    with database.connect() as db:  # a prepared SELECT * would fail: cached plan must not change result type
        assert db.execute("SELECT * FROM t").fetchall()[0] == {"n": 0, "m": None}


def test_a_connection_past_selects_reach_is_reused(database):
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if min(soft, hard) < 1100:
        pytest.skip("needs 1,100 open files")
    database._kept[database.dsn].close()
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1030)]  # the next socket's number is past 1,024
    try:
        first = backend(database)
        assert database._kept[database.dsn]._kept[-1][1].connection.fileno() >= 1024
        assert backend(database) == first
    finally:
        for fd in held:
            os.close(fd)


def test_concurrent_operations_each_have_their_own_and_only_a_few_are_kept(database):
    inside, release = threading.Barrier(6), threading.Event()
    pids = []

    def operation():
        with database.connect() as db:
            pids.append(db.execute("SELECT pg_backend_pid() AS pid").fetchone()["pid"])
            inside.wait(timeout=10)
            release.wait(timeout=10)

    threads = [threading.Thread(target=operation) for _ in range(6)]
    for thread in threads:
        thread.start()
    time.sleep(0.2)
    release.set()
    for thread in threads:
        thread.join()
    assert len(set(pids)) == 6  # no connection shared by two transactions
    kept = database._kept[database.dsn]
    assert len(kept._kept) == kept.MAX_KEPT
    assert backend(database) in pids


def test_an_unreachable_server_fails_at_once_with_the_registrys_error():
    from tests.conftest import free_port

    gone = PostgresDatabase(f"postgresql://serve_app@127.0.0.1:{free_port()}/gone")
    with pytest.raises(RegistryUnavailable, match="cannot reach the key registry"):  # the connect's own error
        with gone.connect():
            pass


def test_an_index_that_exists_is_not_created_again_under_a_lock_the_ledgers_writes_wait_on(database, fresh_database):
    """CREATE INDEX IF NOT EXISTS takes a SHARE lock on its table even when the index exists: every
    router start queued the ledger's writes behind it (and waited behind any write in progress)."""
    import psycopg

    ddl = "CREATE TABLE IF NOT EXISTS t (n INTEGER); CREATE INDEX IF NOT EXISTS t_n ON t (n);"
    database.create_schema(ddl)
    writer = psycopg.connect(fresh_database)
    writer.execute("INSERT INTO t VALUES (1)")  # a write in progress: its transaction is open
    failed = []

    def start_a_router():
        try:
            database.create_schema(ddl)
        except Exception as err:  # blocked behind the write: cancelled at its statement bound
            failed.append(err)

    try:
        started = threading.Thread(target=start_a_router)
        started.start()
        started.join(30)  # blocked behind the write, it would wait for the writer's commit
        assert not started.is_alive() and failed == []
    finally:
        writer.rollback()
        writer.close()


def test_an_index_a_release_adds_is_built_past_the_statement_bound(database, monkeypatch):
    """Built once, on a table that may be large: under the connections' statement_timeout it failed
    the router's start (and every retry)."""
    with database.connect() as db:
        db.execute("INSERT INTO t SELECT generate_series(1, 300000)")
    monkeypatch.setattr(PostgresDatabase, "STATEMENT_TIMEOUT_MS", 5)
    fresh = PostgresDatabase(database.dsn)  # new connections, with the 5 ms bound
    with pytest.raises(RegistryUnavailable):
        with fresh.connect() as db:
            db.execute("SELECT count(*) FROM t a, t b WHERE a.n < 10")  # the bound holds for other work
    fresh.create_schema("CREATE INDEX IF NOT EXISTS t_n ON t (n);")
    with fresh.connect() as db:
        assert db.execute("SELECT to_regclass('t_n') AS found").fetchone()["found"] == "t_n"

"""The embedded key store's SQLite adapter (serve_app/auth/database.py): each thread keeps its
connection, which must never outlive the file it opened."""

import shutil
import sqlite3
import threading

import pytest

from serve_app.auth.database import RegistryUnavailable, SqliteDatabase


@pytest.fixture
def database(tmp_path):
    db = SqliteDatabase(tmp_path / "keys.sqlite3", create=True)
    db.create_schema("CREATE TABLE IF NOT EXISTS notes (id INTEGER PRIMARY KEY, text TEXT)")
    return db


def _notes(db: SqliteDatabase) -> list[str]:
    with db.connect(read=True) as conn:
        return [row["text"] for row in conn.execute("SELECT text FROM notes ORDER BY id")]


def test_writes_commit_for_every_other_connection_and_a_failed_one_rolls_back(database):
    with database.connect() as conn:
        conn.execute("INSERT INTO notes (text) VALUES (?)", ("kept",))
    with pytest.raises(sqlite3.IntegrityError), database.connect() as conn:
        conn.execute("INSERT INTO notes (text) VALUES (?)", ("dropped",))
        conn.execute("INSERT INTO notes (id, text) VALUES (1, 'clash')")  # the row above's id
    other = SqliteDatabase(database.path, create=False)  # another process's view, say the CLI's
    assert _notes(other) == ["kept"]
    assert _notes(database) == ["kept"]


def test_the_store_stays_one_file(database):
    with database.connect() as conn:  # no write-ahead log beside it that a restore would miss
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"


def test_an_operation_nested_in_another_neither_sees_nor_commits_its_writes(database):
    with pytest.raises(RuntimeError), database.connect() as outer:
        outer.execute("INSERT INTO notes (text) VALUES ('outer, never committed')")
        assert _notes(database) == []  # its own connection: the outer write is not visible yet
        raise RuntimeError("the outer operation fails after the inner one ended")
    assert _notes(database) == []  # rolled back: the inner block's end did not commit it
    with database.connect() as conn:
        conn.execute("INSERT INTO notes (text) VALUES ('after')")
    assert _notes(database) == ["after"]


def test_a_deleted_store_is_unavailable_not_written_into_the_old_file(database):
    assert _notes(database) == []  # this thread's connection is open now
    database.path.unlink()
    with pytest.raises(RegistryUnavailable, match="cannot open the key store"):
        with database.connect() as conn:
            conn.execute("INSERT INTO notes (text) VALUES ('lost')")


def test_a_restored_store_is_read_at_once(database, tmp_path):
    backup = SqliteDatabase(tmp_path / "backup.sqlite3", create=True)
    backup.create_schema("CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT)")
    with backup.connect() as conn:
        conn.execute("INSERT INTO notes (text) VALUES ('from the backup')")
    assert _notes(database) == []
    shutil.copy(backup.path, tmp_path / "restored.sqlite3")
    (tmp_path / "restored.sqlite3").replace(database.path)  # a new file at the store's path
    assert _notes(database) == ["from the backup"]


def test_each_thread_writes_on_its_own_connection(database):
    errors = []

    def write(n: int) -> None:
        try:
            for i in range(20):
                with database.connect() as conn:
                    conn.execute("INSERT INTO notes (text) VALUES (?)", (f"{n}-{i}",))
        except Exception as err:  # sqlite3.ProgrammingError if a connection crossed threads
            errors.append(err)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(_notes(database)) == 80

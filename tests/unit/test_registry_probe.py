"""Whether a router can read the key registry, as ``/health`` asks it (``serve_app/auth/registry_probe.py``):
on a real PostgreSQL, a read replica away is no failure (reads go to the primary), the primary and
the replica both away is; on SQLite, a locked file is; a probe is made at most once every
``PROBE_EVERY_S``, on a thread of its own (never queued behind the lookups that fill the default
pool in an outage), and a slow one is not waited for beyond the caller's bound (the last answer
stands meanwhile), nor does closing it fail a check that waits for it."""

import asyncio
import sqlite3
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from serve_app.auth.database import PostgresDatabase, RegistryUnavailable
from serve_app.auth.keys import KeyStore
from serve_app.auth.registry_probe import RegistryProbe
from tests.conftest import free_port


def _gone() -> str:
    return f"postgresql://serve_app@127.0.0.1:{free_port()}/gone"


def test_a_registry_read_through_its_replica_or_its_primary_is_readable_and_neither_is_not(fresh_database):
    async def check(database) -> tuple[bool, str | None]:
        probe = RegistryProbe(database)
        readable = await probe.check(wait_s=10)
        return readable, probe.error

    KeyStore(fresh_database, cache_ttl_s=0)  # the registry's tables, as a router finds them
    assert asyncio.run(check(PostgresDatabase(fresh_database))) == (True, None)
    # The region's replica away: key lookups read the primary, and so does the probe.
    assert asyncio.run(check(PostgresDatabase(fresh_database, replica=_gone()))) == (True, None)
    readable, error = asyncio.run(check(PostgresDatabase(_gone(), replica=_gone())))
    assert readable is False and "cannot reach the key registry" in error and "password" not in error


class Switchable:
    """A database whose reads fail while ``away``, counting the probes' connects."""

    def __init__(self):
        self.away, self.connects = False, 0
        self.hold = threading.Event()
        self.hold.set()  # cleared: a connect waits until it is set again

    @contextmanager
    def connect(self, read: bool = False):
        assert read  # the probe reads as key lookups do
        self.connects += 1
        self.hold.wait(10)
        if self.away:
            raise RegistryUnavailable("cannot reach the key registry at host=primary")
        yield self

    def execute(self, sql: str):
        assert sql.startswith("SELECT 1 FROM api_keys")


def test_a_probe_is_made_once_per_interval_and_each_finding_stands_until_the_next():
    now = [0.0]
    database = Switchable()
    probe = RegistryProbe(database, clock=lambda: now[0])

    async def run():
        assert await probe.check(wait_s=5) is True and database.connects == 1
        database.away = True
        now[0] += probe.PROBE_EVERY_S / 2
        assert await probe.check(wait_s=5) is True and database.connects == 1  # the last probe's answer
        now[0] += probe.PROBE_EVERY_S / 2
        assert await probe.check(wait_s=5) is False and database.connects == 2
        assert "host=primary" in probe.error
        database.away = False
        now[0] += probe.PROBE_EVERY_S
        assert await probe.check(wait_s=5) is True and probe.error is None

    asyncio.run(run())


def test_a_slow_probe_is_not_waited_for_and_its_answer_serves_the_next_check():
    database = Switchable()
    probe = RegistryProbe(database)

    async def run():
        database.away = True
        database.hold.clear()  # the registry's connect hangs (its 5 s timeout, in a real one)
        assert await probe.check(wait_s=0.05) is True  # nothing known yet: the region stays in
        assert database.connects == 1
        database.hold.set()
        for _ in range(100):
            if probe.readable is False:
                break
            await asyncio.sleep(0.01)
        assert await probe.check(wait_s=0.05) is False and database.connects == 1  # that probe's answer
        await probe.aclose()

    asyncio.run(run())


def test_a_locked_sqlite_file_is_not_readable(tmp_path):
    """``make run``'s store: a bare ``SELECT 1`` reads no page and passed while lookups failed."""
    store = KeyStore(tmp_path / "keys.sqlite3", cache_ttl_s=0, create=True)
    locker = sqlite3.connect(tmp_path / "keys.sqlite3")
    locker.execute("BEGIN EXCLUSIVE")
    try:
        probe = RegistryProbe(store.database)
        assert asyncio.run(probe.check(wait_s=30)) is False and "locked" in probe.error
    finally:
        locker.rollback()
        locker.close()
    probe = RegistryProbe(store.database)
    assert asyncio.run(probe.check(wait_s=30)) is True


def test_the_probe_is_not_queued_behind_lookups_that_fill_the_default_pool():
    """Every uncached lookup waits out the connect timeout on asyncio's default threads in the very
    outage the probe is for: a probe there answered after them, the region still 'readable'."""
    database = Switchable()
    database.away = True
    probe = RegistryProbe(database)

    async def run():
        loop = asyncio.get_running_loop()
        blocked = threading.Event()
        loop.set_default_executor(ThreadPoolExecutor(max_workers=2))
        lookups = [asyncio.to_thread(blocked.wait, 10) for _ in range(8)]  # the pool is full
        waiting = asyncio.gather(*lookups)
        assert await probe.check(wait_s=5) is False  # its own thread answered, within the wait
        blocked.set()
        await waiting
        await probe.aclose()

    asyncio.run(run())


def test_closing_the_probe_while_a_check_waits_for_it_fails_no_check():
    """A reconfigure rebuilds the authenticator and closes the old probe while a /health may wait on
    it: that /health answers with the last finding, not an error."""
    database = Switchable()
    database.hold.clear()  # the probe's connect hangs
    probe = RegistryProbe(database)

    async def run():
        waiting = asyncio.create_task(probe.check(wait_s=5))
        await asyncio.sleep(0.05)
        await probe.aclose()
        assert await waiting is True  # the last finding (none yet: readable)
        assert await probe.check(wait_s=0.05) is True and database.connects == 1  # closed: no new probe

    try:
        asyncio.run(run())
    finally:
        database.hold.set()

"""Whether a router can read the key registry, as ``/health`` asks it (``serve_app/auth/registry_probe.py``):
on a real PostgreSQL, a read replica away is no failure (reads go to the primary), the primary and
the replica both away is; a probe is made at most once every ``PROBE_EVERY_S``, and a slow one is
not waited for beyond the caller's bound (the last answer stands meanwhile)."""

import asyncio
import threading
from contextlib import contextmanager

from serve_app.auth.database import PostgresDatabase, RegistryUnavailable
from serve_app.auth.registry_probe import RegistryProbe
from tests.conftest import free_port


def _gone() -> str:
    return f"postgresql://serve_app@127.0.0.1:{free_port()}/gone"


def test_a_registry_read_through_its_replica_or_its_primary_is_readable_and_neither_is_not(fresh_database):
    async def check(database) -> tuple[bool, str | None]:
        probe = RegistryProbe(database)
        readable = await probe.check(wait_s=10)
        return readable, probe.error

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
        assert sql == "SELECT 1"


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

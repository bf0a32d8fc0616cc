"""Whether this router can read the key registry: the question ``/health`` asks of it.

A router that cannot read the registry (the region's read replica and the primary both away: a
partition, both in maintenance at once) refuses every credential its cache does not hold with 503
``key_registry_unavailable``, and such a request is not failed over (a caller's key is never
forwarded, and a key that cannot be checked gets no peer token). ``/health`` said 200 meanwhile,
so Route 53 kept sending the region callers it refused. It now reads the registry as a key lookup
does (a row of ``api_keys`` on the read path: the replica, else the primary), at most once every
``PROBE_EVERY_S``, on a thread of its own (the lookups' pool fills up in exactly this outage, each
lookup waiting out its connect timeout: a probe queued behind them would answer late), waiting
for it no longer than ``/health``'s own bound and answering from the last probe meanwhile. A probe
of an unreachable registry takes the connect timeouts (5 s on the replica, 5 s on the primary), so
the answer is at most ~15 s behind. Route 53 drops a region after 3 failed checks 10 s apart, so a
blip shorter than that moves no traffic; a registry every region has lost fails every region's
check, and Route 53 then answers with all of them (its fail-open), as before.
"""

import asyncio
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from serve_app.telemetry.logs import module_logger

logger = module_logger(__name__)


class RegistryProbe:
    PROBE_EVERY_S = 5.0

    def __init__(self, database: Any, clock: Callable[[], float] = time.monotonic):
        """``database``: the key store's (``SqliteDatabase`` or ``PostgresDatabase``)."""
        self.database, self._clock = database, clock
        self.readable = True  # what the last probe found (none yet: nothing says otherwise)
        self.error: str | None = None  # why the last probe failed, for the log
        self._probed_at = -math.inf
        self._probe: asyncio.Task | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="registry-probe")
        self._closed = False

    async def check(self, wait_s: float) -> bool:
        """Whether the registry can be read: a fresh probe's answer if it comes within ``wait_s``,
        else the last one's. Starts a probe when the last is ``PROBE_EVERY_S`` old."""
        if self._probe is not None and self._probe.done():  # cancelled before it ran (aclose)
            self._probe = None
        due = self._clock() - self._probed_at >= self.PROBE_EVERY_S
        if self._probe is None and due and not self._closed:
            self._probe = asyncio.create_task(self._run())
        if self._probe is not None:
            # Never raises for the probe: closed meanwhile, it is the last answer that counts.
            await asyncio.wait({self._probe}, timeout=wait_s)
        return self.readable

    async def _run(self) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(self._thread, self._read_a_key)
        except Exception as err:  # RegistryUnavailable, or any failure of the query itself
            if self.readable:
                logger.warning("key registry unreadable (%s): /health answers 503 until it reads again", err)
            self.readable, self.error = False, str(err)
        else:
            if not self.readable:
                logger.warning("key registry readable again: /health no longer refuses for it")
            self.readable, self.error = True, None
        finally:
            self._probed_at = self._clock()
            self._probe = None

    def _read_a_key(self) -> None:
        """What a key lookup reads (a table and its rights, not only a connection: on SQLite a bare
        ``SELECT 1`` reads no page of the file, and succeeds while the file is locked)."""
        with self.database.connect(read=True) as db:
            db.execute("SELECT 1 FROM api_keys LIMIT 1")

    async def aclose(self) -> None:
        """When the router stops (or its auth is rebuilt): no new probe; one still waiting for a
        connection is not waited for (its thread ends with the connect's timeout)."""
        self._closed = True
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)
        self._thread.shutdown(wait=False)

"""Whether this router can read the key registry: the question ``/health`` asks of it.

A router that cannot read the registry (the region's read replica and the primary both away: a
partition, a shared maintenance window) refuses every credential its cache does not hold with 503
``key_registry_unavailable``, and such a request is not failed over (a caller's key is never
forwarded, and a key that cannot be checked gets no peer token). ``/health`` said 200 meanwhile,
so Route 53 kept sending the region callers it refused. It now reads the registry as a key lookup
does (``SELECT 1`` on the read path: the replica, else the primary), at most once every
``PROBE_EVERY_S``, in a worker thread, waiting for it no longer than ``/health``'s own bound and
answering from the last probe meanwhile. Route 53 drops a region after 3 failed checks 10 s
apart, so a blip shorter than that moves no traffic; a registry every region has lost fails every
region's check, and Route 53 then answers with all of them (its fail-open), as before.
"""

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
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

    async def check(self, wait_s: float) -> bool:
        """Whether the registry can be read: a fresh probe's answer if it comes within ``wait_s``,
        else the last one's. Starts a probe when the last is ``PROBE_EVERY_S`` old."""
        if self._probe is None and self._clock() - self._probed_at >= self.PROBE_EVERY_S:
            self._probe = asyncio.create_task(self._run())
        if self._probe is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._probe), wait_s)
        return self.readable

    async def _run(self) -> None:
        try:
            await asyncio.to_thread(self._select_one)
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

    def _select_one(self) -> None:
        with self.database.connect(read=True) as db:
            db.execute("SELECT 1")

    async def aclose(self) -> None:
        """When the router stops: a probe still waiting for a connection is not waited for."""
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)

"""The threads a key store re-reads its cached rows on, ahead of their expiry (``cache.py``,
"Refresh ahead"), and the bound on how many such re-reads wait at once.

One ``Refresher`` per store, shared by its caches (keys' rows, tokens' revocation rows), so
``max_pending`` bounds the store's re-reads however many caches ask. A re-read is best effort: no
request ever waits for one, so one refused (the bound reached, or the store closing) or failed
costs only that its row expires and the next request reads it, as without refresh ahead.
"""

import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor

from serve_app.telemetry.logs import module_logger

logger = module_logger(__name__)

# An SRE sees a registry failing the re-reads in the log once a minute at most, not per failure.
FAILURE_LOG_INTERVAL_S = 60


class _Ticket:
    """One reserved re-read's place; released exactly once, whether the re-read ran, failed, was
    cancelled or never started."""

    __slots__ = ("released",)

    def __init__(self):
        self.released = False


class Refresher:
    def __init__(
        self,
        threads: int,
        max_pending: int,
        *,
        executor: Executor | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``threads``: re-reads at once (created on first use); ``max_pending``: reserved and
        not finished, at most. ``executor``: where they run (tests pass their own)."""
        self.max_pending, self.clock = max_pending, clock
        if executor is None:
            executor = ThreadPoolExecutor(threads, thread_name_prefix="key-refresh")
        self._executor = executor
        self._pending = 0
        self._closed = False
        self._failure_logged_at: float | None = None
        self._lock = threading.Lock()

    @property
    def pending(self) -> int:
        return self._pending

    def reserve(self) -> bool:
        """A place for one re-read, if there is room (and the store is open); the caller then
        ``run``s it."""
        with self._lock:
            if self._closed or self._pending >= self.max_pending:
                return False
            self._pending += 1
            return True

    def run(self, job: Callable[[], None]) -> None:
        """Run a reserved ``job`` on the threads; its place is released when it ends, however it
        ends (a cancelled one too: ``close``)."""
        ticket = _Ticket()
        try:
            future = self._executor.submit(job)
        except BaseException as err:  # closed, or no thread could start (the job may run all the same)
            self._release(ticket)
            if not isinstance(err, Exception):
                raise
            return
        future.add_done_callback(lambda _: self._release(ticket))

    def failed(self, err: Exception) -> None:
        """A re-read failed: logged once a minute at most."""
        now = self.clock()
        with self._lock:
            if self._failure_logged_at is not None and now - self._failure_logged_at < FAILURE_LOG_INTERVAL_S:
                return
            self._failure_logged_at = now
        logger.warning("key registry: re-reading a cached row failed (%s); rows expire and are read as requests come", err)

    def close(self) -> None:
        """No more re-reads: queued ones are dropped (a stopping router does not wait for them),
        one under way finishes (its query has its own timeouts)."""
        with self._lock:
            self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _release(self, ticket: _Ticket) -> None:
        with self._lock:
            if not ticket.released:
                ticket.released = True
                self._pending -= 1

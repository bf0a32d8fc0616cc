"""The key store's read cache: what a router remembers of the registry, and what a flood of
made-up key ids may cost it.

A key id is public and a well-formed ``pgk_`` key costs nothing to invent, so every lookup of an
id the router has no row for is a registry query an unauthenticated caller chose. This cache
keeps those from reaching the shared database, or pushing real keys out of memory:

- **Two LRU maps.** Rows (``MAX_ROWS``) and misses (``MAX_MISSES``, the negative cache) are bounded
  apart, so misses only ever evict other misses: a flood of random ids cannot push a real key out,
  and it cannot flush anything (the least recently used entry goes, never the whole map).
- **TTLs.** A row is fresh for ``ttl`` (``cache_ttl_s``), a miss for ``miss_ttl`` (at most
  ``ttl``): a key created while its id is cached as a miss is seen within ``cache_ttl_s``.
- **Single flight.** Concurrent lookups of one id wait for one query.
- **A budget for unknown ids** (``MissBudget``). A lookup the caller asks to be ``budgeted`` (a
  raw key: unauthenticated), of an id this router holds no row for, even a stale one, spends one
  token of a per-router bucket (``rate`` a second, ``rate`` deep). An empty bucket is
  ``RegistryBusy``, raised before any query (the authenticator answers 503 with Retry-After).
  Refreshing a row the router already holds is never budgeted: only real keys have rows, so a
  flood cannot delay a known key's refresh, and keys this router has answered keep answering.
  Nor is an id the registry is ``known`` to hold (``KeyStore.refresh_known_ids``: every key id,
  listed at start and then every few seconds): a real key this router has not looked up yet —
  every key, right after a restart — is looked up however large the flood; only an id created
  since the last listing shares the budget with made-up ones.
  A budgeted miss is paid for in the event loop's offline pass (``offline=True``), so a refused
  one never takes a worker thread, and a paid one says so (``CacheMiss.unknown``) so that the
  caller can query it on a few threads of its own (the authenticator's): a flood's queries then
  wait there, never in front of a real key's refresh.
- **Refresh ahead.** A row used in the second half of its life (``REFRESH_AFTER`` of ``ttl``) is
  answered from memory and read again in the background (a ``Refresher``: the store's own few
  threads, a bounded number waiting), so a key in steady use does not find its row expired every
  ``ttl`` and wait for the registry on a request's path. No request waits for a re-read: a row
  that expires before its re-read has run is read on the request's path, as without (and the
  re-read, finding it gone, does not query). One re-read per row, not retried when it fails (the
  row expires). A re-read's row counts from when it was asked for and only replaces the row it
  was asked for, so the bound on an edit reaching this router is unchanged: a row is served at
  most ``ttl`` after the query that read it began. After a write this process makes to a key
  (``forget``), no query of that key already under way stores what it read. A busy row costs two
  queries a ``ttl`` instead of one; one not used in its second half costs none.
- **Final rows.** A row that can never change back (``is_final``: a revoked key, a revoked
  token: revocation is for good) is kept until evicted, never expired nor read ahead: a client
  that goes on sending a revoked credential costs the registry one query per router, not two
  every ``ttl``. The bound is about an edit reaching the router, and a final row has none to come.
"""

import functools
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from serve_app.auth.refresh import Refresher
from serve_app.telemetry.logs import module_logger

logger = module_logger(__name__)

# An SRE sees a flood in the log, once a minute at most, not once per refused request.
_BUSY_LOG_INTERVAL_S = 60


class CacheMiss(Exception):
    """An offline read (``offline=True``) would have had to query the database. ``unknown``: of
    an id with no row here, paid for from the miss budget (the caller queries it on the threads
    it keeps for those, so a flood never occupies the ones real keys' lookups use)."""

    def __init__(self, key: Hashable, unknown: bool = False):
        super().__init__(key)
        self.unknown = unknown


class RegistryBusy(Exception):
    """This router's budget for lookups of unknown key ids is spent; nothing was queried."""


class MissBudget:
    """A token bucket: ``rate`` lookups a second, at most ``rate`` (at least 1) at once."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic):
        self.rate, self.clock = rate, clock
        self.capacity = max(1.0, rate)
        self._tokens, self._at = self.capacity, clock()
        self._busy_logged_at: float | None = None

    def take(self) -> bool:
        """Spend one token if there is one. Called under the cache's lock."""
        now = self.clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1:
            self._tokens -= 1
            return True
        if self._busy_logged_at is None or now - self._busy_logged_at >= _BUSY_LOG_INTERVAL_S:
            self._busy_logged_at = now
            logger.warning("key registry: refusing lookups of unknown key ids past %g/s (a flood?)", self.rate)
        return False


@dataclass
class _Flight:
    """One query in progress; lookups of the same id wait on it."""

    done: threading.Event = field(default_factory=threading.Event)
    value: Any = None
    error: BaseException | None = None
    waiters: int = 0
    unknown: bool = False  # paid from the miss budget: queried (and waited for) on its own threads
    began: int = 0  # the cache's write count when it began: its key written since, and it is not stored

    def result(self) -> Any:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.value


class LookupCache:
    MAX_ROWS = 50_000  # real keys only: bounded by what the registry holds
    # ~200 bytes each: the negative cache holds at most ~2 MB of a router's memory.
    MAX_MISSES = 10_000
    # Ids paid for in an offline pass and not looked up yet; only a lost thread leaves one behind.
    _MAX_PAID = 10_000
    # A row used after this fraction of its life is read again in the background.
    REFRESH_AFTER = 0.5
    # Keys this process wrote last, remembered to discard queries that began before the write;
    # one written longer ago discards every query that began before it (safe, and rare).
    MAX_WRITTEN = 10_000

    def __init__(
        self,
        ttl: float,
        *,
        miss_ttl: float | None = None,
        is_miss: Callable[[Any], bool] = lambda value: value is None,
        is_final: Callable[[Any], bool] = lambda value: False,
        budget: MissBudget | None = None,
        known: Callable[[Hashable], bool] = lambda key: False,
        refresher: Refresher | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``refresher``: where rows are read again ahead of their expiry; None: only ever when a
        lookup finds them expired. ``is_final``: a row no later edit can change (kept, not re-read)."""
        self.ttl, self.clock, self.is_miss, self.budget, self.known = ttl, clock, is_miss, budget, known
        self.is_final = is_final
        self.refresher = refresher
        self.miss_ttl = ttl if miss_ttl is None else min(miss_ttl, ttl)
        # key -> (expires at, value, re-read asked for); misses: (expires at, value).
        self._rows: OrderedDict[Hashable, tuple[float, Any, bool]] = OrderedDict()
        self._misses: OrderedDict[Hashable, tuple[float, Any]] = OrderedDict()
        self._flights: dict[Hashable, _Flight] = {}
        self._paid: set[Hashable] = set()
        self._writes = 0  # writes this process made (``forget``)
        self._written: OrderedDict[Hashable, int] = OrderedDict()  # key -> the write count after its last
        self._written_floor = 0  # the newest write count dropped from ``_written``
        self._lock = threading.Lock()

    def get(
        self, key: Hashable, load: Callable[[], Any], offline: bool = False, budgeted: bool = False, ahead: bool = True
    ) -> Any:
        """The cached value, else ``load()`` (once for concurrent callers). ``offline``: raise
        CacheMiss instead of loading. ``budgeted``: an unknown ``key`` spends the miss budget,
        or raises RegistryBusy. ``ahead``: a row in its second half is read again in the
        background (False: the caller decides, ``refresh_ahead``, once it has checked the row)."""
        now = self.clock()
        with self._lock:
            found, value = self._fresh(key, now)
            if found:
                reread = self._claim_refresh(key, now) if ahead else None
            else:
                flight = self._flights.get(key)
                if flight is None:
                    paid = self._pay(key, budgeted, offline)
                    if offline:
                        raise CacheMiss(key, unknown=paid)
                    flight = self._flights[key] = _Flight(unknown=paid, began=self._writes)
                    leader = True
                elif offline:  # its answer is on the way: wait for it where its query runs
                    raise CacheMiss(key, unknown=flight.unknown)
                else:
                    flight.waiters += 1
                    leader = False
        if found:
            self._start_reread(key, load, reread, now)
            return value
        if leader:
            self._fly(key, load, flight, now)
        return flight.result()

    def refresh_ahead(self, key: Hashable, load: Callable[[], Any]) -> None:
        """Read ``key``'s row again in the background if it is in its second half (after a
        ``get(..., ahead=False)`` whose row the caller found worth keeping fresh)."""
        now = self.clock()
        with self._lock:
            reread = self._claim_refresh(key, now)
        self._start_reread(key, load, reread, now)

    def _start_reread(
        self, key: Hashable, load: Callable[[], Any], claim: tuple[int, float] | None, now: float
    ) -> None:
        """Hand a claimed re-read (``_claim_refresh``'s answer, None: none due) to the refresher."""
        if claim is not None:
            self.refresher.run(functools.partial(self._refresh, key, load, *claim, now))

    def forget(self, key: Hashable) -> None:
        """Drop one entry (this process just changed that row): the next read queries. Queries
        under way are not stored (they may have read the row before the change), and a lookup
        from now on does not wait for one of them."""
        with self._lock:
            self._forget_locked(key)

    def _forget_locked(self, key: Hashable) -> None:
        """``forget``, with the lock held."""
        self._rows.pop(key, None)
        self._misses.pop(key, None)
        self._flights.pop(key, None)
        self._writes += 1
        self._written[key] = self._writes
        self._written.move_to_end(key)
        while len(self._written) > self.MAX_WRITTEN:
            self._written_floor = self._written.popitem(last=False)[1]

    def put_final(self, key: Hashable, value: Any, for_s: float = math.inf) -> None:
        """Hold ``value`` for ``key`` for ``for_s`` (a revocation this process learnt of from the
        primary: a token's until it would have expired anyway), never read again meanwhile:
        queries under way, which may have read a lagging replica, do not replace it."""
        with self._lock:
            self._forget_locked(key)
            if for_s > 0:
                self._rows[key] = (self.clock() + for_s, value, False)
                while len(self._rows) > self.MAX_ROWS:
                    self._rows.popitem(last=False)

    def held(self, key: Hashable) -> Any:
        """The row held for ``key`` now, if one is (None otherwise); counts as no use of it."""
        row = self._rows.get(key)
        return row[1] if row is not None and row[0] > self.clock() else None

    def _fly(self, key: Hashable, load: Callable[[], Any], flight: _Flight, now: float) -> None:
        """Run ``flight``'s query (begun at ``now``), store its answer, wake its waiters."""
        try:
            flight.value = load()
        except BaseException as err:
            flight.error = err
        finally:
            with self._lock:
                if flight.error is None and not self._written_since(key, flight.began):
                    self._store(key, flight.value, now)
                if self._flights.get(key) is flight:
                    del self._flights[key]
            flight.done.set()

    def _refresh(self, key: Hashable, load: Callable[[], Any], began: int, expires: float, asked_at: float) -> None:
        """The background re-read of the row that ``expires`` then, asked for at ``asked_at``:
        stored as if read then (the bound holds), and only over that same row. Not queried at
        all if that row is gone, replaced, written or expired by the time a thread takes it up."""
        with self._lock:
            if not self._still_held(key, began, expires, self.clock()):
                return
        try:
            value = load()
        except Exception as err:
            self.refresher.failed(err)
            return
        with self._lock:
            if self._still_held(key, began, expires):
                self._store(key, value, asked_at)

    def waiting(self, key: Hashable) -> int:
        """How many lookups are waiting for ``key``'s query in progress (for tests)."""
        with self._lock:
            flight = self._flights.get(key)
            return flight.waiters if flight else 0

    # --- under the lock --------------------------------------------------------------------------
    def _claim_refresh(self, key: Hashable, now: float) -> tuple[int, float] | None:
        """(The write count now, the row's end) to re-read ``key``'s row under, if a re-read is
        due now: a row (never a miss) past ``REFRESH_AFTER`` of its life, not asked for yet, and
        room for it."""
        row = self._rows.get(key)
        if (
            self.refresher is None
            or row is None
            or row[2]
            or row[0] <= now  # expired: the request's own lookup reads it
            or row[0] - now > self.ttl * (1 - self.REFRESH_AFTER)
            or key in self._flights
            or not self.refresher.reserve()
        ):
            return None
        self._rows[key] = (row[0], row[1], True)  # one re-read per row, whatever becomes of it
        return self._writes, row[0]

    def _written_since(self, key: Hashable, began: int) -> bool:
        """Whether this process wrote ``key`` after a query that began at write count ``began``."""
        return self._written.get(key, self._written_floor) > began

    def _still_held(self, key: Hashable, began: int, expires: float, now: float | None = None) -> bool:
        """Whether the row a re-read was asked for (the one that ``expires`` then) is still the one
        held, unwritten since, and (given ``now``) not yet expired."""
        row = self._rows.get(key)
        return (
            row is not None
            and row[0] == expires
            and not self._written_since(key, began)
            and (now is None or expires > now)
        )

    def _fresh(self, key: Hashable, now: float) -> tuple[bool, Any]:
        row = self._rows.get(key)
        if row is not None:
            if row[0] > now:
                self._rows.move_to_end(key)
                return True, row[1]
            return False, None  # stale: refreshed, never budgeted (the id is a real key's)
        miss = self._misses.get(key)
        if miss is not None and miss[0] > now:
            self._misses.move_to_end(key)
            return True, miss[1]
        return False, None

    def _pay(self, key: Hashable, budgeted: bool, offline: bool) -> bool:
        """Spend the budget for a lookup of an id with no row here, once per lookup: the offline
        pass pays, and the online pass that follows it finds the id already paid for. Whether
        this lookup is (or was) paid for."""
        if not budgeted or self.budget is None or key in self._rows or self.known(key):
            return False
        if key in self._paid:
            if not offline:
                self._paid.discard(key)
            return True
        if not self.budget.take():
            raise RegistryBusy(key)
        if offline:
            if len(self._paid) >= self._MAX_PAID:
                self._paid.clear()
            self._paid.add(key)
        return True

    def _store(self, key: Hashable, value: Any, now: float) -> None:
        self._paid.discard(key)
        if self.is_miss(value):
            self._rows.pop(key, None)
            self._misses[key] = (now + self.miss_ttl, value)
            self._misses.move_to_end(key)
            while len(self._misses) > self.MAX_MISSES:
                self._misses.popitem(last=False)
        else:
            self._misses.pop(key, None)
            self._rows[key] = (math.inf if self.is_final(value) else now + self.ttl, value, False)
            self._rows.move_to_end(key)
            while len(self._rows) > self.MAX_ROWS:
                self._rows.popitem(last=False)

"""Per-key token budgets per UTC day and per UTC month (prompt + completion tokens), held in escrow.

A budget is global, across every router of every region: the spend it is checked against is the
shared ledger's rollup (``UsageStore.budget_state``), plus what this router recorded and has not
written yet (``UsageLedger.pending_tokens``), so a router sees its own spend at once.

Escrow: the router reserves a request's worst case (its price, ``router/pricing.py``) when it
admits it (``reserve``), and releases the reservation when the request ends, right after its usage
record is queued: from then on the record's real tokens count instead, in the ledger's pending
tokens (no gap between the two, and no double count once released). A request is admitted only
if the key's spend, this router's unwritten records, its open reservations and this request's
worst case all fit in the day's and the month's limit; otherwise 429 ``budget_exceeded``, with
``Retry-After`` until the period resets (or 1 s when only the key's own requests in flight hold
the rest: they release it as they end). ``check`` is the same with nothing reserved.

The overshoot that remains (docs/usage.md):
  - the prompt estimate: a request may turn out to cost more than its price, by what its real
    prompt exceeds the estimate (at most ``CHARS_PER_TOKEN`` times the estimate, plus the chat
    template);
  - other routers and regions: their reservations are not seen here at all, and their records
    reach the database within their ledger's ``flush_interval_s`` and this router reads it again
    within ``cache_ttl_s`` (plus a read replica's lag). So past the limit the key can still get
    what the other routers admitted in flight, each of them at most the remaining budget it saw.

Each check reads the cache in the event loop; a miss loads the budget and both spends in one
thread call (one connection), shared by every check of that key waiting on it. Keys without a
budget are cached too: for them a reservation costs one cached lookup and holds nothing. A busy
key never waits for the store after its first check: a check that finds its entry past
``REFRESH_AFTER`` of ``cache_ttl_s`` decides on it and starts the next read in the background (a
read in the foreground is 1–2 ms of the request's admission). A read slower than the rest of the
entry's life (a database in trouble) does not stall the key either: the expired entry keeps
deciding while that read is under way, for at most another ``cache_ttl_s``. An expired entry with
no read under way (an idle key) is waited for. So a decision rests on a read that answered at
most ``cache_ttl_s`` before, or twice that while reads are slow (during an outage, on the last
known entry: below).

This router's own writes: the ledger tells the guard what each batch it wrote holds
(``written``), in the step where those tokens stop counting as pending, and the guard keeps a
running total per key. An entry remembers the total when its read began, and a check adds what
was written since: tokens the read may not have seen are never counted zero times, whatever the
order of reads, batches (several per flush, one per replayed spool file), the waiters' wake-ups
and midnight (added to the day and the month being checked: a record of yesterday written after
midnight counts against today, as it did while pending). Counted twice at times, the safe side:
a batch whose total came after a read began that still saw it (until the next read), and a spool
file another replica replayed (until this router's ledger notices, ``ledger.py``). A key this
router wrote in the last ``PRIMARY_AFTER_WRITE_S`` is read from the primary: the region's read
replica may not have those records yet, and they are in the total already (a replica more than
that behind would let them count zero times until it catches up). Before,
each batch expired the key's entry, so a key with a budget waited for a read after every batch
(each second while it sent).

Bounded grace: when the store cannot be reached, the guard keeps the key's last known entry
(budget and spend, still counting this router's writes, new spend and reservations on top) for
another ``cache_ttl_s`` past each failed read, and tries again in the background while the key is
busy (an idle key's next check tries in the foreground). A key it has no entry for is admitted (fail
open, nothing reserved) until the store answers again: a ledger outage must not stop inference,
and the records of what it admits are spooled and reach the ledger afterwards (``ledger.py``), so
the spend is counted late, never lost. Each failed read is logged.
"""

import asyncio
import datetime as dt
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from serve_app.errors import APIError
from serve_app.usage.ledger import UsageLedger
from serve_app.usage.records import utc_day
from serve_app.usage.store import Budget, UsageStore
from serve_app.telemetry.logs import module_logger

logger = module_logger(__name__)

MAX_ENTRIES = 50_000  # keys cached; bounded like the key store's cache
# Retry-After when the budget is held by the key's own requests in flight: they end, and release it.
HELD_RETRY_AFTER_S = 1
# A check past this share of the entry's life reads it again in the background: the read has the
# rest of it (2.5 s of 5) to answer before a check would wait for it.
REFRESH_AFTER = 0.5
# A key this router wrote records of in the last this-many seconds is read from the primary.
PRIMARY_AFTER_WRITE_S = 30.0


# --- reset math (pure: unit-tested with fixed times) ---------------------------------------------
def _utc_date(now: float) -> dt.date:
    return dt.datetime.fromtimestamp(now, dt.timezone.utc).date()


def _epoch(day: dt.date) -> float:
    return dt.datetime(day.year, day.month, day.day, tzinfo=dt.timezone.utc).timestamp()


def month_start(now: float) -> str:
    """The first UTC day ``YYYY-MM-01`` of the month ``now`` falls in."""
    return _utc_date(now).replace(day=1).isoformat()


def next_day_start(now: float) -> float:
    """The epoch time of the next UTC midnight (when a daily budget resets)."""
    return _epoch(_utc_date(now) + dt.timedelta(days=1))


def next_month_start(now: float) -> float:
    """The epoch time of the first of the next UTC month (December → January of the next year)."""
    today = _utc_date(now)
    return _epoch(dt.date(today.year + today.month // 12, today.month % 12 + 1, 1))


def iso_utc(epoch_s: float) -> str:
    return dt.datetime.fromtimestamp(epoch_s, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- the guard -----------------------------------------------------------------------------------
@dataclass(eq=False)
class Reservation:
    """A request's worst case held against its key's budget until ``release()``: call it once the
    request's usage record is queued (or, refused later on, at once). Idempotent. A reservation
    dropped unreleased is released when it is garbage-collected, and logged: a bug must not hold
    a key's budget for the life of the router."""

    headers: dict[str, str]
    key_id: str = ""
    tokens: int = 0
    _held: dict[str, int] | None = field(default=None, repr=False)

    def release(self) -> None:
        held, self._held = self._held, None
        if held is None:
            return
        left = held.get(self.key_id, 0) - self.tokens
        if left > 0:
            held[self.key_id] = left
        else:
            held.pop(self.key_id, None)

    def __del__(self) -> None:
        if self._held is not None:
            logger.warning("budget reservation of %d tokens for key %s was never released", self.tokens, self.key_id)
            self.release()


@dataclass(frozen=True)
class _Entry:
    budget: Budget | None
    day: str  # the UTC day and month the spends were read for
    month: str
    spent_day: int
    spent_month: int
    written: int  # this router's running total of the key's written tokens when the read began
    expires: float  # (monotonic) past it, a check waits for a fresh read (one more TTL if one is under way)
    refresh_at: float  # past it, a check starts a fresh read in the background and does not wait
    known: bool = True  # False: the store could not be read and the key is admitted unchecked

    def spent(self, day: str, month: str, written_since: int) -> tuple[int, int]:
        """Spends for the current period: an entry read before midnight says nothing about the
        new day (or month), whose database spend was 0 then; what this router wrote since the
        read began counts in both, whatever day its records are of (the safe side)."""
        return (
            (self.spent_day if day == self.day else 0) + written_since,
            (self.spent_month if month == self.month else 0) + written_since,
        )


class BudgetGuard:
    def __init__(
        self,
        store: UsageStore,
        ledger: UsageLedger | None,
        *,
        cache_ttl_s: float = 5.0,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] | None = None,
    ):
        self.store, self.ledger = store, ledger
        # ``clock`` dates (the UTC day and month a spend is of); ``monotonic`` times the cache:
        # on the wall clock, a step back (NTP, a VM resumed) of an hour kept every entry an hour
        # more, a raised budget unseen and other routers' spend uncounted. A test's clock drives
        # both unless it gives a monotonic clock of its own.
        self.cache_ttl_s, self.clock = cache_ttl_s, clock
        self.monotonic = monotonic or (time.monotonic if clock is time.time else clock)
        self._entries: dict[str, _Entry] = {}
        self._loading: dict[str, asyncio.Task] = {}
        # This router's written tokens by key (a running total; see the module's docstring), and
        # when it last wrote each key's records (read from the primary until PRIMARY_AFTER_WRITE_S).
        self._written_tokens: dict[str, int] = {}
        self._written_at: dict[str, float] = {}
        self._prune_at = MAX_ENTRIES  # the totals' count that makes the next write prune them
        self._held: dict[str, int] = {}  # tokens reserved by requests in flight, by key

    async def check(self, key_id: str) -> dict[str, str]:
        """The budget headers for an admitted request; APIError 429 ``budget_exceeded`` when the
        key's daily or monthly budget is spent. ``{}`` for a key without a budget."""
        return (await self.reserve(key_id, 0)).headers

    async def reserve(self, key_id: str, tokens: int) -> Reservation:
        """Hold ``tokens`` (the request's price) against the key's budget until the request ends;
        APIError 429 ``budget_exceeded`` when they do not fit in what is left of the day's or the
        month's budget. A key without a budget holds nothing (``headers`` empty)."""
        now, at = self.clock(), self.monotonic()
        entry = self._entries.get(key_id)
        if entry is None or entry.expires <= at and not self._read_on_its_way(key_id, entry, at):
            entry = await asyncio.shield(self._read(key_id, now))  # a client gone must not cancel it
        elif entry.refresh_at <= at:
            self._read(key_id, now)  # for the checks after this one: this one decides on the entry
        if entry.budget is None:  # no budget, or admitted unchecked while the store is away
            return Reservation({})
        # From here to the end, no await: concurrent reservations of this router see each other,
        # and the ledger's pending tokens and the written total are read in one step.
        pending = self.ledger.pending_tokens(key_id) if self.ledger is not None else 0
        held = self._held.get(key_id, 0)
        # Negative only if the total was pruned while this check waited on a read (a read over
        # PRIMARY_AFTER_WRITE_S long, and 50,000 other keys meanwhile): then what was written
        # during that read is not counted by this one check.
        written_since = max(0, self._written_tokens.get(key_id, 0) - entry.written)
        spent_day, spent_month = entry.spent(utc_day(now), month_start(now), written_since)
        headers: dict[str, str] = {}
        refusal = None
        for period, limit, spent, reset_at in (
            ("day", entry.budget.tokens_per_day, spent_day + pending, next_day_start(now)),
            ("month", entry.budget.tokens_per_month, spent_month + pending, next_month_start(now)),
        ):
            if limit is None:
                continue
            left = max(0, limit - spent - held)
            headers[f"x-budget-limit-tokens-{period}"] = str(limit)
            headers[f"x-budget-remaining-tokens-{period}"] = str(left)
            headers[f"x-budget-reset-tokens-{period}"] = f"{reset_at - now:.3f}s"
            if spent + held >= limit or tokens > left:
                # Only the key's requests in flight stand in the way: they end soon, not at the reset.
                retry = HELD_RETRY_AFTER_S if spent < limit and tokens <= limit - spent else math.ceil(reset_at - now)
                if refusal is None or retry >= refusal[0]:  # the longer wait is the one that decides
                    refusal = (retry, period, limit, left, reset_at)
        if refusal is not None:
            retry, period, limit, left, reset_at = refusal
            headers["Retry-After"] = str(max(1, retry))
            raise APIError(429, _refusal_message(tokens, period, limit, left, held, reset_at), code="budget_exceeded", headers=headers)
        if tokens <= 0:
            return Reservation(headers)
        self._held[key_id] = held + tokens
        return Reservation(headers, key_id, tokens, self._held)

    def held_tokens(self, key_id: str) -> int:
        """What this router's open reservations hold of the key's budget."""
        return self._held.get(key_id, 0)

    def written(self, tokens_by_key: Mapping[str, int]) -> None:
        """The ledger wrote these tokens of these keys to the store (hook it to
        ``UsageLedger.on_written``, which calls it as they stop counting as pending): from now on
        they count through the running total until a read sees them in the store."""
        now = self.monotonic()
        for key_id, tokens in tokens_by_key.items():
            self._written_tokens[key_id] = self._written_tokens.get(key_id, 0) + tokens
            self._written_at[key_id] = now
        if len(self._written_tokens) > self._prune_at:
            self._prune_written(now)

    async def settle(self) -> None:
        """Wait for the reads under way (tests: a background read has nobody waiting on it)."""
        while running := [task for task in self._loading.values() if not task.done()]:
            await asyncio.wait(running)

    def _read_on_its_way(self, key_id: str, entry: _Entry, now: float) -> bool:  # now: monotonic
        """An expired entry still decides while its re-read is under way, for one more
        ``cache_ttl_s``: a slow database (or an outage's connect timeout) must not stall every
        request of a busy key; an idle key's expired entry has no read under way and is waited for."""
        task = self._loading.get(key_id)
        return task is not None and not task.done() and now < entry.expires + self.cache_ttl_s

    def _read(self, key_id: str, now: float) -> asyncio.Task:
        """The read of the key's entry under way, or a new one: one at a time per key."""
        task = self._loading.get(key_id)
        if task is None or task.done():  # done: cancelled before it ran (its loop was closed)
            task = asyncio.get_running_loop().create_task(self._fetch(key_id, now))
            self._loading[key_id] = task
        return task

    async def _fetch(self, key_id: str, now: float) -> _Entry:
        this = asyncio.current_task()
        day, month = utc_day(now), month_start(now)
        stale = self._entries.get(key_id)
        written = self._written_tokens.get(key_id, 0)  # before the read: what it may not see comes after
        try:
            try:
                primary = self.monotonic() - self._written_at.get(key_id, -math.inf) < PRIMARY_AFTER_WRITE_S
                budget, spent_day, spent_month = await asyncio.to_thread(
                    self.store.budget_state, key_id, day=day, month_start=month, primary=primary
                )
                read_at = self.monotonic()
                entry = _Entry(budget, day, month, spent_day, spent_month, written, *self._lifetime(read_at))
            except Exception as err:  # RegistryUnavailable, or any error of the database's: never a 500
                lifetime = self._lifetime(self.monotonic())
                if stale is None or not stale.known:
                    logger.warning(
                        "budget check: usage store unavailable (%s); admitting key %s unchecked", err, key_id
                    )
                    entry = _Entry(None, day, month, 0, 0, written, *lifetime, known=False)
                else:
                    logger.warning(
                        "budget check: usage store unavailable (%s); key %s keeps its last known budget", err, key_id
                    )
                    entry = replace(stale, expires=lifetime[0], refresh_at=lifetime[1])  # its own total
        finally:  # whatever happened, the next check after this one starts a read of its own
            if self._loading.get(key_id) is this:
                del self._loading[key_id]
        self._cache(key_id, entry)
        return entry

    def _lifetime(self, read_at: float) -> tuple[float, float]:
        """When an entry read at ``read_at`` expires, and when its background re-read is due."""
        return read_at + self.cache_ttl_s, read_at + self.cache_ttl_s * REFRESH_AFTER

    def _prune_written(self, now: float) -> None:
        """Forget the running totals no cached entry, no read under way and no write in the last
        ``PRIMARY_AFTER_WRITE_S`` refer to (a read begun later takes the total then), once they
        are too many."""
        keep = {k for k, at in self._written_at.items() if now - at < PRIMARY_AFTER_WRITE_S}
        keep.update(k for k in self._written_tokens if k in self._entries or k in self._loading)
        self._written_tokens = {k: v for k, v in self._written_tokens.items() if k in keep}
        self._written_at = {k: v for k, v in self._written_at.items() if k in keep}
        self._prune_at = max(MAX_ENTRIES, 2 * len(self._written_tokens))  # all in use: not at every write

    def _cache(self, key_id: str, entry: _Entry) -> None:
        if len(self._entries) >= MAX_ENTRIES:
            now = self.monotonic()
            self._entries = {k: e for k, e in self._entries.items() if e.expires > now}
            if len(self._entries) >= MAX_ENTRIES:
                self._entries.clear()
        self._entries[key_id] = entry


def _refusal_message(tokens: int, period: str, limit: int, left: int, held: int, reset_at: float) -> str:
    budget = f"this key's {'daily' if period == 'day' else 'monthly'} token budget ({limit} tokens per UTC {period})"
    resets = f"it resets at {iso_utc(reset_at)}"
    if left == 0 and not held:
        return f"{budget[0].upper()}{budget[1:]} is used up; {resets}."
    if tokens <= 0:
        return f"{budget[0].upper()}{budget[1:]} is reserved in full by its requests in flight ({held} tokens); {resets}."
    in_flight = f" ({held} more are reserved by its requests in flight)" if held else ""
    return (
        f"This request may cost up to {tokens} tokens (its prompt plus n × its completion limit), and "
        f"{budget} has {left} left{in_flight}; lower max_tokens or n, or wait: {resets}."
    )

"""The usage report ``GET /v1/usage`` answers and ``serve-app usage report`` prints: counters from
the ledger's daily rollup over a range of UTC days, grouped by day, month, model, region or key.

``parse_query`` turns the query string into arguments and refuses bad ones with a 400 naming the
parameter; ``usage_report`` reads the store (synchronously: the router runs it on a
``ReportQueue``'s threads, a few at a time).
"""

import asyncio
import csv
import datetime as dt
import functools
import io
import re
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from serve_app.errors import APIError
from serve_app.usage.store import COUNTERS, GROUPS, UsageStore

# A year and a leap day: one report covers at most this many days (the rollup is per day, so a
# bound on days is a bound on the rows a report reads per key, model and region).
MAX_RANGE_DAYS = 366
_DAY = re.compile(r"\d{4}-\d{2}-\d{2}")
# A router's reports at once, and waiting: a report over a year of every key may read for the
# statement timeout (15 s), and on asyncio's default threads (the node's CPU count + 4) a few of
# them held the threads the ledger's writes, the budget reads and the key lookups run on.
REPORT_THREADS = 2
REPORTS_WAITING = 16
# One owner's reports under way (running or waiting) on a router: a tenant firing a dashboard's
# year-long reports at once held every place in the queue, and every other tenant got the 429.
REPORTS_PER_OWNER = 2


class ReportQueue:
    """Reports on threads of their own, ``REPORT_THREADS`` at a time; past ``REPORTS_WAITING``
    more, or ``REPORTS_PER_OWNER`` of one owner's, a 429 (``Retry-After``), not an unbounded
    queue. A report whose client left before its thread took it is dropped; one running finishes
    alone (a thread cannot be stopped)."""

    def __init__(self, threads: int = REPORT_THREADS, waiting: int = REPORTS_WAITING,
                 per_owner: int = REPORTS_PER_OWNER):
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="usage-report")
        self._limit, self._per_owner = threads + waiting, per_owner
        self._under_way = 0
        self._by_owner: dict[str | None, int] = {}

    async def run(self, report: Callable[..., dict[str, Any]], *args: Any, caller_owner: str | None = None,
                  **kwargs: Any) -> dict[str, Any]:
        """``caller_owner``: whose report it is (the caller's key's owner), for its share."""
        if self._under_way >= self._limit:
            raise APIError(429, "too many usage reports are under way on this router; retry in a moment",
                           code="usage_reports_busy", headers={"Retry-After": "1"})
        if self._by_owner.get(caller_owner, 0) >= self._per_owner:
            raise APIError(429, f"{self._per_owner} usage reports of this owner are under way on this router; "
                           "retry when one has answered", code="usage_reports_busy", headers={"Retry-After": "1"})
        self._under_way += 1
        self._by_owner[caller_owner] = self._by_owner.get(caller_owner, 0) + 1
        try:
            work = functools.partial(report, *args, **kwargs)
            return await asyncio.get_running_loop().run_in_executor(self._executor, work)
        finally:
            self._under_way -= 1
            self._by_owner[caller_owner] -= 1
            if not self._by_owner[caller_owner]:
                del self._by_owner[caller_owner]

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_usage_query")


def _day(raw: str, param: str) -> dt.date:
    # fullmatch first: date.fromisoformat also takes 20261201 and other ISO spellings.
    if _DAY.fullmatch(raw):
        try:
            return dt.date.fromisoformat(raw)
        except ValueError:
            pass
    raise _bad(f"{param} must be a UTC day YYYY-MM-DD, not {raw!r}", param)


def parse_query(params: Mapping[str, str], *, today: str) -> tuple[str, str, tuple[str, ...]]:
    """``(since, until, group_by)`` from a query. Defaults: the current month so far (since the
    first of ``today``'s month, until ``today``), grouped by day."""
    until = _day(params["until"], "until") if "until" in params else dt.date.fromisoformat(today)
    since = _day(params["since"], "since") if "since" in params else dt.date.fromisoformat(today).replace(day=1)
    # The field to change is one the caller sent: ``until`` when ``since`` is the default.
    blamed = "since" if "since" in params else "until"
    if since > until:
        raise _bad(f"since ({since}) is after until ({until})", blamed)
    days = (until - since).days + 1
    if days > MAX_RANGE_DAYS:
        raise _bad(f"a report covers at most {MAX_RANGE_DAYS} days; {since}..{until} is {days}", blamed)
    names = [name.strip() for name in params.get("group_by", "day").split(",")]
    unknown = [name for name in names if name not in GROUPS]
    if unknown:
        known, refused = ", ".join(GROUPS), ", ".join(map(repr, unknown))
        raise _bad(f"group_by takes a comma-separated list of {known}; unknown: {refused}", "group_by")
    return since.isoformat(), until.isoformat(), tuple(dict.fromkeys(names))  # duplicates once


def usage_report(
    store: UsageStore,
    *,
    key_id: str | None,
    since: str,
    until: str,
    group_by: tuple[str, ...],
    owner: str | None = None,
) -> dict[str, Any]:
    """The report object: its rows, and their totals. ``key_id`` None: every key's usage (never
    "", which names no key); ``owner``: only that owner's (an owner admin's view,
    ``serve_app.auth.admin.usage_filter``)."""
    if key_id == "":
        raise ValueError("key_id '' names no key: None is every key's report")
    rows = store.totals(key_id=key_id, since=since, until=until, group_by=group_by, owner=owner)
    return report_of(rows, key_id=key_id, since=since, until=until, group_by=group_by, owner=owner)


def report_of(rows: list[dict[str, Any]], *, key_id: str | None, since: str, until: str, group_by: tuple[str, ...],
              owner: str | None) -> dict[str, Any]:
    """The report object of ``rows`` (``[]``: the report of a key with no usage, or of one the
    caller may not see, which must look the same)."""
    return {
        "object": "usage.report",
        "key_id": key_id,
        "owner": owner,
        "since": since,
        "until": until,
        "group_by": list(group_by),
        "data": rows,
        "totals": {counter: sum(row[counter] for row in rows) for counter in COUNTERS},
    }


def to_csv(report: Mapping[str, Any]) -> str:
    """The report's rows as CSV: the group columns, then the counters (totals are left out: a
    spreadsheet sums them, and a totals row would be summed twice)."""
    columns = [*report["group_by"], *COUNTERS]
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(columns)
    writer.writerows([row[column] for column in columns] for row in report["data"])
    return out.getvalue()

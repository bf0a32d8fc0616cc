"""Usage metering on the router: a budget check before a request is admitted, and one usage record
when each admitted inference request is over (serve_app/usage/: ledger, budgets, reports).

Which requests are recorded: every chat, completions, Responses and Messages request that passed
authentication, validation, the rate limit and the budget — once it is over, whatever its status:
finished, refused by the engine (400), cut by an engine fault (503), or abandoned by its client
(499). Counting tokens (``count_tokens``, ``/tokenize``) generates nothing and is not recorded.

The tokens recorded: the engine's usage when the answer finished, else the replica's own count of
what the engine generated (``engine/token_count.py``) — a stream the client left after N tokens is
recorded with N. A non-stream request whose client left is cancelled with its handle call and
recorded with the tokens its trailer never brought: zero (docs/usage.md).

A request failed over to a peer region is recorded once, by the region that served it (the peer,
with ``failover_origin`` naming this region); this region records it only when no peer did.
"""

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from fastapi.responses import JSONResponse, PlainTextResponse, Response

from serve_app.auth.principal import Principal
from serve_app.auth.keys import ALL, SCOPE_ADMIN, SCOPE_INFERENCE
from serve_app.errors import APIError
from serve_app.router.relay import Exchange
from serve_app.usage import report
from serve_app.usage.budgets import BudgetGuard
from serve_app.usage.ledger import UsageLedger
from serve_app.usage.records import UsageRecord, utc_day
from serve_app.usage.store import UsageStore
from serve_app.telemetry.logs import module_logger

logger = module_logger(__name__)


class Meter:
    def __init__(
        self, store: UsageStore, spool_dir: Path, *, region: str, writer_id: str, cache_ttl_s: float,
        flush_interval_s: float = 1.0,
    ):
        self.region = region
        self.ledger = UsageLedger(store, spool_dir, writer_id=writer_id, flush_interval_s=flush_interval_s)
        self.budgets = BudgetGuard(store, self.ledger, cache_ttl_s=cache_ttl_s)
        self.ledger.on_written = self.budgets.forget  # a written batch: its keys' spend is re-read
        self.store = store

    def start(self) -> None:
        """Begin writing records in the background (call inside the router's event loop)."""
        self.ledger.start()

    async def aclose(self) -> None:
        """Write what is pending (to the database, or to the spool if it is down)."""
        await self.ledger.aclose()

    async def check_budget(self, caller: Principal) -> dict[str, str]:
        """The caller's ``x-budget-*`` headers, or 429 ``budget_exceeded`` until its reset."""
        return await self.budgets.check(caller.key_id)

    def biller(self, caller: Principal, origin: str | None) -> Callable[[Exchange], None]:
        """What records ``caller``'s request when it is over; ``origin``: the region that
        forwarded it here, if one did."""

        def bill(exchange: Exchange) -> None:
            record = exchange.record
            if origin is not None and record.status == 503 and record.model_replica is None:
                return  # forwarded here and not served either: the forwarding region records its 503
            try:
                self.ledger.record(usage_record(exchange, caller, region=self.region, origin=origin))
            except Exception:  # metering must never fail the request it meters
                logger.exception("could not record usage of request %s", exchange.id)

        return bill


def usage_record(exchange: Exchange, caller: Principal, *, region: str, origin: str | None) -> UsageRecord:
    record = exchange.record
    counted: Mapping[str, Any] = exchange.generated or {}
    # The engine's usage when the answer finished; the replica's count when it did not.
    finished = record.output_tokens is not None
    prompt = record.input_tokens if finished and record.input_tokens is not None else counted.get("prompt_tokens")
    completion = record.output_tokens if finished else counted.get("completion_tokens")
    started_ms = record.start_ns // 1_000_000
    return UsageRecord(
        id=exchange.id,
        key_id=caller.key_id,
        owner=caller.owner,
        region=region,
        model=record.model or "",
        route=record.route,
        prompt_tokens=int(prompt or 0),
        completion_tokens=int(completion or 0),
        cached_tokens=int(counted.get("cached_tokens") or 0),
        status=record.status,
        finish_reason=record.finish_reasons[0] if record.finish_reasons else None,
        started_at_ms=started_ms,
        ended_at_ms=started_ms + round(record.server_ms or 0),
        failover_origin=origin,
    )


async def usage_report(meter: Meter, caller_of: Callable[[str], Awaitable[Principal]], params: Mapping[str, str]) -> Response:
    """``GET /v1/usage``: a key's own totals; with ``key_id`` (one key, or ``*`` for all), an
    admin's view. ``caller_of(scope)`` authenticates the request for that scope."""
    key_id = params.get("key_id")
    caller = await caller_of(SCOPE_INFERENCE if key_id is None else SCOPE_ADMIN)
    since, until, group_by = report.parse_query(params, today=utc_day(time.time()))
    fmt = params.get("format", "json")
    if fmt not in ("json", "csv"):
        raise APIError(400, f"format must be json or csv, not {fmt!r}", param="format", code="invalid_usage_query")
    target = caller.key_id if key_id is None else (None if key_id == ALL else key_id)
    answer = await asyncio.to_thread(
        report.usage_report, meter.store, key_id=target, since=since, until=until, group_by=group_by
    )
    if fmt == "csv":
        return PlainTextResponse(report.to_csv(answer), media_type="text/csv")
    return JSONResponse(answer)

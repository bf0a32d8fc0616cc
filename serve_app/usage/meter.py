"""Usage metering on the router: a budget check before a request is admitted, and one usage record
when each admitted request that generates is over (ledger, budgets, reports: this room).

Which requests are recorded: every chat, completions, Responses and Messages request that passed
authentication, validation, the rate limit and the budget — once it is over, whatever its status:
finished, refused by the engine (400), cut by an engine fault (503), or abandoned by its client
(499). Counting tokens (``count_tokens``, ``/tokenize``) generates nothing and is not recorded.

The tokens recorded: the engine's usage when the answer finished, else the replica's own count of
what the engine generated (``engine/token_count.py``) — a request whose client left after N tokens
is recorded with N, stream or not.

A request failed over to a peer region is recorded once, by the region that served it (the peer,
with ``failover_origin`` naming this region); this region records it only when no peer did.
"""

from pathlib import Path

from serve_app.auth.principal import Principal
from serve_app.telemetry.logs import module_logger
from serve_app.telemetry.timing import RequestRecord
from serve_app.usage.budgets import BudgetGuard, Reservation
from serve_app.usage.ledger import UsageLedger
from serve_app.usage.records import UsageRecord
from serve_app.usage.store import UsageStore
from serve_app.wire.messages import Generated

logger = module_logger(__name__)


class Meter:
    def __init__(
        self, store: UsageStore, spool_dir: Path, *, region: str, writer_id: str, cache_ttl_s: float,
        flush_interval_s: float = 1.0,
    ):
        self.region = region
        self.ledger = UsageLedger(store, spool_dir, writer_id=writer_id, flush_interval_s=flush_interval_s)
        self.budgets = BudgetGuard(store, self.ledger, cache_ttl_s=cache_ttl_s)
        self.ledger.on_written = self.budgets.written  # a written batch counts in its running total
        self.store = store

    def start(self) -> None:
        """Begin writing records in the background (call inside the router's event loop)."""
        self.ledger.start()

    async def aclose(self) -> None:
        """Write what is pending (to the database, or to the spool if it is down)."""
        await self.ledger.aclose()

    async def reserve(self, caller: Principal, tokens: int) -> Reservation:
        """Hold ``tokens`` against the caller's token budget (its ``x-budget-*`` headers on the
        reservation), or 429 ``budget_exceeded``: spent, or too little left for this request."""
        return await self.budgets.reserve(caller.key_id, tokens)

    def record(self, record_id: str, caller: Principal, request: RequestRecord, generated: Generated | None,
               *, origin: str | None, stored_bytes: int = 0, resumes: int = 0,
               resume_prompt_tokens: int = 0) -> UsageRecord | None:
        """Queue the usage record of one admitted request that is over, and return it (None: not
        recorded here). ``origin``: the region that forwarded it here, if one did."""
        if origin is not None and request.status == 503 and request.model_replica is None:
            return None  # forwarded here and not served either: the forwarding region records its 503
        try:
            record = usage_record(record_id, caller, request, generated, region=self.region, origin=origin,
                                  stored_bytes=stored_bytes, resumes=resumes,
                                  resume_prompt_tokens=resume_prompt_tokens)
            self.ledger.record(record)
        except Exception:  # metering must never fail the request it meters
            logger.exception("could not record usage of request %s", record_id)
            return None
        return record


def usage_record(record_id: str, caller: Principal, request: RequestRecord, generated: Generated | None,
                 *, region: str, origin: str | None, stored_bytes: int = 0, resumes: int = 0,
                 resume_prompt_tokens: int = 0) -> UsageRecord:
    counted = generated or Generated()
    # The engine's usage when the answer finished; the replica's count when it did not.
    finished = request.output_tokens is not None
    prompt = request.input_tokens if finished and request.input_tokens is not None else counted.prompt_tokens
    completion = request.output_tokens if finished else counted.completion_tokens
    started_ms = request.start_ns // 1_000_000
    return UsageRecord(
        id=record_id,
        key_id=caller.key_id,
        owner=caller.owner,
        region=region,
        model=request.model or "",
        route=request.route,
        prompt_tokens=int(prompt or 0),
        completion_tokens=int(completion or 0),
        cached_tokens=int(counted.cached_tokens or 0),
        status=request.status,
        finish_reason=request.finish_reasons[0] if request.finish_reasons else None,
        started_at_ms=started_ms,
        ended_at_ms=started_ms + round(request.server_ms or 0),
        failover_origin=origin,
        stored_bytes=stored_bytes,
        resumes=resumes,
        resume_prompt_tokens=resume_prompt_tokens,
        resumed_in=request.resumed_in,
    )

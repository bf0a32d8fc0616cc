"""``serve-app usage``: the usage report, and per-key token budgets.

Both act on the key registry the main CLI's ``--config`` / ``--key-store`` name (the ledger lives
in the same database), through the main CLI's context: nothing here decides where that is.
``usage report`` is the same report as ``GET /v1/usage``; budgets reach every router within its
budget cache's TTL (5 s).
"""

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from typing import Annotated, Any, NoReturn

import typer

from serve_app.auth.database import RegistryUnavailable
from serve_app.auth.keys import KeyStore
from serve_app.errors import APIError
from serve_app.usage.budgets import iso_utc, month_start, next_day_start, next_month_start
from serve_app.usage.records import utc_day
from serve_app.usage.report import parse_query, to_csv, usage_report
from serve_app.usage.store import COUNTERS, Budget, UsageStore

usage_app = typer.Typer(
    no_args_is_help=True, help="Token usage reports and per-key token budgets (UTC days and months)."
)
budget_app = typer.Typer(no_args_is_help=True, help="Set, show and clear a key's token budget per UTC day and month.")
usage_app.add_typer(budget_app, name="budget")

MAX_BUDGET = 2**63 - 1


class Format(str, Enum):
    table = "table"
    json = "json"
    csv = "csv"


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


@contextmanager
def _registry(ctx: typer.Context) -> Iterator[tuple[KeyStore, UsageStore]]:
    """The key store (from the main CLI's context) and the ledger in its database; an outage is
    a one-line error, not a traceback."""
    keys = ctx.obj.store()
    try:
        yield keys, UsageStore(keys.database)
    except RegistryUnavailable as err:
        _fail(str(err))


def _known(keys: KeyStore, key_id: str) -> None:
    # Keys are revoked, never deleted: an id the registry does not know is a typo.
    if keys.get(key_id) is None:
        _fail(f"no key {key_id!r}")


# --- report --------------------------------------------------------------------------------------
@usage_app.command("report")
def report(
    ctx: typer.Context,
    key: Annotated[str | None, typer.Option("--key", help="Only this key id; default: every key.")] = None,
    since: Annotated[str | None, typer.Option(help="First UTC day, YYYY-MM-DD; default: the 1st of the month.")] = None,
    until: Annotated[str | None, typer.Option(help="Last UTC day, YYYY-MM-DD; default: today.")] = None,
    by: Annotated[str, typer.Option("--by", help="Group by (comma-separated): day,month,model,region,key_id.")] = "day",
    output: Annotated[Format, typer.Option("--format", help="table, json (as GET /v1/usage) or csv.")] = Format.table,
) -> None:
    """Tokens and requests over a range of UTC days, from the ledger's daily rollup."""
    query = {name: value for name, value in (("since", since), ("until", until), ("group_by", by)) if value is not None}
    try:
        first, last, group_by = parse_query(query, today=utc_day(time.time()))
    except APIError as err:
        _fail(f"--{'by' if err.param == 'group_by' else err.param}: {err.message}")
    with _registry(ctx) as (keys, usage):
        if key is not None:
            _known(keys, key)
        result = usage_report(usage, key_id=key, since=first, until=last, group_by=group_by)
    if output is Format.json:
        typer.echo(json.dumps(result, indent=2))
    elif output is Format.csv:
        typer.echo(to_csv(result), nl=False)
    else:
        typer.echo(_table(result))


def _table(result: dict[str, Any]) -> str:
    """Aligned columns (groups left, counters right) and a totals line."""
    groups = result["group_by"]
    headers = [c.replace("_", " ").upper() for c in (*groups, *COUNTERS)]
    rows = [[str(row[c]) for c in (*groups, *COUNTERS)] for row in result["data"]]
    total = ["total", *[""] * (len(groups) - 1), *(str(result["totals"][c]) for c in COUNTERS)]
    widths = [max(len(cells[i]) for cells in (headers, *rows, total)) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        aligned = [cell.ljust(w) if i < len(groups) else cell.rjust(w) for i, (cell, w) in enumerate(zip(cells, widths))]
        return "  ".join(aligned).rstrip()

    scope = f"key {result['key_id']}" if result["key_id"] else "every key"
    title = f"usage of {scope}, {result['since']} .. {result['until']} (UTC)"
    return "\n".join([title, line(headers), *map(line, rows), line(total)])


# --- budgets -------------------------------------------------------------------------------------
def _limits(budget: Budget) -> str:
    periods = (("day", "daily", budget.tokens_per_day), ("month", "monthly", budget.tokens_per_month))
    return ", ".join(
        f"{limit} tokens per UTC {period}" if limit is not None else f"no {adjective} limit"
        for period, adjective, limit in periods
    )


@budget_app.command("set")
def budget_set(
    ctx: typer.Context,
    key_id: str,
    # At most a BIGINT (the registry's column): past it, a clean error, not the database's traceback.
    per_day: Annotated[int | None, typer.Option("--per-day", min=0, max=MAX_BUDGET, help="Tokens per UTC day.")] = None,
    per_month: Annotated[int | None, typer.Option("--per-month", min=0, max=MAX_BUDGET,
                                                  help="Tokens per UTC month.")] = None,
) -> None:
    """Set KEY_ID's budget to exactly these limits (a period left out has no limit); prompt +
    completion tokens, counted across every region."""
    if per_day is None and per_month is None:
        _fail("give --per-day, --per-month or both (`usage budget clear` removes a budget)")
    with _registry(ctx) as (keys, usage):
        _known(keys, key_id)
        budget = usage.set_budget(key_id, tokens_per_day=per_day, tokens_per_month=per_month)
    typer.echo(f"budget of {key_id}: {_limits(budget)}")


@budget_app.command("show")
def budget_show(ctx: typer.Context, key_id: str) -> None:
    """KEY_ID's budget, what it used today and this month, and when each period resets."""
    now = time.time()
    with _registry(ctx) as (keys, usage):
        _known(keys, key_id)
        budget = usage.budget(key_id)
        used = {"day": usage.spent(key_id, utc_day(now)), "month": usage.spent(key_id, month_start(now))}
    typer.echo(f"budget of {key_id}: {_limits(budget) if budget else 'none (its tokens are not limited)'}")
    for period, reset_at in (("day", next_day_start(now)), ("month", next_month_start(now))):
        limit = getattr(budget, f"tokens_per_{period}", None)
        left = f" of {limit} ({max(0, limit - used[period])} left)" if limit is not None else ""
        typer.echo(f"  this {period}: {used[period]} tokens used{left}; resets {iso_utc(reset_at)}")


@budget_app.command("clear")
def budget_clear(ctx: typer.Context, key_id: str) -> None:
    """Remove KEY_ID's budget: its tokens are no longer limited by day or month."""
    with _registry(ctx) as (keys, usage):
        _known(keys, key_id)
        cleared = usage.clear_budget(key_id)
    typer.echo(f"cleared the budget of {key_id}" if cleared else f"{key_id} had no budget")

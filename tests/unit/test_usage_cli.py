"""The usage report (``GET /v1/usage``'s query and body) and ``serve-app usage`` against a real
key store, through the main CLI exactly as an operator runs it."""

import csv
import io
import json
import time

import pytest
from typer.testing import CliRunner

from serve_app.auth.database import open_database
from serve_app.cli import app
from serve_app.errors import APIError
from serve_app.usage.records import utc_day
from serve_app.usage.report import parse_query, to_csv, usage_report
from serve_app.usage.store import UsageStore
from test_usage_store import usage_record


# --- the report ------------------------------------------------------------------------------------
def test_the_query_defaults_to_this_month_so_far_by_day():
    assert parse_query({}, today="2026-12-17") == ("2026-12-01", "2026-12-17", ("day",))
    assert parse_query({"since": "2025-12-17", "until": "2026-12-17", "group_by": " model,region,model"}, today="2026-12-17") == (
        "2025-12-17", "2026-12-17", ("model", "region")
    )


@pytest.mark.parametrize(
    "params, param",
    [
        ({"since": "2026-13-01"}, "since"),
        ({"since": "20261201"}, "since"),  # an ISO spelling, but not a YYYY-MM-DD day
        ({"until": "2026-02-30"}, "until"),
        ({"until": ""}, "until"),
        ({"since": "2026-12-10", "until": "2026-12-09"}, "since"),
        ({"since": "2025-12-16", "until": "2026-12-17"}, "since"),  # 367 days
        ({"until": "2026-11-30"}, "until"),  # before the default since (the month's first): the one sent
        ({"until": "2028-01-01"}, "until"),  # more than a year after it
        ({"group_by": "day,owner"}, "group_by"),
        ({"group_by": ""}, "group_by"),
    ],
)
def test_a_bad_query_is_a_400_naming_its_parameter(params, param):
    with pytest.raises(APIError) as refused:
        parse_query(params, today="2026-12-17")
    assert refused.value.status == 400 and refused.value.param == param
    assert refused.value.code == "invalid_usage_query" and refused.value.body()["error"]["type"] == "invalid_request_error"


def test_the_report_has_its_rows_and_their_totals_and_csv_has_the_rows(tmp_path):
    store = UsageStore(open_database(tmp_path / "registry.sqlite3", create=True))
    store.insert([usage_record(day="2026-12-01"), usage_record(day="2026-12-02", cached=10, stored_bytes=900), usage_record(key_id="k2")])
    report = usage_report(store, key_id="k1", since="2026-12-01", until="2026-12-31", group_by=("day",))
    assert report["object"] == "usage.report" and report["key_id"] == "k1" and report["group_by"] == ["day"]
    assert [row["day"] for row in report["data"]] == ["2026-12-01", "2026-12-02"]
    assert report["totals"] == {
        "requests": 2, "prompt_tokens": 200, "completion_tokens": 40, "cached_tokens": 10, "total_tokens": 240, "stored_bytes": 900,
    }
    everyone = usage_report(store, key_id=None, since="2026-12-01", until="2026-12-01", group_by=("key_id",))
    assert everyone["key_id"] is None and [row["key_id"] for row in everyone["data"]] == ["k1", "k2"]
    rows = list(csv.reader(io.StringIO(to_csv(report))))
    assert rows[0] == ["day", "requests", "prompt_tokens", "completion_tokens", "cached_tokens", "total_tokens", "stored_bytes"]
    assert rows[2] == ["2026-12-02", "1", "100", "20", "10", "120", "900"] and len(rows) == 3


# --- the CLI ---------------------------------------------------------------------------------------
@pytest.fixture
def cli(tmp_path):
    path = tmp_path / "keys.sqlite3"
    runner = CliRunner()

    def run(*argv: str, ok: bool = True):
        result = runner.invoke(app, ["--key-store", str(path), *argv])
        assert (result.exit_code == 0) is ok, result.output
        return result

    run.key_id = run("keys", "create", "--owner", "acme").stdout.strip().split("_")[1]
    run.store = UsageStore(open_database(path))
    return run


def _usage(cli):
    cli.store.insert([
        usage_record(key_id=cli.key_id, day="2026-12-01", prompt=1000, completion=200),
        usage_record(key_id=cli.key_id, day="2026-12-01", model="small", prompt=10, completion=2),
        usage_record(key_id=cli.key_id, day="2026-12-02", prompt=5, completion=1, stored_bytes=2048),
        usage_record(key_id="someone-else", day="2026-12-01"),
    ])

def test_reports_run_a_few_at_a_time_on_their_own_threads_and_a_full_queue_is_a_429():
    """One thread and one waiting: a third report at once is refused with a 429 saying to retry,
    not queued without bound (nor run on the threads the ledger and the budgets use); once the
    first ends, reports run again."""
    import asyncio
    import threading

    from serve_app.usage.report import ReportQueue

    release, ran_on = threading.Event(), []

    def report(name):
        ran_on.append(threading.current_thread().name)
        release.wait(5)
        return {"name": name}

    async def scenario():
        queue = ReportQueue(threads=1, waiting=1)
        first = asyncio.ensure_future(queue.run(report, "first"))
        second = asyncio.ensure_future(queue.run(report, "second"))
        await asyncio.sleep(0)
        with pytest.raises(APIError) as busy:
            await queue.run(report, "third")
        release.set()
        answers = [await first, await second, await queue.run(report, "after")]
        queue.close()
        return busy.value, answers

    busy, answers = asyncio.run(scenario())
    assert (busy.status, busy.code, busy.headers) == (429, "usage_reports_busy", {"Retry-After": "1"})
    assert [a["name"] for a in answers] == ["first", "second", "after"]
    assert len(ran_on) == 3 and all(name.startswith("usage-report") for name in ran_on)


def test_one_owners_reports_take_at_most_their_share_of_the_queue():
    """A tenant firing a dashboard's year-long reports at once held every place, and every other
    tenant got the 429."""
    import asyncio
    import threading

    from serve_app.usage.report import ReportQueue

    release = threading.Event()

    def report(name):
        release.wait(5)
        return {"name": name}

    async def scenario():
        queue = ReportQueue(threads=1, waiting=8, per_owner=2)
        mine = [asyncio.ensure_future(queue.run(report, f"acme-{i}", caller_owner="acme")) for i in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(APIError) as busy:
            await queue.run(report, "acme-2", caller_owner="acme")
        theirs = asyncio.ensure_future(queue.run(report, "globex", caller_owner="globex"))
        await asyncio.sleep(0)
        release.set()
        answers = [await task for task in (*mine, theirs)]
        again = await queue.run(report, "acme-3", caller_owner="acme")  # its share is free again
        queue.close()
        return busy.value, answers, again

    busy, answers, again = asyncio.run(scenario())
    assert (busy.status, busy.code, busy.headers) == (429, "usage_reports_busy", {"Retry-After": "1"})
    assert "of this owner" in busy.message
    assert [a["name"] for a in answers] == ["acme-0", "acme-1", "globex"] and again["name"] == "acme-3"


def test_a_report_whose_client_left_before_its_turn_never_reads_the_database():
    import asyncio
    import threading

    from serve_app.usage.report import ReportQueue

    release, ran = threading.Event(), []

    def report(name):
        ran.append(name)
        release.wait(5)
        return {}

    async def scenario():
        queue = ReportQueue(threads=1, waiting=4)
        running = asyncio.ensure_future(queue.run(report, "running"))
        waiting = asyncio.ensure_future(queue.run(report, "left"))
        await asyncio.sleep(0)  # both handed to the executor: "left" waits behind "running"
        waiting.cancel()  # its client disconnected while it waited for the thread
        release.set()
        await running
        await queue.run(report, "after")  # the executor runs in order: "left" would have run first
        queue.close()

    asyncio.run(scenario())
    assert ran == ["running", "after"]



def test_report_as_json_is_the_http_routes_report(cli):
    _usage(cli)
    argv = ["usage", "report", "--key", cli.key_id, "--since", "2026-12-01", "--until", "2026-12-31", "--by", "day,model"]
    report = json.loads(cli(*argv, "--format", "json").stdout)
    assert report == usage_report(cli.store, key_id=cli.key_id, since="2026-12-01", until="2026-12-31", group_by=("day", "model"))
    assert [(r["day"], r["model"], r["total_tokens"]) for r in report["data"]] == [
        ("2026-12-01", "qwen-3.6-35b-a3b", 1200), ("2026-12-01", "small", 12), ("2026-12-02", "qwen-3.6-35b-a3b", 6)
    ]
    rows = list(csv.DictReader(io.StringIO(cli(*argv, "--format", "csv").stdout)))
    assert [row["total_tokens"] for row in rows] == ["1200", "12", "6"] and rows[1]["model"] == "small"


def test_report_as_a_table_is_aligned_with_a_totals_line(cli):
    _usage(cli)
    table = cli("usage", "report", "--since", "2026-12-01", "--until", "2026-12-02", "--by", "key_id").stdout.splitlines()
    assert table[0] == "usage of every key, 2026-12-01 .. 2026-12-02 (UTC)"
    header, *rows, total = table[1:]
    assert header.split() == [
        "KEY", "ID", "REQUESTS", "PROMPT", "TOKENS", "COMPLETION", "TOKENS", "CACHED", "TOKENS", "TOTAL", "TOKENS", "STORED", "BYTES",
    ]
    assert [row.split()[0] for row in rows] == [cli.key_id, "someone-else"]
    assert total.split() == ["total", "4", "1115", "223", "0", "1338", "2048"]
    end = header.index("STORED BYTES") + len("STORED BYTES")
    assert all(len(line) == end for line in (header, *rows, total))  # right-aligned counters end together


def test_report_refuses_bad_options_and_unknown_keys(cli):
    assert "--since" in cli("usage", "report", "--since", "yesterday", ok=False).output
    assert "--by" in cli("usage", "report", "--by", "owner", ok=False).output
    assert "no key 'ffffffffffff'" in cli("usage", "report", "--key", "ffffffffffff", ok=False).output


def test_budgets_are_set_shown_and_cleared_for_known_keys_only(cli):
    assert "no budget" in cli("usage", "budget", "clear", cli.key_id).stdout
    shown = cli("usage", "budget", "show", cli.key_id).stdout
    assert "none (its tokens are not limited)" in shown
    out = cli("usage", "budget", "set", cli.key_id, "--per-day", "1000", "--per-month", "20000").stdout
    assert "1000 tokens per UTC day, 20000 tokens per UTC month" in out
    budget = cli.store.budget(cli.key_id)
    assert (budget.tokens_per_day, budget.tokens_per_month) == (1000, 20000)
    assert "1000 tokens per UTC day, no monthly limit" in cli("usage", "budget", "set", cli.key_id, "--per-day", "1000").stdout
    assert cli.store.budget(cli.key_id).tokens_per_month is None

    cli.store.insert([usage_record(key_id=cli.key_id, day=utc_day(time.time()), at="00:00:00", prompt=300, completion=0)])
    shown = cli("usage", "budget", "show", cli.key_id).stdout
    assert "this day: 300 tokens used of 1000 (700 left)" in shown and "this month: 300 tokens used;" in shown

    assert "cleared" in cli("usage", "budget", "clear", cli.key_id).stdout and cli.store.budget(cli.key_id) is None
    for argv in (("set", "ffffffffffff", "--per-day", "1"), ("show", "ffffffffffff"), ("clear", "ffffffffffff")):
        assert "no key 'ffffffffffff'" in cli("usage", "budget", *argv, ok=False).output
    assert "--per-day, --per-month" in cli("usage", "budget", "set", cli.key_id, ok=False).output
    assert cli("usage", "budget", "set", cli.key_id, "--per-day", "-5", ok=False).exit_code == 2  # typer's range check
    past_bigint = cli("usage", "budget", "set", cli.key_id, "--per-month", str(2**63), ok=False)
    assert past_bigint.exit_code == 2 and "Traceback" not in past_bigint.output  # not the database's overflow
    assert cli.store.budget(cli.key_id) is None

"""The usage ledger's writer against real databases: batches off the request path, a spool when
the database is away, and a replay that writes each record exactly once."""

import asyncio
import json
import logging
import os
import stat
import threading
import time
from pathlib import Path

import pytest

from serve_app.usage.ledger import UsageLedger
from serve_app.usage.store import UsageStore
from test_usage_store import open_test_database, unreachable, usage_record


class CountingStore(UsageStore):
    """The real store, remembering the record ids of every insert it was asked to do."""

    def __init__(self, database):
        super().__init__(database)
        self.batches: list[list[str]] = []

    def insert(self, records):
        records = list(records)
        self.batches.append([r.id for r in records])
        return super().insert(records)

    def sizes(self) -> list[int]:
        return [len(batch) for batch in self.batches]


@pytest.fixture(params=["sqlite", "postgres"])
def store(request, tmp_path) -> CountingStore:
    return CountingStore(open_test_database(request, tmp_path))


def _requests(store, key_id=None) -> int:
    rows = store.totals(key_id=key_id, since="2026-01-01", until="2026-12-31", group_by=("key_id",))
    return sum(row["requests"] for row in rows)


def _spool_files(path):
    return sorted(p.name for p in path.iterdir()) if path.exists() else []


async def _until(condition, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_records_are_written_in_batches_off_the_request_path(store, tmp_path):
    ledger = UsageLedger(store, tmp_path / "spool", writer_id="router-a", flush_interval_s=0.05)
    written_keys = []
    ledger.on_written = written_keys.append

    async def main():
        ledger.start()
        for i in range(5):
            ledger.record(usage_record(key_id=f"k{i % 2}"))
        assert ledger.pending_tokens("k0") == 3 * 120 and ledger.pending_tokens("k1") == 2 * 120
        await _until(lambda: ledger.written == 5)
        await ledger.aclose()

    asyncio.run(main())
    assert store.sizes() == [5]  # one transaction for the five
    assert _requests(store, "k0") == 3 and _requests(store, "k1") == 2
    assert ledger.pending_tokens("k0") == 0 and written_keys == [{"k0": 3 * 120, "k1": 2 * 120}]
    assert ledger.spooled == 0 and not (tmp_path / "spool").exists()  # made only when needed


def test_a_full_batch_is_written_before_the_interval_and_in_max_batch_pieces(store, tmp_path):
    ledger = UsageLedger(store, tmp_path / "spool", writer_id="a", flush_interval_s=30, max_batch=3)

    async def main():
        ledger.start()
        for _ in range(3):
            ledger.record(usage_record())
        await _until(lambda: ledger.written == 3, timeout_s=2)  # far sooner than 30 s
        for _ in range(7):  # recorded while nothing runs: written 3 + 3 + 1 on close
            ledger.record(usage_record())
        await ledger.aclose()

    asyncio.run(main())
    assert store.sizes()[0] == 3 and sorted(store.sizes()[1:]) == [1, 3, 3] and _requests(store) == 10


def test_a_failed_write_is_spooled_then_replayed_exactly_once_after_recovery(store, tmp_path, caplog):
    spool = tmp_path / "spool"
    working = store.database
    store.database = unreachable(working)
    ledger = UsageLedger(store, spool, writer_id="SERVE_REPLICA::router#1", flush_interval_s=0.05)
    lost = [usage_record(key_id="k1"), usage_record(key_id="k1"), usage_record(key_id="k2")]

    async def outage():
        for r in lost:
            ledger.record(r)
        with caplog.at_level(logging.WARNING, logger="ray.serve"):
            await ledger.flush()

    asyncio.run(outage())
    assert ledger.spooled == 3 and ledger.written == 0 and "spooling them" in caplog.text
    (name,) = _spool_files(spool)
    assert name.startswith("SERVE_REPLICA__router_1-") and name.endswith(".jsonl")
    assert stat.S_IMODE(os.stat(spool).st_mode) == 0o700
    assert [json.loads(line)["id"] for line in (spool / name).read_text().splitlines()] == [r.id for r in lost]
    assert ledger.pending_tokens("k1") == 240  # not in the database yet: still this router's to count

    store.database = working
    # The database was away: the record goes to the spool first, and the replay is the try.
    asyncio.run(_record_and_flush(ledger, usage_record(key_id="k3")))
    assert ledger.written == 0 and ledger.replayed == 4 and _spool_files(spool) == [] and not ledger.database_away
    assert _requests(store, "k1") == 2 and _requests(store, "k2") == 1 and _requests(store) == 4
    assert ledger.pending_tokens("k1") == 0
    asyncio.run(_record_and_flush(ledger, usage_record(key_id="k3")))
    assert ledger.written == 1  # back: written at once

    (spool / f"other-{time.time_ns()}.jsonl").write_text("".join(json.dumps(r.to_json()) + "\n" for r in lost))
    asyncio.run(_record_and_flush(ledger, usage_record(key_id="k3")))  # the same file replayed again
    assert _requests(store) == 6 and _spool_files(spool) == []


async def _record_and_flush(ledger, *records):
    """Record, flush, and wait for the flush's try of a database that was away (``_probe``)."""
    for r in records:
        ledger.record(r)
    await ledger.flush()
    if ledger._probe is not None:
        await ledger._probe


def test_a_dead_replicas_spool_is_replayed_by_another_and_its_owner_notices(store, tmp_path):
    spool = tmp_path / "spool"
    working = store.database
    store.database = unreachable(working)
    dying = UsageLedger(store, spool, writer_id="a")
    asyncio.run(_record_and_flush(dying, usage_record(key_id="k1")))
    assert dying.spooled == 1 and dying.pending_tokens("k1") == 120

    store.database = working
    survivor = UsageLedger(store, spool, writer_id="b")
    asyncio.run(_record_and_flush(survivor, usage_record(key_id="k2")))
    assert survivor.replayed == 1 and _requests(store, "k1") == 1 and _spool_files(spool) == []
    assert survivor.pending_tokens("k1") == 0  # never its own to count

    # Back from a partition: its file is gone, so its spend is in the database now.
    asyncio.run(_record_and_flush(dying, usage_record(key_id="k2")))  # spooled (it had the database away), replayed
    assert dying.pending_tokens("k1") == 0 and dying.replayed == 1 and _requests(store) == 3


def test_two_replicas_replaying_one_file_at_once_write_each_record_once(store, tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    left = [usage_record(key_id="k1") for _ in range(50)]
    (spool / f"dead-{time.time_ns()}.jsonl").write_text("".join(json.dumps(r.to_json()) + "\n" for r in left))
    first, second = (UsageLedger(store, spool, writer_id=w) for w in ("a", "b"))

    async def main():
        first.record(usage_record(key_id="k2"))
        second.record(usage_record(key_id="k2"))
        await asyncio.gather(first.flush(), second.flush())

    asyncio.run(main())
    assert _requests(store, "k1") == 50 and _requests(store, "k2") == 2 and _spool_files(spool) == []
    assert first.replayed + second.replayed >= 50


def test_a_corrupt_spool_line_is_skipped_and_the_rest_is_replayed(store, tmp_path, caplog):
    spool = tmp_path / "spool"
    spool.mkdir()
    good = [usage_record(key_id="k1"), usage_record(key_id="k1")]
    mistyped = {**usage_record().to_json(), "prompt_tokens": "lots"}
    lines = [json.dumps(good[0].to_json()), '{"id": "trunc', json.dumps(mistyped), "[1, 2]", "", json.dumps(good[1].to_json())]
    (spool / f"a-{time.time_ns()}.jsonl").write_text("\n".join(lines) + "\n")
    ledger = UsageLedger(store, spool, writer_id="b")
    with caplog.at_level(logging.ERROR, logger="ray.serve"):
        asyncio.run(_record_and_flush(ledger, usage_record(key_id="k2")))
    assert _requests(store, "k1") == 2 and _requests(store) == 3 and _spool_files(spool) == []
    assert sum("skipping corrupt line" in line for line in caplog.text.splitlines()) == 3
    assert "line 2 " in caplog.text and "line 3 " in caplog.text and "line 4 " in caplog.text


@pytest.mark.parametrize("bad", [
    b'{"id": "\xff\xfe"}',  # not UTF-8
    json.dumps({**usage_record().to_json(), "prompt_tokens": 2**70}).encode(),  # past the column's BIGINT
    json.dumps({**usage_record().to_json(), "completion_tokens": -5}).encode(),  # no count is negative
    json.dumps({**usage_record().to_json(), "cached_tokens": 2**62}).encode(),  # the day's sum would overflow
    json.dumps({**usage_record().to_json(), "started_at_ms": 2**62}).encode(),  # no day after year 9999
    json.dumps({**usage_record().to_json(), "model": "a\x00b"}).encode(),  # PostgreSQL's text takes no NUL
    json.dumps({**usage_record().to_json(), "route": "\ud800"}).encode(),  # nor a lone surrogate
], ids=["not utf-8", "int past 64 bits", "negative", "huge count", "past year 9999", "nul", "lone surrogate"])
def test_a_line_the_database_would_refuse_is_skipped_and_never_blocks_later_files(store, tmp_path, caplog, bad):
    """Files replay oldest first: one the database refused every time would keep every later
    file, of every writer, out of the ledger for good."""
    spool = tmp_path / "spool"
    spool.mkdir()
    stamp = time.time_ns()
    kept = usage_record(key_id="k0")
    (spool / f"dead-{stamp}.jsonl").write_bytes(bad + b"\n" + json.dumps(kept.to_json()).encode() + b"\n")
    later = [usage_record(key_id="k1") for _ in range(3)]
    (spool / f"other-{stamp + 1}.jsonl").write_text("".join(json.dumps(r.to_json()) + "\n" for r in later))
    ledger = UsageLedger(store, spool, writer_id="live")
    with caplog.at_level(logging.ERROR, logger="ray.serve"):
        asyncio.run(_record_and_flush(ledger, usage_record(key_id="k2")))
    assert (_requests(store, "k0"), _requests(store, "k1"), _spool_files(spool)) == (1, 3, [])
    assert "skipping corrupt line 1 " in caplog.text


def test_a_newer_releases_spool_file_is_left_for_it_and_an_unreadable_one_blocks_nothing(store, tmp_path, caplog):
    """A rolling deploy or a rollback while the database is away: a router of the newer release
    spools records with a field this one does not know. They are billed requests, not corrupt
    lines: this router leaves the file (warned once) for a router of that release, instead of
    deleting it unbilled; an unreadable entry (a directory) is passed over, not a stop for
    every later file."""
    spool = tmp_path / "spool"
    spool.mkdir()
    stamp = time.time_ns()
    newer = {**usage_record(key_id="k0").to_json(), "billing_tier": "gold"}
    newer_file = f"new-{stamp}.jsonl"
    (spool / newer_file).write_text(json.dumps(newer) + "\n")
    (spool / f"odd-{stamp + 1}.jsonl").mkdir()
    later = [usage_record(key_id="k1") for _ in range(3)]
    (spool / f"other-{stamp + 2}.jsonl").write_text("".join(json.dumps(r.to_json()) + "\n" for r in later))
    ledger = UsageLedger(store, spool, writer_id="old", flush_interval_s=0.01)

    reads = []
    real_read_bytes = Path.read_bytes

    def read_bytes(path):
        reads.append(path.name)
        return real_read_bytes(path)

    async def main():
        await _record_and_flush(ledger, usage_record(key_id="k2"))
        await ledger._replay()  # again: the same files, left as they were: neither read nor warned again

    with caplog.at_level(logging.WARNING, logger="ray.serve"), pytest.MonkeyPatch.context() as patch:
        patch.setattr(Path, "read_bytes", read_bytes)
        asyncio.run(main())
    assert reads.count(newer_file) == 1
    assert (_requests(store, "k0"), _requests(store, "k1"), _requests(store, "k2")) == (0, 3, 1)
    assert _spool_files(spool) == [newer_file, f"odd-{stamp + 1}.jsonl"]
    assert "corrupt" not in caplog.text
    assert sum(f"leaving {newer_file}" in line for line in caplog.text.splitlines()) == 1
    assert "fields this release does not know" in caplog.text and "cannot be read" in caplog.text


def test_spool_files_are_replayed_oldest_first(store, tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    older, newer = usage_record(key_id="k1"), usage_record(key_id="k1")
    (spool / "zeta-100.jsonl").write_text(json.dumps(older.to_json()) + "\n")
    (spool / "alpha-200.jsonl").write_text(json.dumps(newer.to_json()) + "\n")
    (spool / "a-300.jsonl.tmp").write_text("half-written")  # a spool write still under way
    ledger = UsageLedger(store, spool, writer_id="b")
    asyncio.run(_record_and_flush(ledger, usage_record(key_id="k2")))
    assert store.batches[1:] == [[older.id], [newer.id]]  # by the time in the name, not the writer's
    assert _spool_files(spool) == ["a-300.jsonl.tmp"] and _requests(store, "k1") == 2


def test_aclose_flushes_what_is_pending_to_the_database_or_to_the_spool(store, tmp_path):
    ledger = UsageLedger(store, tmp_path / "spool", writer_id="a", flush_interval_s=30)

    async def main():
        ledger.start()
        ledger.record(usage_record())
        await asyncio.sleep(0)
        ledger.record(usage_record())
        await ledger.aclose()

    asyncio.run(main())
    assert ledger.written == 2 and _requests(store) == 2

    store.database = unreachable(store.database)
    never_started = UsageLedger(store, tmp_path / "spool", writer_id="b")
    never_started.record(usage_record())
    asyncio.run(never_started.aclose())
    assert never_started.spooled == 1 and len(_spool_files(tmp_path / "spool")) == 1


def test_a_record_after_the_last_flush_is_spooled_and_replayed_not_lost(store, tmp_path):
    """A request that settles as its replica stops (Serve's shutdown budget spent before its
    background work was) records after the ledger's last write."""
    closed = UsageLedger(store, tmp_path / "spool", writer_id="a")
    asyncio.run(closed.aclose())
    closed.record(usage_record(key_id="late"))
    assert closed.spooled == 1 and len(_spool_files(tmp_path / "spool")) == 1
    asyncio.run(_record_and_flush(UsageLedger(store, tmp_path / "spool", writer_id="b"), usage_record()))
    assert _requests(store, "late") == 1 and _spool_files(tmp_path / "spool") == []


def test_a_record_that_comes_during_the_last_flush_is_spooled_not_left_in_memory(tmp_path):
    class SlowStore:  # the database answering slowly as a replica stops
        inserted: list = []

        def insert(self, records):
            time.sleep(0.2)
            self.inserted.extend(r.key_id for r in records)

    ledger = UsageLedger(SlowStore(), tmp_path / "spool", writer_id="a", flush_interval_s=0.05)

    async def main():
        ledger.start()
        ledger.record(usage_record(key_id="first"))
        await asyncio.sleep(0.08)  # the writer writes it (0.2 s)
        ledger.record(usage_record(key_id="second"))
        closing = asyncio.ensure_future(ledger.aclose())
        await asyncio.sleep(0.25)  # the last flush writes "second"
        assert not ledger._closed
        ledger.record(usage_record(key_id="late"))  # a request settling meanwhile
        await closing

    asyncio.run(main())
    assert ledger.spooled == 1 and len(_spool_files(tmp_path / "spool")) == 1 and ledger._pending == []


def test_a_database_that_hangs_at_close_costs_the_bound_and_every_record_is_spooled(store, tmp_path):
    """A stopping router's last write may wait a connect and a statement timeout, then the last
    flush as long again: past ``within_s`` what the writer has not written (the batch it holds
    included) goes to the spool, and a later replay counts each record once, also those the hung
    write commits after all."""
    release = threading.Event()

    class HangingStore:
        def __init__(self):
            self.inserting, self.returned = threading.Event(), threading.Event()

        def insert(self, records):
            self.inserting.set()
            release.wait(30)
            try:
                return store.insert(records)  # it commits after the close gave up on it
            finally:
                self.returned.set()

    hanging = HangingStore()
    ledger = UsageLedger(hanging, tmp_path / "spool", writer_id="a", flush_interval_s=0.01)
    ids = []

    async def main():
        ledger.start()
        ledger.record(first := usage_record())
        await asyncio.to_thread(hanging.inserting.wait, 5)  # the writer holds it, in a hung insert
        ledger.record(second := usage_record())
        ids.extend((first.id, second.id))
        await ledger.aclose(within_s=0.3)
        returned = hanging.returned.is_set()
        release.set()  # the hung write commits the first record (``asyncio.run`` waits for its thread)
        return returned

    assert asyncio.run(main()) is False  # the close did not wait for the hung write
    spooled = [json.loads(line)["id"] for name in _spool_files(tmp_path / "spool")
               for line in (tmp_path / "spool" / name).read_text().splitlines()]
    assert sorted(spooled) == sorted(ids) and ledger.spooled == 2
    assert _requests(store) == 1
    asyncio.run(_record_and_flush(UsageLedger(store, tmp_path / "spool", writer_id="b"), usage_record(key_id="next")))
    assert _requests(store, "k1") == 2 and _spool_files(tmp_path / "spool") == []  # each once


class AwayStore:
    """A database that is away: the first insert fails, the next ones hang until ``release``,
    then do ``then`` (go through, or fail again)."""

    def __init__(self, release: threading.Event, then):
        self.release, self.then = release, then
        self.calls, self.hanging = 0, threading.Event()

    def insert(self, records):
        self.calls += 1
        if self.calls == 1:
            raise ConnectionError("the registry is unreachable")
        self.hanging.set()
        self.release.wait(30)
        return self.then(records)


def test_once_a_write_failed_every_batch_is_spooled_at_once_while_the_database_is_tried_apart(store, tmp_path):
    """A database that is away costs each write its connect timeout (5 s, 15 s on a kept
    connection): every flush tried the insert first, and what it held meanwhile was in memory only,
    5-16 s of records a hard kill lost (found by a review). After one failure, the next batches go
    straight to the spool and the database is tried apart, by replaying the oldest file."""
    spool, release = tmp_path / "spool", threading.Event()
    away = AwayStore(release, then=store.insert)
    ledger = UsageLedger(away, spool, writer_id="a", flush_interval_s=0.02)
    first, second, third = usage_record(key_id="k1"), usage_record(key_id="k1"), usage_record(key_id="k2")

    def spooled_ids():
        return {json.loads(line)["id"] for name in _spool_files(spool)
                for line in (spool / name).read_text().splitlines()}

    async def main():
        ledger.start()
        ledger.record(first)
        await _until(lambda: ledger.database_away)
        await asyncio.to_thread(away.hanging.wait, 5)  # the try: a replay of the first file, hung
        ledger.record(second)
        ledger.record(third)
        await _until(lambda: {second.id, third.id} <= spooled_ids())  # on disk while the try hangs
        assert ledger.pending_tokens("k1") == 240 and ledger.written == 0
        release.set()
        await _until(lambda: not ledger.database_away and _spool_files(spool) == [])
        await ledger.aclose()

    asyncio.run(main())
    assert _requests(store, "k1") == 2 and _requests(store, "k2") == 1 and ledger.pending_tokens("k1") == 0


def test_record_never_raises_on_a_bad_record(store, tmp_path, caplog):
    ledger = UsageLedger(store, tmp_path / "spool", writer_id="a")
    with caplog.at_level(logging.ERROR, logger="ray.serve"):
        ledger.record({"key_id": "k1"})
    ledger.record(usage_record())
    asyncio.run(ledger.aclose())
    assert "not a UsageRecord" in caplog.text and ledger.written == 1 and _requests(store) == 1


def test_records_that_can_be_neither_written_nor_spooled_are_kept_for_the_next_write(store, tmp_path):
    not_a_dir = tmp_path / "spool"
    not_a_dir.write_text("")  # mkdir fails: as on a full or read-only disk
    working = store.database
    store.database = unreachable(working)
    ledger = UsageLedger(store, not_a_dir, writer_id="a")
    kept = usage_record(key_id="k1")
    asyncio.run(_record_and_flush(ledger, kept))
    assert ledger.spooled == 0 and ledger.pending_tokens("k1") == 120
    store.database = working
    asyncio.run(_record_and_flush(ledger))  # nothing spooled to replay: the try writes what is held
    assert ledger.written == 1 and store.batches[-1] == [kept.id] and ledger.pending_tokens("k1") == 0


def test_a_full_disk_leaves_no_part_written_spool_file_and_one_left_by_a_killed_writer_is_swept(
        store, tmp_path, monkeypatch):
    """ENOSPC mid-write left ``*.jsonl.tmp`` behind, never removed (and a writer killed mid-write
    its own): on a 1 GiB volume during a long outage they took the space the next spool needed."""
    import errno

    from serve_app.usage import ledger as ledger_module

    spool = tmp_path / "spool"
    store.database = unreachable(store.database)
    ledger = UsageLedger(store, spool, writer_id="a")

    def full(_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ledger_module.json, "dumps", full)
    kept = usage_record(key_id="k1")
    asyncio.run(_record_and_flush(ledger, kept))
    assert ledger.spooled == 0 and ledger.pending_tokens("k1") == 120  # held in memory, as before
    assert _spool_files(spool) == []  # before: a-<stamp>.jsonl.tmp
    monkeypatch.undo()
    (spool / "dead-1.jsonl.tmp").write_text('{"id": "half')
    (spool / "busy-2.jsonl.tmp").write_text('{"id": "half')
    old = time.time() - ledger_module.STALE_TMP_S - 1
    os.utime(spool / "dead-1.jsonl.tmp", (old, old))
    assert ledger._spool_files() == [] and _spool_files(spool) == ["busy-2.jsonl.tmp"]  # a writer's, maybe


def test_a_spool_left_behind_is_replayed_without_new_traffic(store, tmp_path, monkeypatch):
    from serve_app.usage import ledger as ledger_module

    spool = tmp_path / "spool"
    working = store.database
    store.database = unreachable(working)
    asyncio.run(_record_and_flush(UsageLedger(store, spool, writer_id="gone"), usage_record(key_id="k1")))
    assert len(_spool_files(spool)) == 1
    store.database = working
    monkeypatch.setattr(ledger_module, "IDLE_REPLAY_S", 0.0)
    idle = UsageLedger(store, spool, writer_id="idle")
    asyncio.run(idle.flush())  # nothing pending here: the spool is looked at all the same
    assert idle.replayed == 1 and _spool_files(spool) == [] and _requests(store, "k1") == 1


def test_recovery_replays_each_spooled_file_once_and_tells_the_budget_its_tokens_once(store, tmp_path):
    """The try's replay and the flush's ran at once after recovery: both inserted the same files,
    and the budget guard was told 4,200 tokens of 3,000 (found by a review of the try)."""
    spool = tmp_path / "spool"
    working = store.database
    store.database = unreachable(working)
    told: list[dict] = []
    ledger = UsageLedger(store, spool, writer_id="a", flush_interval_s=0.005)
    ledger.on_written = told.append
    records = [usage_record(key_id="k1") for _ in range(12)]

    async def main():
        for r in records[:8]:  # eight files while it is away
            ledger.record(r)
            await ledger.flush()
        assert len(_spool_files(spool)) == 8 and ledger.database_away
        store.database = working
        ledger.start()
        for r in records[8:]:  # records keep coming while the files go in
            ledger.record(r)
            await asyncio.sleep(0.01)
        await _until(lambda: not ledger.database_away and _spool_files(spool) == []
                     and ledger.pending_tokens("k1") == 0)
        await ledger.aclose()

    asyncio.run(main())
    assert sum(t.get("k1", 0) for t in told) == 120 * 12 and _requests(store, "k1") == 12


def test_held_records_reach_a_database_back_when_the_spool_can_be_neither_read_nor_written(
        store, tmp_path, monkeypatch):
    """Its own files unreadable, the spool unlistable and refusing writes: the try found nothing to
    replay and wrote nothing, so the ledger never wrote again (found by a review of the try)."""
    spool = tmp_path / "spool"
    working = store.database
    store.database = unreachable(working)
    ledger = UsageLedger(store, spool, writer_id="a")
    asyncio.run(_record_and_flush(ledger, usage_record(key_id="k1")))
    (name,) = _spool_files(spool)
    (spool / name).unlink()
    (spool / name).mkdir()  # its own file, unreadable as one
    monkeypatch.setattr(ledger, "_spool_files", lambda: None)

    def refuse(batch):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ledger, "_spool", refuse)
    store.database = working
    held = usage_record(key_id="k2")
    asyncio.run(_record_and_flush(ledger, held))
    assert not ledger.database_away and store.batches[-1] == [held.id] and ledger.pending_tokens("k2") == 0


def test_a_stop_while_the_try_writes_held_records_spools_them(store, tmp_path, monkeypatch):
    """The try took held records out of the pending list; a stop cancelled it mid-insert, and the
    records were in no list the close spools: gone, not even named in the log."""
    release = threading.Event()
    spool = tmp_path / "spool"

    def still_away(records):
        raise ConnectionError("still unreachable")

    hanging = AwayStore(release, then=still_away)
    ledger = UsageLedger(hanging, spool, writer_id="a", flush_interval_s=0.01)
    real_spool = ledger._spool
    monkeypatch.setattr(ledger, "_spool", lambda batch: (_ for _ in ()).throw(OSError(28, "No space left")))
    held = usage_record(key_id="k1")

    async def main():
        ledger.start()
        ledger.record(held)
        await asyncio.to_thread(hanging.hanging.wait, 5)  # the try holds it, in a hung insert
        monkeypatch.setattr(ledger, "_spool", real_spool)  # the disk has room again
        await ledger.aclose(within_s=0.5)
        release.set()

    asyncio.run(main())
    spooled = [json.loads(line)["id"] for name in _spool_files(spool)
               for line in (spool / name).read_text().splitlines()]
    assert spooled == [held.id]

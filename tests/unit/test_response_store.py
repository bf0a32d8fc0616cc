"""The response store behind ``previous_response_id`` (serve_app/router/response_store.py)."""

import asyncio
import json
import sqlite3
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from serve_app.router.response_store import ResponseStore, StoredResponse

REPO = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def stored(i: int | str, owner: str = "alice", **response) -> StoredResponse:
    rid = f"resp_{i}"
    return StoredResponse(
        id=rid,
        owner=owner,
        model="qwen",
        created_at=1_700_000_000,
        response={"id": rid, "object": "response", "output": [], **response},
        conversation=[{"role": "user", "content": f"question {i}"}],
    )


def store_at(path, clock=None, **kwargs) -> ResponseStore:
    kwargs.setdefault("retention_s", 3600)
    kwargs.setdefault("max_responses", 1000)
    return ResponseStore(path, clock=clock or Clock(), **kwargs)


def rows(path) -> list[str]:
    with sqlite3.connect(path) as db:
        return sorted(r[0] for r in db.execute("SELECT id FROM responses"))


def test_round_trip_and_file_setup(tmp_path):
    path = tmp_path / "state" / "nested" / "responses.sqlite3"
    store = store_at(path)
    assert not path.exists()  # nothing is created until first use
    original = stored(1, output=[{"type": "message", "content": [{"type": "output_text", "text": "é"}]}])

    asyncio.run(store.put(original))

    assert asyncio.run(store.get("resp_1", "alice")) == original
    assert asyncio.run(store.get("resp_missing", "alice")) is None
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    # A second instance on an existing file (schema already there) works too.
    assert asyncio.run(store_at(path).get("resp_1", "alice")) == original


def test_other_owner_sees_nothing_and_cannot_delete(tmp_path):
    store = store_at(tmp_path / "r.sqlite3")
    asyncio.run(store.put(stored(1, owner="alice")))

    assert asyncio.run(store.get("resp_1", "mallory")) is None
    assert asyncio.run(store.history("resp_1", "mallory")) is None
    assert asyncio.run(store.delete("resp_1", "mallory")) is False
    assert asyncio.run(store.get("resp_1", "alice")) is not None  # still there

    assert asyncio.run(store.delete("resp_1", "alice")) is True
    assert asyncio.run(store.get("resp_1", "alice")) is None
    assert asyncio.run(store.delete("resp_1", "alice")) is False


def test_expired_rows_are_invisible_then_purged(tmp_path):
    path, clock = tmp_path / "r.sqlite3", Clock()
    store = store_at(path, clock, retention_s=10)
    asyncio.run(store.put(stored(1)))
    clock.now += 10
    assert asyncio.run(store.get("resp_1", "alice")) is not None  # exactly at the bound: kept

    clock.now += 0.5
    assert asyncio.run(store.get("resp_1", "alice")) is None
    assert asyncio.run(store.history("resp_1", "alice")) is None
    assert asyncio.run(store.delete("resp_1", "alice")) is False
    assert rows(path) == ["resp_1"]  # invisible, not yet purged: purges are amortised

    clock.now += ResponseStore.PURGE_INTERVAL_S
    asyncio.run(store.put(stored(2)))  # the interval has passed: this put purges
    assert rows(path) == ["resp_2"]


def test_purge_is_amortised_by_time_and_put_count(tmp_path, monkeypatch):
    monkeypatch.setattr(ResponseStore, "PURGE_EVERY_PUTS", 5)
    path, clock = tmp_path / "r.sqlite3", Clock()
    store = store_at(path, clock, max_responses=2)

    for i in range(5):  # the first put purges (an empty table), the next 4 do not
        asyncio.run(store.put(stored(i)))
    assert len(rows(path)) == 5
    asyncio.run(store.put(stored(5)))  # 5th put since the last purge, no time has passed
    assert rows(path) == ["resp_4", "resp_5"]


def test_cap_evicts_oldest_and_keeps_newest(tmp_path):
    path, clock = tmp_path / "r.sqlite3", Clock()
    store = store_at(path, clock, max_responses=3)
    for i in range(6):
        clock.now += 1
        asyncio.run(store.put(stored(i)))
    # Equal timestamps: insertion order decides.
    for i in range(6, 8):
        asyncio.run(store.put(stored(i)))
    clock.now += ResponseStore.PURGE_INTERVAL_S
    asyncio.run(store.put(stored(8)))

    assert rows(path) == ["resp_6", "resp_7", "resp_8"]
    assert asyncio.run(store.get("resp_5", "alice")) is None
    assert asyncio.run(store.get("resp_8", "alice")) is not None


def test_two_instances_share_the_file(tmp_path):
    path = tmp_path / "r.sqlite3"
    first, second = store_at(path), store_at(path)

    asyncio.run(first.put(stored(1)))
    assert asyncio.run(second.get("resp_1", "alice")) == stored(1)
    assert asyncio.run(second.delete("resp_1", "alice")) is True
    assert asyncio.run(first.get("resp_1", "alice")) is None


def test_concurrent_writers_in_other_processes(tmp_path):
    # The property several router replicas need: separate processes racing to create and then
    # write a new file all succeed (WAL + busy timeout), and each one sees the others' rows.
    path = tmp_path / "r.sqlite3"
    script = textwrap.dedent(
        """
        import asyncio, sys
        from serve_app.router.response_store import ResponseStore, StoredResponse
        store = ResponseStore(sys.argv[1], retention_s=3600, max_responses=10_000)
        async def main():
            await asyncio.gather(*(
                store.put(StoredResponse(f"resp_{sys.argv[2]}_{i}", "alice", "qwen", 0,
                                         {"output": [], "pad": "x" * 20_000}, []))
                for i in range(40)
            ))
        asyncio.run(main())
        """
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(path), str(n)], cwd=REPO)
        for n in range(3)
    ]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0]

    store = store_at(path)
    assert len(rows(path)) == 120
    assert asyncio.run(store.get("resp_2_39", "alice")).response["pad"] == "x" * 20_000


def test_history_is_conversation_then_output_without_nulls(tmp_path):
    store = store_at(tmp_path / "r.sqlite3")
    message = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "status": None,
        "content": [{"type": "output_text", "text": "hi", "annotations": [], "logprobs": None}],
    }
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"a": null}', "id": None}
    reasoning = {
        "type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "t"}],
    }
    original = stored(1, output=[reasoning, message, call])
    asyncio.run(store.put(original))

    assert asyncio.run(store.history("resp_1", "alice")) == [
        {"role": "user", "content": "question 1"},
        reasoning,
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "hi", "annotations": []}],
        },
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"a": null}'},
    ]
    # get() still returns the response exactly as the client saw it, nulls included.
    assert asyncio.run(store.get("resp_1", "alice")).response["output"][1]["status"] is None


def test_history_continues_a_chain(tmp_path):
    store = store_at(tmp_path / "r.sqlite3")
    answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4"}]}
    asyncio.run(store.put(stored(1, output=[answer])))
    first_history = asyncio.run(store.history("resp_1", "alice"))
    follow_up = {"role": "user", "content": "and doubled?"}
    second = StoredResponse("resp_2", "alice", "qwen", 0, {"output": [answer]}, first_history + [follow_up])
    asyncio.run(store.put(second))

    assert asyncio.run(store.history("resp_2", "alice")) == [
        {"role": "user", "content": "question 1"}, answer, follow_up, answer,
    ]
    assert asyncio.run(store.history("resp_3", "alice")) is None
    # A response without output (e.g. failed) continues from its conversation alone.
    asyncio.run(store.put(StoredResponse("resp_4", "alice", "qwen", 0, {"output": None}, [follow_up])))
    assert asyncio.run(store.history("resp_4", "alice")) == [follow_up]


def test_max_bytes_refuses_large_responses(tmp_path):
    path = tmp_path / "r.sqlite3"
    store = store_at(path, max_bytes=1000)
    asyncio.run(store.put(stored(1, text="x" * 800)))

    with pytest.raises(ValueError, match="limit is 1000"):
        asyncio.run(store.put(stored(2, text="x" * 1000)))
    with pytest.raises(ValueError):  # counted in UTF-8 bytes, not characters
        asyncio.run(store.put(stored(3, text="é" * 500)))
    assert rows(path) == ["resp_1"]
    assert store_at(path).max_bytes == 4 * 1024 * 1024  # the default


def test_concurrent_puts_from_many_tasks(tmp_path):
    path = tmp_path / "r.sqlite3"
    first, second = store_at(path), store_at(path)

    async def run():
        await asyncio.gather(
            *(first.put(stored(f"a{i}")) for i in range(50)),
            *(second.put(stored(f"b{i}")) for i in range(50)),
        )
        return await asyncio.gather(*(second.get(f"resp_a{i}", "alice") for i in range(50)))

    assert all(r is not None for r in asyncio.run(run()))
    assert len(rows(path)) == 100


def test_sqlite_never_runs_on_the_event_loop(tmp_path, monkeypatch):
    loop_thread = threading.get_ident()
    seen = []
    real_connect = sqlite3.connect

    def connect(*args, **kwargs):
        seen.append(threading.get_ident())
        return real_connect(*args, **kwargs)

    monkeypatch.setattr(sqlite3, "connect", connect)
    store = store_at(tmp_path / "r.sqlite3")

    async def run():
        await store.put(stored(1))
        await store.get("resp_1", "alice")
        await store.history("resp_1", "alice")
        await store.delete("resp_1", "alice")

    asyncio.run(run())
    assert seen and loop_thread not in seen


def test_rejects_nonsense_limits(tmp_path):
    for bad in ({"retention_s": 0}, {"max_responses": 0}, {"max_bytes": 0}):
        with pytest.raises(ValueError):
            store_at(tmp_path / "r.sqlite3", **bad)


def test_stored_json_is_compact(tmp_path):
    # max_bytes counts what is written, so the stored form must not carry indentation.
    path = tmp_path / "r.sqlite3"
    asyncio.run(store_at(path).put(stored(1)))
    with sqlite3.connect(path) as db:
        (raw,) = db.execute("SELECT response FROM responses").fetchone()
    assert raw == json.dumps(stored(1).response, separators=(",", ":"))

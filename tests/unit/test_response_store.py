"""The response store behind ``previous_response_id`` (serve_app/router/response_store.py), on both
registry databases: the key store's SQLite file and a real PostgreSQL server. Each attack of issue
22 ("Stored responses") is a test here: an id cannot be taken over, one owner's traffic cannot
evict another's rows, and another owner's id is invisible."""

import asyncio
import heapq
import json
import random
import subprocess
import sys
import textwrap
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
from pydantic import ValidationError

from serve_app.auth.database import RegistryUnavailable, open_database
from serve_app.config import ResponsesArgs
from serve_app.router.response_store import ResponseIdTaken, ResponseStore, StoredResponse, fair_eviction

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


def args(**overrides) -> ResponsesArgs:
    return ResponsesArgs(**{"retention_hours": 1, "max_responses": 1000, "max_responses_per_owner": 1000, **overrides})


@pytest.fixture(params=["sqlite", "postgres"])
def database(request, tmp_path):
    """The registry's database, empty: the key store's file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return open_database(tmp_path / "keys.sqlite3", create=True)
    return open_database(request.getfixturevalue("fresh_database"))


def run(coroutine):
    return asyncio.run(coroutine)


def ids(database) -> list[str]:
    with database.connect() as db:
        return sorted(row["id"] for row in db.execute("SELECT id FROM stored_responses").fetchall())


# --- round trip, ownership, ids ----------------------------------------------------------------------
def test_round_trip_in_the_registrys_database(database):
    store = ResponseStore(database, args(), clock=Clock())
    with database.connect() as db:  # nothing is created until first use
        assert "stored_responses" not in _tables(db, database.kind)
    original = stored(1, output=[{"type": "message", "content": [{"type": "output_text", "text": "é"}]}])

    assert run(store.put(original)) == len(json.dumps(original.response, ensure_ascii=False, separators=(",", ":")).encode()) + len(
        json.dumps(original.conversation, separators=(",", ":")).encode()
    )  # the bytes stored: what the request's usage record counts
    assert run(store.get("resp_1", "alice")) == original
    assert run(store.get("resp_missing", "alice")) is None
    # A second instance (another replica) on the existing schema sees it.
    assert run(ResponseStore(database, args(), clock=Clock()).get("resp_1", "alice")) == original


def _tables(db, kind) -> set[str]:
    if kind == "sqlite":
        return {row["name"] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()}
    return {row["tablename"] for row in db.execute("SELECT tablename FROM pg_tables").fetchall()}


def test_another_owners_id_is_invisible_to_get_history_and_delete(database):
    store = ResponseStore(database, args())
    run(store.put(stored(1, owner="alice")))

    assert run(store.get("resp_1", "mallory")) is None
    assert run(store.history("resp_1", "mallory")) is None
    assert run(store.delete("resp_1", "mallory")) is False
    assert run(store.get("resp_1", "alice")) is not None  # still there

    assert run(store.delete("resp_1", "alice")) is True
    assert run(store.get("resp_1", "alice")) is None
    assert run(store.delete("resp_1", "alice")) is False


def test_an_owner_posting_anothers_id_cannot_replace_the_row(database):
    # Issue 22: the store wrote INSERT OR REPLACE, so owner B storing a response under A's id
    # made A's response disappear (A's GET -> 404). A row is only ever inserted now.
    store = ResponseStore(database, args())
    original = stored(1, owner="alice", text="alice's answer")
    run(store.put(original))

    with pytest.raises(ResponseIdTaken):
        run(store.put(stored(1, owner="bob", text="bob's answer")))
    with pytest.raises(ResponseIdTaken):  # nor may the owner itself overwrite it
        run(store.put(stored(1, owner="alice", text="rewritten")))

    assert run(store.get("resp_1", "alice")) == original
    assert run(store.get("resp_1", "bob")) is None
    assert run(store.footprint("bob")) == (0, 0)  # the refused put left nothing behind


# --- retention and the sweep -------------------------------------------------------------------------
def test_expired_rows_are_invisible_at_once_and_deleted_by_the_sweep_not_by_puts(database):
    clock = Clock()
    store = ResponseStore(database, args(retention_hours=10 / 3600), clock=clock)
    run(store.put(stored(1)))
    clock.now += 10
    assert run(store.get("resp_1", "alice")) is not None  # exactly at the bound: kept

    clock.now += 0.5
    assert run(store.get("resp_1", "alice")) is None
    assert run(store.history("resp_1", "alice")) is None
    assert run(store.delete("resp_1", "alice")) is False
    run(store.put(stored(2)))
    assert ids(database) == ["resp_1", "resp_2"]  # invisible; puts do not purge

    assert run(store.sweep()).expired == 1
    assert ids(database) == ["resp_2"]


class Recording:
    """The database, with every statement it runs written down (to check what a sweep sends)."""

    def __init__(self, database):
        self._database, self.statements = database, []

    def __getattr__(self, name):
        return getattr(self._database, name)

    @contextmanager
    def connect(self, read: bool = False):
        with self._database.connect(read) as db:
            statements = self.statements

            class Connection:
                def execute(self, sql, params=()):
                    statements.append((sql, params))
                    return db.execute(sql, params)

            yield Connection()


def test_a_sweep_is_bounded_per_statement_and_per_run(database, monkeypatch):
    monkeypatch.setattr(ResponseStore, "SWEEP_BATCH", 4)
    monkeypatch.setattr(ResponseStore, "SWEEP_MAX_ROWS", 10)
    clock, recording = Clock(), Recording(database)
    store = ResponseStore(recording, args(retention_hours=1), clock=clock)
    for i in range(25):
        run(store.put(stored(i, owner=f"o{i % 3}")))
    clock.now += 3600 + 1
    run(store.put(stored("fresh")))

    recording.statements.clear()
    assert run(store.sweep()).expired == 10  # one run deletes at most SWEEP_MAX_ROWS
    deletes = [params for sql, params in recording.statements if sql.startswith("DELETE")]
    assert deletes and all(params[-1] <= 4 for params in deletes)  # LIMIT: SWEEP_BATCH at most
    assert len(ids(database)) == 16

    clock.now += ResponseStore.SWEEP_INTERVAL_S
    assert run(store.sweep()).expired == 10
    clock.now += ResponseStore.SWEEP_INTERVAL_S
    assert run(store.sweep()).expired == 5
    assert ids(database) == ["resp_fresh"]


def test_one_sweep_runs_at_a_time_across_replicas_and_regions(database):
    clock = Clock()
    here, peer = ResponseStore(database, args(), clock=clock), ResponseStore(database, args(), clock=clock)
    assert run(here.sweep()) is not None
    assert run(peer.sweep()) is None  # the lease: its run would repeat the first one's evictions
    clock.now += ResponseStore.SWEEP_INTERVAL_S / 2
    assert run(peer.sweep()) is not None


def test_a_long_sweep_keeps_its_lease_and_no_second_run_joins_it(database):
    """Each owner's deletes take a while (a WAN away): the run renews its lease as it goes, so a
    peer does not start a second run on counts the first is still lowering."""
    clock = Clock()
    here, peer = ResponseStore(database, args(), clock=clock), ResponseStore(database, args(), clock=clock)
    for owner in ("alice", "bob", "carol"):
        run(here.put(stored(owner, owner=owner)))
    clock.now += 2 * 3600  # every row past its retention
    peer_runs, delete = [], here._delete_oldest

    def slow_delete(*a, **kw):
        clock.now += ResponseStore.SWEEP_INTERVAL_S / 3  # 20 s per owner: 60 s in all
        peer_runs.append(peer._claim_sweep(peer._now_ms()))
        return delete(*a, **kw)

    here._delete_oldest = slow_delete
    swept = run(here.sweep())
    assert swept.expired == 3 and peer_runs == [False, False, False]


def test_a_sweep_renews_its_lease_with_every_batch_and_stops_once_another_run_took_it(database, monkeypatch):
    """One owner's deletes alone can outlast the lease (40 batches a WAN away): each batch renews
    it in its own transaction; a run that stalled past it and lost it deletes nothing more."""
    monkeypatch.setattr(ResponseStore, "SWEEP_BATCH", 1)
    clock = Clock()
    here, peer = ResponseStore(database, args(), clock=clock), ResponseStore(database, args(), clock=clock)
    for i in range(4):
        run(here.put(stored(i, owner="alice")))
    clock.now += 2 * 3600  # every row past its retention
    started, peer_runs, claim, now = [], [], here._claim_sweep, here._now_ms
    here._claim_sweep = lambda now_ms: started.append(claim(now_ms)) or started[-1]

    def a_batch_later() -> int:  # read before each batch: 20 s passed since the last one
        if started:
            clock.now += ResponseStore.SWEEP_INTERVAL_S / 3
            peer_runs.append(peer._claim_sweep(peer._now_ms()))
        return now()

    here._now_ms = a_batch_later
    assert run(here.sweep()).expired == 4 and len(peer_runs) >= 4 and not any(peer_runs)
    started.clear()
    run(here.put(stored(5, owner="alice")))
    clock.now += 2 * 3600
    here._now_ms = now
    stalled = here._delete_oldest("alice", 10, now(), sweep_lease(here, clock, stale=True))
    assert stalled == 0 and ids(database) == ["resp_5"]  # its lease was taken: nothing deleted


def sweep_lease(store: ResponseStore, clock: Clock, *, stale: bool):
    """A lease this run thinks it holds; ``stale``: another run has renewed it since."""
    from serve_app.router.response_store import _Lease

    stamp = store._now_ms() - 1
    with store.database.connect() as db:
        db.execute("UPDATE stored_response_sweeps SET started_ms = ? WHERE name = 'sweep'",
                   (stamp + 1 if stale else stamp,))
    return _Lease(stamp)


def test_a_registry_that_is_away_is_a_503_for_reads_and_the_sweep_keeps_trying(database, monkeypatch):
    from test_usage_store import unreachable

    monkeypatch.setattr(ResponseStore, "SWEEP_INTERVAL_S", 0.0)
    store = ResponseStore(unreachable(database), args())
    with pytest.raises(RegistryUnavailable):  # the router answers 503 with Retry-After, not 500
        run(store.get("resp_1", "alice"))

    async def scenario():
        runs, sweep = [], store.sweep

        async def counted():
            runs.append(1)
            return await sweep()  # raises: the loop logs it and runs again

        async def three_runs():
            while len(runs) < 3:
                await asyncio.sleep(0.01)

        store.sweep = counted
        store.start()
        await asyncio.wait_for(three_runs(), 30)  # a loop that died on the first error never gets there
        await store.aclose()

    run(scenario())


def test_start_runs_the_sweep_in_the_background_and_aclose_stops_it(database):
    clock = Clock()
    store = ResponseStore(database, args(retention_hours=1), clock=clock)

    async def scenario():
        await store.put(stored(1))
        clock.now += 3601
        swept = asyncio.Event()
        sweep = store.sweep

        async def watched():
            result = await sweep()
            swept.set()
            return result

        store.sweep = watched
        store.start()
        await asyncio.wait_for(swept.wait(), 30)  # the first run starts at once, no put needed
        task = store._sweeper
        await store.aclose()
        return task

    task = run(scenario())
    assert task.done() and store._sweeper is None
    assert ids(database) == []


# --- quotas ------------------------------------------------------------------------------------------
def test_an_owner_over_its_row_quota_loses_its_own_oldest_and_nobody_elses(database):
    clock = Clock()
    store = ResponseStore(database, args(max_responses_per_owner=3), clock=clock)
    run(store.put(stored("a0", owner="alice")))
    for i in range(6):
        clock.now += 1
        run(store.put(stored(f"m{i}", owner="mallory")))

    assert ids(database) == ["resp_a0", "resp_m3", "resp_m4", "resp_m5"]
    assert run(store.get("resp_a0", "alice")) is not None
    assert run(store.footprint("mallory"))[0] == 3


def test_an_owner_over_its_byte_quota_loses_its_own_oldest(database):
    clock = Clock()
    store = ResponseStore(database, args(max_mib_per_owner=4), clock=clock)  # 4 MiB: the smallest quota
    run(store.put(stored("a0", owner="alice", pad="a" * 3_000_000)))
    sizes = []
    for i in range(4):
        clock.now += 1
        sizes.append(run(store.put(stored(f"m{i}", owner="mallory", pad="m" * 1_500_000))))

    rows, held = run(store.footprint("mallory"))
    assert (rows, held) == (2, sum(sizes[-2:])) and held <= 4 * 2**20
    assert ids(database) == ["resp_a0", "resp_m2", "resp_m3"]  # alice's 3 MB stays


_EVICTION = "DELETE FROM stored_responses WHERE id IN (SELECT id FROM ("


class Rendezvous(Recording):
    """Two puts meet before their quota eviction and again before they commit (or 1 s passes at
    each meeting): without the owner's lock, both would evict while neither sees the other's new
    row, and both rows would stay."""

    def __init__(self, database):
        super().__init__(database)
        self.meetings: tuple[threading.Barrier, threading.Barrier] | None = None  # once the schema is there

    @contextmanager
    def connect(self, read: bool = False):
        with super().connect(read) as db:
            execute = db.execute

            def meet(barrier: threading.Barrier) -> None:
                try:
                    barrier.wait()
                except threading.BrokenBarrierError:  # the other put waits on the owner's lock: as it should
                    pass

            def meeting(sql, params=()):
                if self.meetings is None or not sql.startswith(_EVICTION):
                    return execute(sql, params)
                before, after = self.meetings
                meet(before)
                result = execute(sql, params)
                meet(after)
                return result

            db.execute = meeting
            yield db


def test_one_owners_concurrent_puts_from_two_routers_keep_its_quota_exactly(database):
    # Two replicas (or regions) storing for one owner at the same moment: the owner's lock makes
    # the second put count the first one's row, so the owner ends at its quota, not above it.
    rendezvous = Rendezvous(database)
    here, peer = (ResponseStore(rendezvous, args(max_responses_per_owner=1)) for _ in range(2))
    for store in (here, peer):  # the schema first: its DDL would wait for the other put's insert
        run(store.footprint("mallory"))
    rendezvous.meetings = (threading.Barrier(2, timeout=1), threading.Barrier(2, timeout=1))

    async def puts():
        await asyncio.gather(here.put(stored("m0", owner="mallory")), peer.put(stored("m1", owner="mallory")))

    run(puts())
    assert run(here.footprint("mallory"))[0] == 1


def test_one_busy_owner_cannot_evict_another_owners_responses(database):
    # Issue 22: eviction past max_responses dropped the globally oldest rows, so one busy key
    # evicted every other owner's conversations. Past the global bound now, the owners holding
    # the most lose their oldest, down to a common level.
    clock = Clock()
    store = ResponseStore(database, args(max_responses=10, max_responses_per_owner=10), clock=clock)
    for i in range(3):
        run(store.put(stored(f"a{i}", owner="alice")))  # alice's are the oldest rows
    for owner in ("mallory", "trudy"):
        for i in range(10):
            clock.now += 1
            run(store.put(stored(f"{owner}{i}", owner=owner)))
    clock.now += ResponseStore.SWEEP_INTERVAL_S

    swept = run(store.sweep())

    assert swept.evicted == {"mallory": 6, "trudy": 7}  # 23 rows, 10 allowed: 3 + 4 + 3 stay
    assert [run(store.get(f"resp_a{i}", "alice")) is not None for i in range(3)] == [True] * 3
    assert len(ids(database)) == 10
    assert run(store.get("resp_mallory9", "mallory")) is not None  # the newest of each stay
    assert run(store.get("resp_mallory5", "mallory")) is None


@pytest.mark.parametrize("seed", range(30))
def test_fair_eviction_takes_from_the_largest_down_to_a_common_level(seed):
    rng = random.Random(seed)
    counts = {f"o{i}": rng.choice([0, 1, 2, 5, 40, 300]) for i in range(rng.randint(1, 8))}
    excess = rng.randint(0, sum(counts.values()) + 5)

    losses = fair_eviction(counts, excess)

    # The same as taking one row at a time from whoever holds the most.
    heap = [(-n, owner) for owner, n in counts.items()]
    heapq.heapify(heap)
    for _ in range(min(excess, sum(counts.values()))):
        n, owner = heapq.heappop(heap)
        heapq.heappush(heap, (n + 1, owner))
    assert sorted(counts[o] - losses.get(o, 0) for o in counts) == sorted(-n for n, _ in heap)
    assert sum(losses.values()) == min(excess, sum(counts.values()))
    assert all(0 < lost <= counts[owner] for owner, lost in losses.items())
    # Whoever holds no more than an equal share of what stays loses nothing.
    share = (sum(counts.values()) - excess) / len(counts)
    assert all(owner not in losses for owner, n in counts.items() if n <= share)


def test_quota_settings_are_checked():
    assert ResponsesArgs().max_responses_per_owner == 10_000 and ResponsesArgs().max_mib_per_owner == 256
    with pytest.raises(ValidationError, match="exceeds max_responses"):
        ResponsesArgs(max_responses=100, max_responses_per_owner=101)
    with pytest.raises(ValidationError):  # one 4 MiB response must always fit
        ResponsesArgs(max_mib_per_owner=3)
    with pytest.raises(ValidationError, match="store_path"):  # the store is the registry's now
        ResponsesArgs(store_path="/var/lib/serve_app/responses.sqlite3")


# --- regions -----------------------------------------------------------------------------------------
def test_a_response_stored_through_one_region_is_read_and_deleted_through_another(database):
    # Two regions' routers: one registry. A response a peer served after failover is there too.
    origin, peer = ResponseStore(database, args()), ResponseStore(database, args())
    answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4"}]}
    run(peer.put(stored(1, output=[answer])))

    assert run(origin.get("resp_1", "alice")) == stored(1, output=[answer])
    assert run(origin.history("resp_1", "alice"))[0] == [{"role": "user", "content": "question 1"}, answer]
    assert run(origin.get("resp_1", "bob")) is None
    assert run(origin.delete("resp_1", "alice")) is True
    assert run(peer.get("resp_1", "alice")) is None  # deleted everywhere at once


def test_concurrent_writers_in_other_processes_share_the_key_store_file(tmp_path):
    # Several router replicas on one host: processes racing to create the schema in the key
    # store's file and then write all succeed (SQLite's busy timeout), and see each other's rows.
    path = tmp_path / "keys.sqlite3"
    script = textwrap.dedent(
        """
        import asyncio, sys
        from serve_app.auth.database import RegistryUnavailable, open_database
        from serve_app.config import ResponsesArgs
        from serve_app.router.response_store import ResponseStore, StoredResponse
        store = ResponseStore(open_database(sys.argv[1], create=True), ResponsesArgs())
        async def main():
            await asyncio.gather(*(
                store.put(StoredResponse(f"resp_{sys.argv[2]}_{i}", "alice", "qwen", 0,
                                         {"output": [], "pad": "x" * 20_000}, []))
                for i in range(40)
            ))
        asyncio.run(main())
        """
    )
    open_database(path, create=True)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(path), str(n)], cwd=REPO) for n in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]

    database = open_database(path)
    assert len(ids(database)) == 120
    assert run(ResponseStore(database, args()).get("resp_2_39", "alice")).response["pad"] == "x" * 20_000


# --- what a follow-up continues from -----------------------------------------------------------------
def test_history_is_conversation_then_output_without_nulls(database):
    store = ResponseStore(database, args())
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
    run(store.put(stored(1, output=[reasoning, message, call])))

    assert run(store.history("resp_1", "alice"))[0] == [
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
    assert run(store.get("resp_1", "alice")).response["output"][1]["status"] is None


def test_history_continues_a_chain(database):
    store = ResponseStore(database, args())
    answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4"}]}
    run(store.put(stored(1, output=[answer])))
    first_history, size = run(store.history("resp_1", "alice"))
    assert size == len(json.dumps(first_history, separators=(",", ":")))  # what the follow-up's price adds
    follow_up = {"role": "user", "content": "and doubled?"}
    run(store.put(StoredResponse("resp_2", "alice", "qwen", 0, {"output": [answer]}, first_history + [follow_up])))

    assert run(store.history("resp_2", "alice"))[0] == [
        {"role": "user", "content": "question 1"}, answer, follow_up, answer,
    ]
    assert run(store.history("resp_3", "alice")) is None
    # A response without output (e.g. failed) continues from its conversation alone.
    run(store.put(StoredResponse("resp_4", "alice", "qwen", 0, {"output": None}, [follow_up])))
    assert run(store.history("resp_4", "alice"))[0] == [follow_up]


def test_history_leaves_the_answers_logprobs_out_and_is_sized_as_a_request_body_is(database):
    """Per-token logprobs are never rendered into the prompt: as history they priced a follow-up at
    hundreds of times its prompt. Text is sized in UTF-8 bytes, as the client's own body is."""
    store = ResponseStore(database, args())
    logprobs = [{"token": "你", "logprob": -0.1, "bytes": [228, 189, 160],
                 "top_logprobs": [{"token": "你", "logprob": -0.1, "bytes": [228, 189, 160]}] * 20}] * 50
    answer = {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "你好" * 50, "annotations": [], "logprobs": logprobs}]}
    run(store.put(stored(1, output=[answer])))
    history, size = run(store.history("resp_1", "alice"))
    assert history[1]["content"] == [{"type": "output_text", "text": "你好" * 50, "annotations": []}]
    assert size == len(json.dumps(history, ensure_ascii=False, separators=(",", ":")).encode()) < 500  # escaped: 740
    assert run(store.get("resp_1", "alice")).response["output"][0]["content"][0]["logprobs"] == logprobs  # kept


def test_an_owner_whose_puts_are_held_holds_no_thread_another_owners_answer_waits_for(database):
    """An owner's puts wait on its row lock one after another (a busy agent, a primary a WAN away
    or failing over): they queue here, one on the store's threads; another owner's put and every
    lookup go on meanwhile."""
    import threading

    store = ResponseStore(database, args())
    run(store.put(stored(0, owner="bob")))
    held, entered, put = threading.Event(), threading.Event(), store._put

    def slow_for_alice(response, now_ms):
        if response.owner == "alice":
            entered.set()
            held.wait(30)
        return put(response, now_ms)

    store._put = slow_for_alice

    async def scenario():
        alices = [asyncio.ensure_future(store.put(stored(i, owner="alice"))) for i in range(1, 9)]
        await asyncio.to_thread(entered.wait, 30)
        try:  # a hang guard, not a timing bound: without the fix these wait for alice's puts
            await asyncio.wait_for(store.put(stored(9, owner="bob")), 20)
            found = await asyncio.wait_for(store.history("resp_0", "bob"), 20)
        finally:
            held.set()
        await asyncio.gather(*alices)
        return found, store._owner_puts.owners()

    found, turns = run(scenario())
    assert found is not None and turns == {}  # every owner's turn is given back
    assert len(ids(database)) == 10


def test_an_owners_puts_arriving_while_one_runs_and_one_waits_still_run_one_at_a_time(database):
    """A put arriving just as the running one ends (the next one woken, not yet running) joins
    the owner's queue: it does not start a second turn beside the one woken."""
    import threading

    store = ResponseStore(database, args())
    gates = {i: threading.Event() for i in range(1, 4)}
    entered = {i: threading.Event() for i in range(1, 4)}
    running, most, guard, put = [0], [0], threading.Lock(), store._put

    def gated(response, now_ms):
        i = int(response.id.removeprefix("resp_"))
        with guard:
            running[0] += 1
            most[0] = max(most[0], running[0])
        entered[i].set()
        gates[i].wait(30)
        with guard:
            running[0] -= 1
        return put(response, now_ms)

    store._put = gated

    async def scenario():
        first = asyncio.ensure_future(store.put(stored(1, owner="alice")))
        await asyncio.to_thread(entered[1].wait, 30)
        second = asyncio.ensure_future(store.put(stored(2, owner="alice")))
        await asyncio.sleep(0)  # queued behind the first
        gates[1].set()
        await first  # the second is woken now, and may not have run yet
        third = asyncio.ensure_future(store.put(stored(3, owner="alice")))
        await asyncio.to_thread(entered[2].wait, 30)
        third_ran_beside = await asyncio.to_thread(entered[3].wait, 0.5)  # a bound on a wait that must not end
        for gate in gates.values():
            gate.set()
        await asyncio.gather(second, third)
        return third_ran_beside

    assert run(scenario()) is False and most[0] == 1 and store._owner_puts.owners() == {}


def test_one_owners_lookups_take_at_most_half_of_the_lookup_threads(database):
    """A tenant looping GET on its 4 MiB rows, or a burst of its follow-ups, held all four lookup
    threads: every other owner's follow-up waited behind them. Two of an owner's run at once;
    the rest wait their owner's turn, and another owner's lookup runs meanwhile."""
    import threading

    from serve_app.router.response_store import LOOKUPS_PER_OWNER

    store = ResponseStore(database, args())
    run(store.put(stored(0, owner="alice")))
    run(store.put(stored(1, owner="bob")))
    held, guard, running, most, get = threading.Event(), threading.Lock(), [0], [0], store._get

    def slow_for_alice(response_id, owner, *rest):
        if owner == "alice":
            with guard:
                running[0] += 1
                most[0] = max(most[0], running[0])
            held.wait(30)
            with guard:
                running[0] -= 1
        return get(response_id, owner, *rest)

    store._get = slow_for_alice

    async def scenario():
        alices = [asyncio.ensure_future(store.get("resp_0", "alice")) for _ in range(6)]
        await asyncio.sleep(0.2)
        try:  # a hang guard, not a timing bound: without the share bob waits for alice's
            bobs = await asyncio.wait_for(store.get("resp_1", "bob"), 20)
        finally:
            held.set()
        return bobs, await asyncio.gather(*alices), store._owner_lookups.owners()

    bobs, alices, shares = run(scenario())
    assert bobs is not None and all(found is not None for found in alices)
    assert most[0] == LOOKUPS_PER_OWNER == 2 and shares == {}


def test_an_owner_whose_clients_hang_up_still_holds_its_share_until_its_threads_are_done(database):
    """A request whose client left is cancelled, but its statement on a thread runs on: the share
    was given back at the cancel, so a tenant hanging up at once on each 4 MiB read filled every
    lookup thread all the same."""
    import threading

    store = ResponseStore(database, args())
    run(store.put(stored(0, owner="alice")))
    run(store.put(stored(1, owner="bob")))
    held, started, get = threading.Event(), threading.Semaphore(0), store._get

    def slow_for_alice(response_id, owner, *rest):
        if owner == "alice":
            started.release()
            held.wait(30)
        return get(response_id, owner, *rest)

    store._get = slow_for_alice

    async def scenario():
        first = [asyncio.ensure_future(store.get("resp_0", "alice")) for _ in range(2)]
        for _ in range(2):
            await asyncio.to_thread(started.acquire, True, 30)  # both on their threads
        for task in first:
            task.cancel()  # their clients left; the statements run on
        await asyncio.gather(*first, return_exceptions=True)
        second = [asyncio.ensure_future(store.get("resp_0", "alice")) for _ in range(2)]  # and again
        try:  # a hang guard, not a timing bound: without the fix all four threads are alice's
            bobs = await asyncio.wait_for(store.get("resp_1", "bob"), 20)
            waiting = store._owner_lookups.owners()
        finally:
            held.set()
        await asyncio.gather(*second)
        for _ in range(2000):  # the cancelled ones' threads end about now: their places come back then
            if not store._owner_lookups.owners():
                break
            await asyncio.sleep(0.01)
        return bobs, waiting, store._owner_lookups.owners()

    bobs, waiting, after = run(scenario())
    assert bobs is not None and waiting == {"alice": 4} and after == {}


# --- what is refused, and where it runs --------------------------------------------------------------
def test_a_response_over_max_bytes_or_not_valid_unicode_is_refused_and_nothing_stored(database):
    store = ResponseStore(database, args())
    assert store.max_bytes == 4 * 1024 * 1024
    store.max_bytes = 1000
    run(store.put(stored(1, text="x" * 800)))

    with pytest.raises(ValueError, match="limit is 1000"):
        run(store.put(stored(2, text="x" * 1000)))
    with pytest.raises(ValueError):  # counted in UTF-8 bytes, not characters
        run(store.put(stored(3, text="é" * 500)))
    with pytest.raises(ValueError):  # a lone surrogate has no UTF-8 form to store
        run(store.put(stored(4, metadata={"k": "\ud800"})))
    assert ids(database) == ["resp_1"]


def test_the_database_is_never_called_on_the_event_loop(database):
    loop_thread, seen = threading.get_ident(), []
    real_connect = database.connect

    @contextmanager
    def connect(read: bool = False):
        seen.append(threading.get_ident())
        with real_connect(read) as db:
            yield db

    database.connect = connect
    store = ResponseStore(database, args())

    async def scenario():
        await store.put(stored(1))
        await store.get("resp_1", "alice")
        await store.history("resp_1", "alice")
        await store.delete("resp_1", "alice")
        await store.sweep()

    run(scenario())
    assert seen and loop_thread not in seen


def test_stored_json_is_compact(database):
    # The quotas count what is written, so the stored form must not carry indentation.
    run(ResponseStore(database, args()).put(stored(1)))
    with database.connect() as db:
        row = db.execute("SELECT response, size FROM stored_responses").fetchone()
    assert row["response"] == json.dumps(stored(1).response, separators=(",", ":"))
    assert row["size"] == len(row["response"]) + len(json.dumps(stored(1).conversation, separators=(",", ":")))

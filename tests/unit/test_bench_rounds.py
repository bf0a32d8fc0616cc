"""Sustained batches, ratios per round and their spread, the gate, the engine-environment check,
and the schedule with a CPU meter: pure functions, fake clocks and fake process tables."""

import asyncio
import time

import pytest

from serve_app.bench.client import Run
from serve_app.bench.engine_env import engine_envs, mismatches, warning_block
from serve_app.bench.gate import gate_failures, parse_floors, run_failures
from serve_app.bench.procs import BASELINE, OURS, discover
from serve_app.bench.schedule import plan_batches, run_plan
from serve_app.bench.stats import batch_rate, round_ratios, spread, sustained
from tests.unit.fake_processes import CLIENT as CLIENT_PID
from tests.unit.fake_processes import Clock, FakeTable


def run(worker, tokens, ended, completion=None, ok=True):
    return Run(ok=ok, worker=worker, token_times=list(tokens), ended_at=ended, started_at=tokens[0] - 0.5 if tokens else 0,
               completion_tokens=len(tokens) if completion is None else completion)


# --- the sustained window -----------------------------------------------------------------------
def test_sustained_counts_only_while_every_worker_streams():
    runs = [
        run(0, [1, 2, 3], 3.5), run(0, [4, 5, 6], 6.5),  # worker 0 is done first, at 6.5
        run(1, [2.5, 3.5, 4.5], 5), run(1, [5.5, 6.5, 7.5], 8),  # worker 1 streams from 2.5
    ]
    window = sustained(runs)
    # from 2.5 (the last worker's first token) to 6.5 (the first worker's last end): tokens at
    # 3, 4, 5, 6 (worker 0) and 2.5, 3.5, 4.5, 5.5, 6.5 (worker 1)
    assert window == {"seconds": 4.0, "tokens": 9.0, "tokens_per_s": 2.25, "start": 2.5, "end": 6.5}
    # ramp-up and tail are what the whole batch's rate includes and this one does not
    assert window["tokens_per_s"] != pytest.approx(12 / (8 - 0.5))


def test_sustained_scales_chunks_to_usage_and_skips_failed_streams():
    runs = [run(0, [1, 2, 3], 4, completion=6), run(1, [1, 2, 3], 4), run(1, [3.5], 3.9, ok=False)]
    assert sustained(runs)["tokens"] == pytest.approx(2 * 3 + 3)  # 6 tokens over 3 chunks: 2 each


def test_no_sustained_window_when_there_is_no_steady_state():
    assert sustained([]) is None
    assert sustained([Run(ok=True, completion_tokens=3)]) is None  # no worker (a sequential target)
    assert sustained([run(0, [1, 2], 2.5), run(1, [3, 4], 4.5)]) is None  # 0 ended before 1 started
    assert sustained([run(0, [1, 2], 5), Run(ok=False, worker=1, ended_at=2.0)]) is None  # 1 never streamed
    # at concurrency 1 the window is the first token to the end of the last request
    assert sustained([run(0, [1, 2, 3], 3.2), run(0, [4, 5, 6], 6.5)]) == {"seconds": 5.5, "tokens": 6.0,
                                                                            "tokens_per_s": pytest.approx(6 / 5.5),
                                                                            "start": 1, "end": 6.5}


# --- rounds and their spread --------------------------------------------------------------------
def batch(side, number, rate, cpu_s=None, tokens=1000, ttft=None):
    record = {"side": side, "round": number, "completion_tokens": tokens, "wall_s": 10.0,
              "sustained": {"seconds": 5.0, "tokens": rate * 5, "tokens_per_s": rate} if rate else None,
              "cpu": {"sides": {side: {"total": cpu_s}}} if cpu_s is not None else None}
    return record if ttft is None else {**record, "ttft_p50_ms": ttft}


def test_ratio_per_round_then_median_and_range():
    batches = [batch(OURS, 0, 90, 5.0), batch(BASELINE, 0, 100, 4.0),
               batch(BASELINE, 1, 100, 4.0), batch(OURS, 1, 80, 6.0),
               batch(OURS, 2, 99, 4.4), batch(BASELINE, 2, 100, 4.0),
               batch(OURS, 3, 95)]  # a round the baseline never ran is no round
    result = round_ratios(batches)
    assert [r["tokens_per_s_ratio"] for r in result["rounds"]] == pytest.approx([0.9, 0.8, 0.99])
    assert result["tokens_per_s_ratio"] == {"n": 3, "median": pytest.approx(0.9), "min": pytest.approx(0.8),
                                            "max": pytest.approx(0.99)}
    assert result["cpu_ratio"]["median"] == pytest.approx(1.25) and result["rounds"][1]["ours_cpu_per_1k"] == 6.0
    assert spread([1.0, None, 3.0, 2.0, 4.0]) == {"n": 4, "median": 2.5, "min": 1.0, "max": 4.0}
    assert spread([]) == {"n": 0, "median": None, "min": None, "max": None}


def test_the_ttft_overhead_is_paired_round_by_round_so_the_hosts_drift_cancels():
    # the host halves its speed after round 0: both sides' TTFT doubles, ours stays 5 ms behind
    batches = [batch(OURS, 0, 90, ttft=25.0), batch(BASELINE, 0, 100, ttft=20.0),
               batch(BASELINE, 1, 100, ttft=40.0), batch(OURS, 1, 80, ttft=45.0),
               batch(OURS, 2, 99, ttft=46.0), batch(BASELINE, 2, 100, ttft=40.0),
               batch(OURS, 3, 90, ttft=30.0), batch(BASELINE, 3, 100)]  # a batch without a TTFT (an older file)
    result = round_ratios(batches)
    assert [r["ttft_overhead_ms"] for r in result["rounds"]] == [5.0, 5.0, 6.0, None]
    assert result["rounds"][1]["ours_ttft_p50_ms"] == 45.0 and result["rounds"][1]["baseline_ttft_p50_ms"] == 40.0
    assert result["ttft_overhead_ms"] == {"n": 3, "median": 5.0, "min": 5.0, "max": 6.0}


def test_a_round_without_a_sustained_window_falls_back_to_the_whole_batch_and_says_so():
    assert batch_rate(batch(OURS, 0, None, tokens=500)) == (50.0, "batch")
    rounds = round_ratios([batch(OURS, 0, None, tokens=500), batch(BASELINE, 0, 100)])["rounds"]
    assert rounds[0]["basis"] == "batch" and rounds[0]["cpu_ratio"] is None


def test_a_round_with_one_side_on_its_whole_batch_rates_both_sides_so():
    # ours without a sustained window (10 s wall), the baseline with one: sustained against
    # whole-batch rates would differ by the ramp-up and tail alone
    rounds = round_ratios([batch(OURS, 0, None, tokens=500), batch(BASELINE, 0, 100, tokens=800)])["rounds"]
    assert rounds[0]["ours_tokens_per_s"] == 50.0 and rounds[0]["baseline_tokens_per_s"] == 80.0


def test_a_round_that_shared_the_host_is_left_out_of_the_median_and_says_why():
    crowded = {**batch(BASELINE, 1, 200), "cpu": {"sides": {}, "host_other_cores": 0.84}}
    quiet = {**batch(OURS, 2, 90), "cpu": {"sides": {}, "host_other_cores": 0.03}}
    failed = {**batch(OURS, 0, 90), "requests": 10, "ok": 8}
    result = round_ratios([failed, {**batch(BASELINE, 0, 100), "requests": 10, "ok": 10},
                           batch(OURS, 1, 90), crowded, quiet, batch(BASELINE, 2, 100), batch(OURS, 3, 90)])
    assert result["rounds_run"] == 4 and result["errors"] == 2
    assert [r["excluded"] for r in result["rounds"]] == [None, "another process used 0.84 cores beside a batch", None]
    assert result["rounds"][0]["errors"] == 2 and result["rounds"][2]["outside_cores"] == 0.03
    assert result["tokens_per_s_ratio"] == {"n": 2, "median": pytest.approx(0.9), "min": pytest.approx(0.9),
                                            "max": pytest.approx(0.9)}  # not 0.45 from the crowded round


# --- the gate -----------------------------------------------------------------------------------
def level(median, low=None, high=None, n=5):
    return {"spread": {"tokens_per_s_ratio": {"n": n, "median": median, "min": low or median, "max": high or median}}}


def test_gate_floors_parse_and_bad_ones_are_refused():
    assert parse_floors("1=0.97, 16=0.95,32=0.95") == {1: 0.97, 16: 0.95, 32: 0.95}
    for bad in ("1", "x=0.9", "1=abc", "0=0.9", "1=-1", "", "16=0"):
        with pytest.raises(ValueError):
            parse_floors(bad)


def test_gate_fails_each_concurrency_below_its_floor_with_one_line_each():
    results = {"1": level(0.98, 0.95, 0.99), "16": level(0.91, 0.88, 0.93), "32": level(0.95)}
    failures = gate_failures(results, {1: 0.97, 16: 0.95, 32: 0.95})
    assert failures == ["c=16: tokens/s ratio 0.910× (median of 5 rounds, 0.880–0.930×) is below the floor 0.95×"]
    assert gate_failures(results, {1: 0.97, 32: 0.95}) == []  # exactly at the floor passes


def test_a_gate_that_cannot_see_does_not_pass():
    results = {"1": level(None, n=0), "16": {}}
    failures = gate_failures(results, {1: 0.97, 16: 0.95, 64: 0.9})
    assert failures[0].startswith("c=1: no tokens/s ratio") and failures[1].startswith("c=16: no tokens/s ratio")
    assert failures[2] == "c=64: not measured (floor 0.90×); add it to --concurrency"


def test_a_gate_fails_on_what_its_figures_do_not_stand_on():
    spread_ = {"tokens_per_s_ratio": {"n": 2, "median": 1.0, "min": 0.99, "max": 1.01}, "rounds_run": 3,
               "rounds": [{"excluded": "another process used 0.84 cores beside a batch"}],
               "steady_cpu_ratio": {"n": 2, "median": 1.35, "min": 1.3, "max": 1.4}}
    quiet = [{"quiet": {"timed_out": True}}, {"quiet": {"timed_out": False}}]
    entry = {"spread": spread_, "ours": {"summary": {"errors": 3}, "rounds": quiet},
             "baseline": {"summary": {"errors": 0}}}
    assert gate_failures({"16": entry}, {16: 0.95}, cpu_ceiling=1.3) == [
        "c=16: 2 of 3 rounds in the median (another process used 0.84 cores beside a batch); run it again",
        "c=16: failed requests (ours 3): the rates do not compare like with like",
        "c=16: 1 batch(es) started before the host was quiet (--quiet-timeout-s): something else was running",
        "c=16: CPU per token ratio under steady load 1.350× is above the ceiling 1.30×",
    ]
    assert gate_failures({"16": entry}, {16: 0.95})[-1].startswith("c=16: 1 batch(es)")  # no ceiling, no CPU line
    assert run_failures({"meta": {"cpu": "off (--no-cpu)"}}) == [
        "CPU off (--no-cpu): no measured quiet, no engine check; the gate needs both"]
    unlike = {"meta": {}, "engine_env": {"mismatches": ["EngineCore: nice is 15 in ours, 0 in the baseline"]}}
    assert run_failures(unlike) == ["engines differ: EngineCore: nice is 15 in ours, 0 in the baseline"]
    assert run_failures({"meta": {}, "engine_env": {"mismatches": []}}) == []


# --- the engine's environment -------------------------------------------------------------------
def tracked():
    return discover(FakeTable(Clock()), ours_port=8000, baseline_port=8100, client_pid=CLIENT_PID)


def test_identical_engines_raise_nothing_and_the_processes_are_recorded():
    table = FakeTable(Clock())
    envs = engine_envs(table, tracked())
    assert [e["pid"] for e in envs[OURS]] == [226] and [e["pid"] for e in envs[BASELINE]] == [301]
    assert envs[OURS][0]["nice"] == 15 and mismatches(envs) == [] and warning_block([]) == ""


def test_a_different_niceness_or_thread_setting_is_a_loud_warning():
    table = FakeTable(Clock())
    same = table.engine_env(0, ["OMP_NUM_THREADS"])
    table.envs[226] = {**same, "nice": 15, "threads": 6, "env": {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": None}}
    table.envs[301] = {**same, "nice": 0, "threads": 6, "env": {"OMP_NUM_THREADS": None, "VLLM_CPU_OMP_THREADS_BIND": None}}
    problems = mismatches(engine_envs(table, tracked()))
    assert problems == ["EngineCore: nice is 15 in ours, 0 in the baseline",
                        "EngineCore: OMP_NUM_THREADS is '1' in ours, None in the baseline"]
    assert warning_block(problems).startswith("WARNING: the engine does not run the same way on both sides")


def test_an_engine_not_found_is_said_not_silently_passed():
    envs = engine_envs(FakeTable(Clock()), [t for t in tracked() if t.side != BASELINE])
    assert mismatches(envs) == ["no vLLM engine process found for baseline: the engine environment was not compared"]


# --- the schedule with a meter ------------------------------------------------------------------
class StubMeter:
    """Records the order of calls; every batch costs the loaded side 2 CPU-seconds."""

    window_s = 0.5
    run_clock = staticmethod(time.perf_counter)

    def __init__(self):
        self.log, self.n = [], 0

    async def sleep(self, _seconds):
        await asyncio.Event().wait()  # no samples during a batch here: start and end only

    async def wait_quiet(self, side=None):
        self.log.append("quiet")
        return {"waited_s": 0.5, "cores": 0.01, "threshold_cores": 0.05, "timed_out": False}

    def snapshot(self, refresh=True):
        if not refresh:  # a sample during the batch (or its end), not a measured boundary
            return None
        self.log.append("snapshot")
        self.n += 1
        return self.n

    def cpu_between(self, before, after):
        return {"window_s": 1.0, "sides": {}, "snapshots": (before, after)}


def test_every_counted_batch_waits_for_quiet_is_measured_until_quiet_again_and_numbered_by_round():
    meter, log = StubMeter(), []

    def request(side):
        async def one():
            log.append(side)
            await asyncio.sleep(0)  # let the other worker start
            now = time.perf_counter()
            return Run(ok=True, completion_tokens=2, token_times=[now, now], started_at=now, ended_at=now,
                       ttft_ms=12.0 if side == OURS else 10.0)
        return one

    async def sleep(_):
        meter.log.append("sleep")

    plan = plan_batches([OURS, BASELINE], runs=4, round_size=2, warmup=1)
    done = asyncio.run(run_plan(plan, {s: request(s) for s in (OURS, BASELINE)}, 2, 0, sleep=sleep, meter=meter))
    per_batch = ["sleep", "quiet", "snapshot", "quiet", "snapshot"]
    assert meter.log == per_batch * len(plan)
    records = done[OURS].records + done[BASELINE].records
    assert sorted((r["round"], r["side"]) for r in records) == [(0, BASELINE), (0, OURS), (1, BASELINE), (1, OURS)]
    assert all(r["quiet"]["waited_s"] == 0.5 and r["cpu"]["settle"]["timed_out"] is False for r in records)
    assert all(r["completion_tokens"] == 4 and r["requests"] == 2 for r in records)
    assert {r["side"]: r["ttft_p50_ms"] for r in records} == {OURS: 12.0, BASELINE: 10.0}
    assert {r.worker for r in done[OURS].runs} == {0, 1}


def test_a_fixed_duration_batch_starts_no_request_after_its_end(monkeypatch):
    import types

    from serve_app.bench import schedule

    clock = Clock()
    monkeypatch.setattr(schedule, "time", types.SimpleNamespace(perf_counter=clock))

    async def one():  # each request takes 0.03 s of the fake clock
        started = clock()
        clock.now += 0.03
        await asyncio.sleep(0)
        return Run(ok=True, completion_tokens=1, started_at=started, ended_at=clock())

    async def sleep(_):
        pass

    plan = plan_batches([OURS, BASELINE], runs=2, round_size=1, warmup=1)
    began = clock()
    done = asyncio.run(run_plan(plan, {OURS: one, BASELINE: one}, 1, 0, sleep=sleep, batch_s=0.1))
    # the warm-up batches (one request per side) are counted by size; each counted batch by time:
    # requests start at 0, 0.03, 0.06, 0.09 of the batch, none at 0.12
    assert [len(done[side].runs) for side in (OURS, BASELINE)] == [8, 8] and done[OURS].batches == 2
    starts = [r.started_at - began for r in done[OURS].runs[:4]]
    assert starts == pytest.approx([0.06, 0.09, 0.12, 0.15])  # after the two warm-ups (0, 0.03)


def test_the_other_side_is_stopped_around_each_batch_its_quiet_waits_included():
    import contextlib

    meter = StubMeter()

    class StubAlone:
        @contextlib.contextmanager
        def running(self, side):
            meter.log.append(f"alone {side}")
            yield []
            meter.log.append("both")

    async def request():
        now = time.perf_counter()
        return Run(ok=True, completion_tokens=1, token_times=[now], started_at=now, ended_at=now)

    async def sleep(_):
        meter.log.append("sleep")

    plan = plan_batches([OURS, BASELINE], runs=1, round_size=1, warmup=0)
    asyncio.run(run_plan(plan, {OURS: request, BASELINE: request}, 1, 0, sleep=sleep, meter=meter, alone=StubAlone()))
    per_batch = ["sleep", "quiet", "snapshot", "quiet", "snapshot"]
    assert meter.log == [f"alone {OURS}", *per_batch, "both", f"alone {BASELINE}", *per_batch, "both"]


def test_an_engine_that_exited_is_not_compared():
    # A replica replaced during the run: its engine's pid is still tracked, gone or someone else's now.
    table = FakeTable(Clock())
    found = tracked()
    table.gone.add(226)
    envs = engine_envs(table, found)
    assert envs[OURS] == [] and [e["pid"] for e in envs[BASELINE]] == [301]
    assert mismatches(envs) == ["no vLLM engine process found for ours: the engine environment was not compared"]

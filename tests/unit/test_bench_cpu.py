"""Counting every CPU-second: which processes are each side's, what each is, the quiet wait,
the batch's CPU and CPU per 1,000 tokens, the idle command. Fake process tables and a fake clock
(tests/unit/fake_processes.py); no Ray, no vLLM."""

import asyncio
import signal
import time
from dataclasses import replace

import pytest

from serve_app.bench.cpu import Meter, measured, per_1k_tokens, steady_cpu
from serve_app.bench.idle import idle_text, measure_idle
from serve_app.bench.procs import BASELINE, CLIENT, OURS, DiscoveryError, Proc, discover, group_of
from tests.unit.fake_processes import CLIENT as CLIENT_PID
from tests.unit.fake_processes import OTHER_TENANT, Clock, FakeTable


def by_pid(found):
    return {t.pid: t for t in found}


# --- who is whose -------------------------------------------------------------------------------
def test_ours_is_every_process_of_the_cluster_on_the_target_port_and_nothing_else():
    table = FakeTable(Clock())
    found = by_pid(discover(table, ours_port=8000, baseline_port=8100, client_pid=CLIENT_PID))
    ours = {pid for pid, t in found.items() if t.side == OURS}
    # the driver and its monitor and reaper, GCS, raylet, dashboard (+ module), log monitor, the
    # client server, agents, Serve actors, HAProxy, the replicas and their children, the idle
    # worker, and the reparented HAProxy naming our node
    assert ours == {*range(200, 209), 210, 211, *range(220, 231)}
    assert not ours & set(range(500, 530))  # the other cluster on this host
    assert 240 not in found  # names our session but is no Ray program
    assert {pid for pid, t in found.items() if t.side == BASELINE} == {300, 301, 302}
    assert [pid for pid, t in found.items() if t.side == CLIENT] == [CLIENT_PID]


def test_the_groups_and_labels_a_reader_sees():
    found = by_pid(discover(FakeTable(Clock()), ours_port=8000, baseline_port=8100, client_pid=CLIENT_PID))
    groups = {pid: (t.group, t.label) for pid, t in found.items()}
    assert groups[200] == ("driver", "python3.11 serve")
    assert groups[201][0] == "GCS" and groups[202][0] == "raylet"
    assert groups[203] == ("dashboard", "python3.11 dashboard.py") and groups[204] == ("dashboard", "ray-dashboard-ServeHead-0")
    assert groups[205] == ("other Ray", "python3.11 log_monitor.py") and groups[206] == ("other Ray", "python3.11 monitor.py")
    assert groups[207] == ("other Ray", "python3.11 ray_process_reaper.py")
    assert groups[208] == ("other Ray", "python3.11 -m ray.util.client.server")
    assert groups[210][0] == "dashboard agent" and groups[211][0] == "runtime env agent"
    assert groups[220] == ("controller", "ray::ServeController")
    assert groups[221][0] == "HAProxy manager" and groups[222] == groups[230] == ("HAProxy", "haproxy")
    assert groups[223][0] == "Serve proxy"
    assert groups[224] == ("router replica", "ray::ServeReplica:serve_app:Router")  # the task suffix is dropped
    assert groups[225] == ("model replica actor", "ray::ServeReplica:serve_app:model-qwen-3.6-35b-a3b")
    assert groups[226] == groups[301] == ("EngineCore", "VLLM::EngineCore")
    assert groups[227][0] == "rate-limit actor" and groups[228] == ("other Ray", "ray::IDLE")
    assert groups[229] == ("other", "python3.11 -c")
    assert groups[300] == ("API server", "python3.11 -m vllm.entrypoints.openai.api_server")
    assert group_of(Proc(9, 1, ("VLLM::Worker_TP0",)))[0] == "engine worker"
    assert group_of(Proc(9, 1, ("ray::ServeReplica:app:Other",)))[0] == "other Ray"


def test_ray_start_without_a_driver_and_a_listener_we_cannot_see():
    table = FakeTable(Clock())
    # the other cluster (no driver: `ray start` leaves gcs_server to init) is found by its port
    other = discover(table, ours_port=8001, client_pid=CLIENT_PID)
    assert {t.group for t in other} >= {"GCS", "HAProxy", "router replica"} and "driver" not in {t.group for t in other}
    # the listener belongs to another user: with one cluster on the host, that one is it
    alone = FakeTable(Clock(), procs=[p for p in table.procs if not 500 <= p.pid < 530], listening={})
    assert 222 in by_pid(discover(alone, ours_port=8000, client_pid=CLIENT_PID))
    with pytest.raises(DiscoveryError, match="no Ray cluster on this host listens on port 8000"):
        discover(replace(table, listening={}), ours_port=8000, client_pid=CLIENT_PID)


def test_discovery_refuses_what_is_not_there():
    table = FakeTable(Clock())
    with pytest.raises(DiscoveryError, match="listens on port 9999"):
        discover(table, ours_port=9999, client_pid=CLIENT_PID)
    no_ray = FakeTable(Clock(), procs=[p for p in table.procs if p.pid in (1, 100, CLIENT_PID, 300, 301)])
    with pytest.raises(DiscoveryError, match="no local Ray cluster"):
        discover(no_ray, ours_port=8000, client_pid=CLIENT_PID)
    # the benchmark itself answering on the baseline's port (a test server) is no baseline
    with pytest.raises(DiscoveryError, match="8100"):
        discover(replace(table, listening={8100: {CLIENT_PID}}), ours_port=None, baseline_port=8100,
                 client_pid=CLIENT_PID)


# --- the quiet wait -----------------------------------------------------------------------------
def meter(table: FakeTable, **kwargs) -> Meter:
    clock = table.clock
    return Meter(table, lambda: discover(table, ours_port=8000, baseline_port=8100, client_pid=CLIENT_PID),
                 clock=clock, wall=clock, run_clock=clock, sleep=clock.sleep, **kwargs)


def idle_after(table: FakeTable, pid: int, seconds: float):
    """A meter's sleep on the fake clock after which ``pid`` (or ``OTHER_TENANT``) uses no CPU,
    ``seconds`` from now."""
    clock, ends = table.clock, table.clock.now + seconds

    async def sleep(step):
        clock.now += step
        if clock.now >= ends:
            table.set_rate(pid, 0.0)

    return sleep


def test_quiet_waits_until_the_spinning_engine_stops_and_measures_the_idle_floor():
    table = FakeTable(Clock())
    table.set_rate(220, 0.06)  # the controller's idle loop
    table.set_rate(224, 0.04)
    m = meter(table, window_s=0.5, margin_cores=0.05, timeout_s=10)
    windows = []

    async def spike_in_the_second_window(seconds):  # the dashboard's periodic work, once
        windows.append(seconds)
        table.set_rate(203, 0.4 if len(windows) == 2 else 0.0)
        table.clock.now += seconds

    m.sleep = spike_in_the_second_window
    floor = asyncio.run(m.measure_floor())
    assert floor == pytest.approx(0.10) and m.threshold_cores == pytest.approx(0.15)  # the spike is not the floor
    assert windows == [0.5] * 4

    table.set_rate(301, 1.0)  # bare vLLM's engine core still busy-polling after its batch
    m.sleep = idle_after(table, 301, 1.5)
    quiet = asyncio.run(m.wait_quiet())
    assert not quiet["timed_out"] and quiet["cores"] == pytest.approx(0.10)
    assert quiet["waited_s"] == pytest.approx(2.0)  # three busy windows, then a quiet one


def test_quiet_gives_up_at_the_timeout_and_says_so():
    table = FakeTable(Clock())
    table.set_rate(226, 1.5)  # an engine that never stops
    m = meter(table, window_s=0.5, timeout_s=3)
    quiet = asyncio.run(m.wait_quiet())
    assert quiet["timed_out"] and quiet["waited_s"] == pytest.approx(3.0) and quiet["cores"] == pytest.approx(1.5)


def test_quiet_waits_for_a_job_beside_the_servers_too():
    # A test suite or a build on the host takes the batch's cores as surely as a server would.
    table = FakeTable(Clock())
    m = meter(table, window_s=0.5, margin_cores=0.05, timeout_s=10)
    table.set_rate(OTHER_TENANT, 0.8)
    m.sleep = idle_after(table, OTHER_TENANT, 1.5)
    quiet = asyncio.run(m.wait_quiet())
    assert not quiet["timed_out"] and quiet["waited_s"] == pytest.approx(2.0)


@pytest.mark.parametrize("host_known", [True, False])
def test_a_process_exiting_in_a_window_is_not_a_negative_rate(host_known):
    # Its lifetime's CPU-seconds left the servers' sum with it: read as a rate, -7.6 cores, and a
    # floor below zero that no later window reaches (every wait then ran to its timeout).
    table = FakeTable(Clock())
    table.base[228] = 4.0  # an idle worker with 4 CPU-s behind it
    table.set_rate(226, 0.4)  # the engine, still spinning
    if not host_known:
        table.host_busy_s = lambda: None
    m = meter(table, window_s=0.5, timeout_s=10)

    async def sleep(seconds):
        table.clock.now += seconds
        table.gone.add(228)

    m.sleep = sleep
    assert asyncio.run(m.measure_floor(windows=1)) == pytest.approx(0.4)


def test_each_side_runs_alone_and_the_other_is_continued_whatever_happens(exit_handlers):
    from serve_app.bench.alone import Alone, continue_all

    table = FakeTable(Clock())
    said = []
    alone = Alone(meter(table), say=said.append)
    with alone.running(OURS) as stopped:
        assert {t.pid for t in stopped} == {300, 301, 302}  # bare vLLM: never the client, never ours
        assert table.signals == [(pid, signal.SIGSTOP) for pid in (300, 301, 302)]
    assert table.signals[3:] == [(pid, signal.SIGCONT) for pid in (300, 301, 302)]
    assert "kill -CONT" in said[0] and len(said) == 1  # the pids for a SIGKILLed benchmark, said once
    table.signals.clear()
    with pytest.raises(KeyError), alone.running(BASELINE):
        raise KeyError("a batch that failed")
    ours = {pid for pid, sig in table.signals if sig == signal.SIGSTOP}
    assert 222 in ours and 226 in ours and CLIENT_PID not in ours and not ours & {300, 301, 302}
    assert {pid for pid, sig in table.signals if sig == signal.SIGCONT} == ours
    table.signals.clear()
    running = alone.running(OURS)
    running.__enter__()  # then the process ends (atexit): what is stopped is continued
    continue_all()
    assert [sig for _, sig in table.signals] == [signal.SIGSTOP] * 3 + [signal.SIGCONT] * 3
    running.__exit__(None, None, None)  # nothing left to continue twice
    assert len(table.signals) == 6


def test_a_side_alone_waits_for_quiet_against_its_own_idle_floor():
    # Measured with both sides up, the floor holds ours' idle Ray cost: bare vLLM, alone, could
    # start its batch with that much of its own tail still running.
    table = FakeTable(Clock())
    table.set_rate(220, 0.10)  # ours' controller, idle
    m = meter(table, window_s=0.5, margin_cores=0.05, timeout_s=10)
    assert asyncio.run(m.measure_floor()) == pytest.approx(0.10)
    table.set_rate(220, 0.0)  # ours stopped
    assert asyncio.run(m.measure_floor(side=BASELINE)) == pytest.approx(0.0) and m.floor_cores == pytest.approx(0.10)
    table.set_rate(301, 0.12)  # bare vLLM's engine core, not idle yet
    m.sleep = idle_after(table, 301, 1.0)
    assert asyncio.run(m.wait_quiet(BASELINE))["waited_s"] == pytest.approx(1.5)  # under 0.15 was not quiet
    # a side without a floor of its own, or none named: the shared one
    assert m.threshold(OURS) == pytest.approx(0.15) and m.threshold() == pytest.approx(0.15)


def test_a_process_not_ours_to_stop_is_said_and_recorded_once(exit_handlers):
    from serve_app.bench.alone import Alone

    table = FakeTable(Clock())
    sent = table.signal
    table.signal = lambda pid, created, signum: False if pid == 301 else sent(pid, created, signum)  # EPERM
    said = []
    alone = Alone(meter(table), say=said.append)
    for _ in range(2):
        with alone.running(OURS) as stopped:
            assert {t.pid for t in stopped} == {300, 302}
    assert alone.refused == {301: "VLLM::EngineCore"}
    assert [line for line in said if line.startswith("warning")] == [
        "warning: could not stop VLLM::EngineCore [301]: it runs beside the other side's batches"]


@pytest.fixture
def exit_handlers(monkeypatch):
    """``alone``'s SIGTERM handler installed over ``previous`` (set by the test), and everything
    put back after: this process's handlers, the module's state, its atexit hook."""
    import atexit

    from serve_app.bench import alone as module

    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGHUP)}
    kills = []
    monkeypatch.setattr(module, "_installed", False)
    monkeypatch.setattr(module.os, "kill", lambda pid, number: kills.append(number))

    def install(previous):
        signal.signal(signal.SIGTERM, previous)
        monkeypatch.setattr(module, "_installed", False)
        module._install_exit_handlers()
        return signal.getsignal(signal.SIGTERM)

    yield install, kills
    for signum, handler in saved.items():
        signal.signal(signum, handler)
    atexit.unregister(module.continue_all)


def test_sigterm_continues_what_is_stopped_only_when_it_ends_the_benchmark(exit_handlers):
    from serve_app.bench.alone import Alone

    install, kills = exit_handlers
    table = FakeTable(Clock())
    alone = Alone(meter(table), say=lambda line: None)

    handler = install(signal.SIG_IGN)  # under nohup: the run goes on, the other side still stopped
    with alone.running(OURS):
        handler(signal.SIGTERM, None)
        assert [sig for _, sig in table.signals] == [signal.SIGSTOP] * 3 and kills == []

    def own(number, frame):
        raise SystemExit(143)

    handler = install(own)  # a handler of the program's own: it ends the run, ``running`` continues
    table.signals.clear()
    with pytest.raises(SystemExit), alone.running(OURS):
        handler(signal.SIGTERM, None)
    assert [sig for _, sig in table.signals] == [signal.SIGSTOP] * 3 + [signal.SIGCONT] * 3

    handler = install(signal.SIG_DFL)  # the default: continued first, then the signal's own action
    table.signals.clear()
    with alone.running(OURS):
        handler(signal.SIGTERM, None)
        assert [sig for _, sig in table.signals] == [signal.SIGSTOP] * 3 + [signal.SIGCONT] * 3
        assert kills == [signal.SIGTERM] and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert len(table.signals) == 6  # nothing continued twice


# --- the batch's CPU ----------------------------------------------------------------------------
def test_a_batch_is_charged_every_process_of_each_side_born_and_exited_ones_too():
    table = FakeTable(Clock())
    m = meter(table, window_s=0.5, timeout_s=5)

    async def batch():
        table.set_rate(222, 0.2)  # HAProxy
        table.set_rate(224, 0.5)  # router
        table.set_rate(225, 0.8)  # model replica actor
        table.set_rate(226, 1.0)  # EngineCore
        table.set_rate(CLIENT_PID, 0.3)
        table.set_rate(301, 0.1)  # bare vLLM's engine, idle-ish
        table.set_rate(OTHER_TENANT, 0.25)  # someone else's job on the host
        # a new Ray worker is born 1 s in, with 0.4 s of CPU by the end
        table.procs.append(Proc(250, 202, ("ray::IDLE",), create_time=table.clock.now + 1))
        table.base[250] = 0.4
        table.gone.add(228)  # the idle worker exits
        table.clock.now += 10
        for pid in (222, 224, 225, 226, CLIENT_PID, 301):
            table.set_rate(pid, 0.0)
        table.set_rate(OTHER_TENANT, 0.0)
        return "done"

    result, cpu, samples = asyncio.run(measured(m, batch))
    assert result == "done" and not cpu["settle"]["timed_out"]
    assert [at for at, _ in samples] == [1000.0, 1010.0]  # the batch never yielded: its start and end only
    ours = cpu["sides"][OURS]
    assert ours["groups"]["HAProxy"] == pytest.approx(2.0) and ours["groups"]["router replica"] == pytest.approx(5.0)
    assert ours["groups"]["model replica actor"] == pytest.approx(8.0) and ours["groups"]["EngineCore"] == pytest.approx(10.0)
    assert ours["groups"]["other Ray"] == pytest.approx(0.4)  # the worker born in the window, whole
    assert ours["total"] == pytest.approx(25.4)
    assert cpu["sides"][BASELINE]["total"] == pytest.approx(1.0) and cpu["sides"][CLIENT]["total"] == pytest.approx(3.0)
    assert cpu["exited"] == ["ray::IDLE [228]"]
    # host busy − everything counted = the other tenant (plus what the exited worker used: nothing here)
    assert cpu["host_other_s"] == pytest.approx(2.5)
    assert cpu["window_s"] == pytest.approx(10.5)  # the batch and the one quiet window after it


def test_steady_load_cpu_is_what_the_sustained_window_used_without_ramp_up_tail_or_the_quiet_after():
    """Samples while the batch runs; the steady figure is the CPU and the tokens between the first
    and the last sample inside the sustained window: a side's idle cost at its rate under load,
    not for as long as the quiet after the batch takes to come."""
    table = FakeTable(Clock())
    clock = table.clock

    async def yield_only(_seconds):  # the batch below moves the clock; the sampler just takes turns
        await asyncio.sleep(0)

    m = Meter(table, lambda: discover(table, ours_port=8000, baseline_port=8100, client_pid=CLIENT_PID),
              window_s=0.5, clock=clock, wall=clock, run_clock=clock, sleep=yield_only)

    async def batch():
        for step in range(16):  # 8 s in half-second steps: ramp-up 0–2 s, steady 2–6 s, tail 6–8 s
            steady = 4 <= step < 12
            table.set_rate(224, 0.5 if steady else 0.1)  # the router
            table.set_rate(226, 1.0 if steady else 0.2)  # the engine core
            table.set_rate(220, 0.05)  # the controller's idle loop, all along
            clock.now += 0.5
            await asyncio.sleep(0)
        table.set_rate(224, 0.0), table.set_rate(226, 0.0), table.set_rate(220, 0.0)

    _, whole, samples = asyncio.run(measured(m, batch))
    assert [at for at, _ in samples][:3] == [1000.0, 1001.0, 1001.5] and samples[-1][0] == 1008.0
    asked = []

    def tokens_between(start, end):
        asked.append((start, end))
        return 100 * (end - start)

    steady = steady_cpu(m, samples, {"start": 1002.2, "end": 1006.0}, tokens_between)
    # the first sample inside is 1002.5, the last 1006.0: 3.5 s at the steady rates
    assert asked == [(1002.5, 1006.0)] and steady["tokens"] == pytest.approx(350.0)
    groups = steady["sides"][OURS]["groups"]
    assert groups["router replica"] == pytest.approx(0.5 * 3.5) and groups["EngineCore"] == pytest.approx(1.0 * 3.5)
    assert groups["controller"] == pytest.approx(0.05 * 3.5)
    assert steady["window_s"] == pytest.approx(3.5)
    # the whole batch's figure has the ramp-up and the tail in it (4 s at the low rates)
    assert whole["sides"][OURS]["groups"]["router replica"] == pytest.approx(0.5 * 4 + 0.1 * 4)
    # a window shorter than the sampling period has no steady figure; nor has a batch without one
    assert steady_cpu(m, samples, {"start": 1002.6, "end": 1002.9}, tokens_between) is None
    assert steady_cpu(m, samples, None, tokens_between) is None


def test_a_process_titled_after_the_meter_first_saw_it_is_counted_in_its_new_group():
    """vLLM titles its engine processes as the model loads: a run started meanwhile saw one untitled."""
    table = FakeTable(Clock())
    worker = next(p for p in table.procs if p.pid == 226)
    untitled = replace(worker, cmdline=("/usr/bin/python3", "-c", "from multiprocessing.spawn import spawn_main"))
    table.procs[table.procs.index(worker)] = untitled
    m = meter(table)
    assert m.tracked[226].group == "other"
    table.procs[table.procs.index(untitled)] = worker  # retitled, the same process
    before = m.snapshot()
    table.set_rate(226, 1.0)
    table.clock.now += 10
    cpu = m.cpu_between(before, m.snapshot())
    assert cpu["sides"][OURS]["groups"]["EngineCore"] == pytest.approx(10.0)
    assert cpu["sides"][OURS]["groups"].get("other", 0.0) == 0.0


def test_a_process_older_than_the_window_but_unseen_at_its_start_is_not_charged_whole():
    table = FakeTable(Clock())
    m = meter(table)
    before = m.snapshot()
    table.procs.append(Proc(260, 202, ("ray::IDLE",), create_time=table.clock.now - 100))  # missed by discovery
    table.base[260] = 50.0
    table.clock.now += 5
    cpu = m.cpu_between(before, m.snapshot())
    assert cpu["missed"] == ["ray::IDLE [260]"] and "ray::IDLE [260]" not in cpu["sides"][OURS]["processes"]


def test_cpu_per_thousand_tokens_per_group_side_and_ratio():
    def batch(side, tokens, own, client, other):
        return {"side": side, "completion_tokens": tokens, "cpu": {"window_s": 10.0, "sides": {
            side: {"total": sum(own.values()), "groups": own, "processes": {f"{g} [1]": v for g, v in own.items()}},
            CLIENT: {"total": client}, (BASELINE if side == OURS else OURS): {"total": other}}}}

    batches = [batch(OURS, 1000, {"EngineCore": 4.0, "router replica": 1.0}, 0.5, 0.0),
               batch(OURS, 3000, {"EngineCore": 12.0, "router replica": 2.0, "HAProxy": 1.0}, 1.5, 0.1),
               batch(BASELINE, 4000, {"EngineCore": 14.0, "API server": 2.0}, 2.0, 1.2),
               {"side": OURS, "completion_tokens": 50, "cpu": None}]  # a batch without CPU is left out
    cpu = per_1k_tokens(batches)
    assert cpu[OURS]["tokens"] == 4000 and cpu[OURS]["total"] == pytest.approx(5.0)
    assert list(cpu[OURS]["groups"]) == ["HAProxy", "router replica", "EngineCore"]  # report order
    assert cpu[OURS]["groups"]["router replica"] == pytest.approx(0.75) and cpu[OURS]["client"] == pytest.approx(0.5)
    assert cpu[BASELINE]["total"] == pytest.approx(4.0) and cpu["ratio_total"] == pytest.approx(1.25)
    assert cpu[BASELINE]["other_server_cpu_s"] == pytest.approx(1.2)  # ours' idle tax during bare vLLM's batch
    # no batch measured a steady window: no steady figure, no steady ratio
    assert cpu[OURS]["steady"]["total"] is None and "ratio_steady" not in cpu


def test_steady_cpu_per_thousand_tokens_sums_the_batches_steady_windows():
    def batch(side, tokens, own, steady_tokens, steady_own):
        return {"side": side, "completion_tokens": tokens,
                "cpu": {"window_s": 20.0, "sides": {side: {"total": sum(own.values()), "groups": own}}},
                "steady_cpu": None if steady_own is None else {"window_s": 5.0, "tokens": steady_tokens, "sides": {
                    side: {"total": sum(steady_own.values()), "groups": steady_own}}}}

    cpu = per_1k_tokens([
        batch(OURS, 1000, {"EngineCore": 4.0, "controller": 1.0}, 400.0, {"EngineCore": 1.6, "controller": 0.1}),
        batch(OURS, 1000, {"EngineCore": 4.0, "controller": 1.0}, 600.0, {"EngineCore": 2.4, "controller": 0.1}),
        batch(OURS, 1000, {"EngineCore": 4.0}, 0.0, None),  # no steady window: whole-batch figures only
        batch(BASELINE, 2000, {"EngineCore": 8.0}, 1000.0, {"EngineCore": 4.0}),
    ])
    steady = cpu[OURS]["steady"]
    assert steady["tokens"] == pytest.approx(1000.0) and steady["window_s"] == pytest.approx(10.0)
    assert steady["total"] == pytest.approx(4.2) and steady["groups"]["controller"] == pytest.approx(0.2)
    assert cpu[OURS]["total"] == pytest.approx(14.0 / 3)  # the whole batches: idle windows charged
    assert cpu["ratio_steady"] == pytest.approx(4.2 / 4.0) and cpu["ratio_total"] == pytest.approx((14.0 / 3) / 4.0)


# --- serve-app idle -----------------------------------------------------------------------------
def test_idle_reports_every_process_in_percent_of_a_core_against_the_target():
    clock = Clock()
    table = FakeTable(clock)
    for pid, cores in {220: 0.058, 201: 0.024, 224: 0.022, 203: 0.03, 204: 0.02, 223: 0.017, 225: 0.016,
                       221: 0.012, 227: 0.011, 202: 0.01, 301: 0.5, CLIENT_PID: 0.9}.items():
        table.set_rate(pid, cores)
    table.thread_shares[220] = {"main": 0.25, "ray::IDLE": 0.75}  # the controller's loop in its own thread
    table.thread_shares[201] = {"main": 0.5, "client.poll0": 0.5}
    # wake-ups: Ray's 10 ms signal check in every actor's main thread, and 15 gloo loops in one
    table.wakeup_rates[220] = {"main": 100, "ray::IDLE": 20}
    table.wakeup_rates[224] = {"main": 100}
    table.wakeup_rates[301] = {"gloo_tcp_loop": 1500}  # bare vLLM: not the service
    clock.now = 7.0  # a window that does not start at zero: counts are differences
    result = measure_idle(table, 8000, 30, sleep=clock.sleep_sync, clock=clock, client_pid=CLIENT_PID)
    assert result["seconds"] == pytest.approx(30)
    assert result["total_pct"] == pytest.approx(22.0)  # bare vLLM and the command itself are not the service
    assert result["processes"][0] == {"group": "controller", "process": "ray::ServeController", "pid": 220,
                                      "pct_core": pytest.approx(5.8),
                                      "threads": {"ray::IDLE": pytest.approx(4.35), "main": pytest.approx(1.45)},
                                      "wakeups_per_s": pytest.approx(120)}
    assert result["groups"]["dashboard"] == pytest.approx(5.0) and not result["within_target"]
    # across processes, by thread name: every other process's CPU is its main thread's here
    assert list(result["threads"]) == ["main", "ray::IDLE", "client.poll0"]
    assert result["threads"]["client.poll0"] == pytest.approx(1.2)
    assert sum(result["threads"].values()) == pytest.approx(result["total_pct"])
    assert result["thread_wakeups_per_s"] == {"main": pytest.approx(200), "ray::IDLE": pytest.approx(20)}
    assert result["group_wakeups_per_s"]["controller"] == pytest.approx(120)
    assert result["group_wakeups_per_s"]["dashboard"] == 0 and result["wakeups_per_s"] == pytest.approx(220)
    text = idle_text(result)
    assert "| controller | ray::ServeController | 220 | 5.80 % | 120 | ray::IDLE 4.35, main 1.45 |" in text
    assert "| client.poll0 | 1.20 % | 0 |" in text and f"| main | {result['threads']['main']:.2f} % | 200 |" in text
    assert "total 22.00 % of one core, 220 wake-ups a second: OVER the target of 5.0 %" in text
    quiet = FakeTable(clock)
    quiet.set_rate(220, 0.01)
    calm = measure_idle(quiet, 8000, 10, sleep=clock.sleep_sync, clock=clock, client_pid=CLIENT_PID)
    assert calm["within_target"] and calm["total_pct"] == pytest.approx(1.0)
    # a result saved before wake-ups were counted still prints, with dashes where they would be
    older = {k: v for k, v in calm.items() if "wakeups" not in k}
    older["processes"] = [{k: v for k, v in row.items() if k != "wakeups_per_s"} for row in calm["processes"]]
    text = idle_text(older)
    assert "| controller | 1.00 % | — |" in text and "1.00 % of one core, — wake-ups" in text


def test_idle_wakeups_are_counted_thread_by_thread_so_a_thread_that_ends_takes_nothing_from_its_namesakes():
    """gRPC names its timer threads alike and starts and ends them: summed by name at both ends, a
    thread that ended in the window would take its whole life's count off the others'."""
    clock = Clock()
    table = FakeTable(clock)
    table.set_rate(220, 0.01)
    clock.now = 100.0
    table.wakeup_counts[220] = {7001: ("grpc_timer", 1000), 7002: ("grpc_timer", 5000)}  # 7002 ends

    def sleep(seconds: float) -> None:
        clock.sleep_sync(seconds)
        table.wakeup_counts[220] = {7001: ("grpc_timer", 1300), 7003: ("grpc_timer", 60)}  # 7003: new

    result = measure_idle(table, 8000, 30, sleep=sleep, clock=clock, client_pid=CLIENT_PID)
    assert result["thread_wakeups_per_s"] == {"grpc_timer": pytest.approx(12)}  # (300 + 60) / 30
    assert result["group_wakeups_per_s"]["controller"] == pytest.approx(12)
    assert "| grpc_timer | 0.00 % | 12 |" in idle_text(result)  # wakeful, CPU too small to rank: listed


def _by_name(threads: dict[int, tuple[str, float]]) -> dict[str, float]:
    summed: dict[str, float] = {}
    for name, value in threads.values():
        summed[name] = summed.get(name, 0) + value
    return summed


# --- the real table, on this very process -------------------------------------------------------
def test_the_host_table_reads_this_process_its_socket_and_its_cpu():
    import os
    import socket

    from serve_app.bench.host import PsutilTable

    table = PsutilTable()
    me = next(p for p in table.processes() if p.pid == os.getpid())
    assert me.ppid == os.getppid() and "pytest" in " ".join(me.cmdline)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        assert table.listeners(sock.getsockname()[1]) == {os.getpid()}
    used = table.cpu_seconds(me.pid, me.create_time)
    assert used is not None and used > 0 and table.host_busy_s() >= used
    assert table.cpu_seconds(me.pid, me.create_time + 5) is None  # the pid, but not this process
    env = table.engine_env(me.pid, ["OMP_NUM_THREADS", "PATH"])
    assert env["nice"] == os.nice(0) and set(env["affinity"]) == os.sched_getaffinity(0)
    assert env["env"]["PATH"] == os.environ["PATH"]


def test_the_engine_env_counts_threads_by_the_cpus_each_is_pinned_to():
    """vLLM's CPU backend pins each OpenMP thread to its own CPU, which the process's affinity does
    not show: one thread pinned here shows as its own entry, counted in ``threads``."""
    import os
    import threading

    from serve_app.bench.host import PsutilTable

    cpu = min(os.sched_getaffinity(0))
    pinned, done = threading.Event(), threading.Event()

    def pin_and_wait():
        os.sched_setaffinity(0, {cpu})  # 0: the calling thread, on Linux
        pinned.set()
        done.wait(10)

    thread = threading.Thread(target=pin_and_wait)
    thread.start()
    try:
        pinned.wait(10)
        env = PsutilTable().engine_env(os.getpid(), [])
    finally:
        done.set()
        thread.join()
    assert env["thread_affinities"].get(str(cpu), 0) >= 1
    assert env["threads"] == sum(env["thread_affinities"].values()) >= 2


def test_the_host_table_splits_a_process_cpu_by_thread_name():
    import os
    import threading

    from serve_app.bench.host import PsutilTable

    table = PsutilTable()
    me = next(p for p in table.processes() if p.pid == os.getpid())
    done = threading.Event()

    def spin():
        while not done.is_set():
            pass

    worker = threading.Thread(target=spin, name="spinner")
    worker.start()
    # Linux names a thread only when asked to (pthread_setname_np); Python's name is not the OS's
    with open(f"/proc/{os.getpid()}/task/{worker.native_id}/comm", "w") as comm:
        comm.write("idle-test-spin")
    deadline = time.monotonic() + 30
    try:  # read while it runs: a thread that ended is not listed (its CPU stays in the process's)
        while _by_name(threads := table.thread_cpu(me.pid, me.create_time)).get("idle-test-spin", 0) < 0.05:
            assert time.monotonic() < deadline, threads
            time.sleep(0.05)
    finally:
        done.set()
        worker.join()
    assert threads[me.pid][0] == "main" and threads[worker.native_id][0] == "idle-test-spin"
    by_name = _by_name(threads)
    assert by_name["main"] > 0 and "spinner" not in by_name  # this thread, and the OS's name only
    assert sum(by_name.values()) <= table.cpu_seconds(me.pid, me.create_time) + 0.05
    assert table.thread_cpu(me.pid, me.create_time + 5) is None


def test_the_host_table_counts_a_threads_wakeups_by_its_name():
    import os
    import threading

    from serve_app.bench.host import PsutilTable

    table = PsutilTable()
    me = next(p for p in table.processes() if p.pid == os.getpid())
    named, napped = threading.Event(), threading.Event()
    finish = threading.Event()

    def nap():  # 50 sleeps: 50 times switched out, at least
        named.wait()
        for _ in range(50):
            time.sleep(0.001)
        napped.set()
        finish.wait()

    worker = threading.Thread(target=nap)
    worker.start()
    with open(f"/proc/{os.getpid()}/task/{worker.native_id}/comm", "w") as comm:
        comm.write("idle-test-nap")
    before = table.thread_wakeups(me.pid, me.create_time)
    named.set()
    try:
        assert napped.wait(30)
        after = table.thread_wakeups(me.pid, me.create_time)
    finally:
        finish.set()
        worker.join()
    nap = worker.native_id
    assert before[nap][0] == after[nap][0] == "idle-test-nap" and after[nap][1] - before[nap][1] >= 50
    assert after[me.pid][0] == "main" and after[me.pid][1] >= before[me.pid][1]
    assert table.thread_wakeups(me.pid, me.create_time + 5) is None


def test_a_threads_switches_are_read_from_its_status():
    from serve_app.bench.host import parse_thread_switches

    switches = "voluntary_ctxt_switches:\t{}\nnonvoluntary_ctxt_switches:\t{}\n"
    status = "Name:\tgloo_tcp_loop\nState:\tS (sleeping)\n" + switches.format(1480, 20)
    assert parse_thread_switches(status) == ("gloo_tcp_loop", 1500)
    assert parse_thread_switches("Name:\ta: b \n" + switches.format(1, 0)) == ("a: b ", 1)


def test_a_thread_name_may_hold_spaces_and_parentheses():
    from serve_app.bench.host import CLOCK_TICKS, parse_thread_stat

    fields = ["S"] + ["0"] * 10 + [str(3 * CLOCK_TICKS), str(CLOCK_TICKS)] + ["0"] * 30
    assert parse_thread_stat(f"1234 (a (b) c) {' '.join(fields)}\n") == ("a (b) c", pytest.approx(4.0))


def test_an_environment_block_is_read_whole_even_when_a_set_title_left_empty_entries_first():
    """vLLM's engine core sets its title (setproctitle), which can leave its environ block
    starting with empty entries; psutil reads nothing then, and the engine check read None."""
    from serve_app.bench.host import parse_environ

    block = b"\0\0\0OMP_NUM_THREADS=1\0VLLM_CPU_KVCACHE_SPACE=1\0A=b=c\0\0"
    assert parse_environ(block) == {"OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "A": "b=c"}


def test_a_retitled_process_missing_variables_are_read_from_the_nearest_ancestor_that_has_them():
    """Bare vLLM's worker: its title overwrote the start of its environ block, so OMP_NUM_THREADS
    read as missing there while its engine core (its parent) shows it."""
    from serve_app.bench.host import fill_from_ancestors

    own = {"OMP_NUM_THREADS": None, "VLLM_CPU_KVCACHE_SPACE": None, "MKL_NUM_THREADS": None, "A": "own"}
    ancestors = [(20, {"VLLM_CPU_KVCACHE_SPACE": "1", "A": "parent"}), (10, {"OMP_NUM_THREADS": "1",
                                                                             "VLLM_CPU_KVCACHE_SPACE": "9"})]
    env, inherited = fill_from_ancestors(own, ancestors)
    assert env == {"OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "MKL_NUM_THREADS": None, "A": "own"}
    assert inherited == {"OMP_NUM_THREADS": 10, "VLLM_CPU_KVCACHE_SPACE": 20}
    assert fill_from_ancestors(own, []) == (own, {})

"""The gateway's processes off the engine worker's cores (serve_app/runtime/cpus.py): the mask is
read back from /proc for every thread of a real process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from serve_app.runtime.cpus import (
    GATEWAY_CPUS_ENV,
    HOST_CPUS_ENV,
    _process_tree,
    engine_core_beside_worker,
    gateway_cpus,
    local_default,
    local_setting,
    parse_cpu_list,
    physical_cores,
)
from tests.conftest import REPO

HOST = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(HOST) < 2, reason="pinning is only visible with two CPUs or more")


def thread_masks(pid: int) -> dict[int, str]:
    """Every thread's ``Cpus_allowed_list`` (the kernel's own account of the mask)."""
    masks = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        masks[int(tid)] = next(line.split(":")[1].strip() for line in status.splitlines()
                               if line.startswith("Cpus_allowed_list"))
    return masks


@pytest.mark.parametrize("text, cpus", [("1", {1}), ("0,2-3", {0, 2, 3}), (" 4 , 6-6 ", {4, 6})])
def test_a_cpu_list_reads_as_the_kernel_writes_it(text, cpus):
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["one", "1-", "-1", "3-1", "1,,2", "0x1"])
def test_a_value_that_is_not_a_cpu_list_names_the_variable(text):
    with pytest.raises(ValueError, match=GATEWAY_CPUS_ENV):
        parse_cpu_list(text)


def test_unset_or_empty_pins_nothing_and_cpus_the_node_may_not_use_are_dropped(monkeypatch):
    assert gateway_cpus({}) is None and gateway_cpus({GATEWAY_CPUS_ENV: " "}) is None
    beyond = (os.cpu_count() or 1) + 7
    assert gateway_cpus({GATEWAY_CPUS_ENV: f"{HOST[0]},{beyond}"}) == {HOST[0]}
    with pytest.raises(ValueError, match="names none of the CPUs this node may use"):
        gateway_cpus({GATEWAY_CPUS_ENV: str(beyond)})
    # A node started on fewer CPUs than the host has (``taskset -c 0 make run``): never beyond them.
    monkeypatch.setenv(HOST_CPUS_ENV, str(HOST[0]))
    with pytest.raises(ValueError, match="names none of the CPUs this node may use"):
        gateway_cpus({GATEWAY_CPUS_ENV: str(beyond - 1)})


def _topology(tmp_path: Path, cores: dict[int, tuple[int, int]]) -> str:
    """A sysfs ``cpu`` directory: CPU number → (package, core)."""
    for cpu, (package, core) in cores.items():
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{package}\n")
        (topology / "core_id").write_text(f"{core}\n")
    return str(tmp_path)


def test_hyperthreads_of_one_core_are_one_core_and_unknown_cpus_count_alone(tmp_path):
    sys_cpu = _topology(tmp_path, {0: (0, 0), 1: (0, 0), 2: (0, 1), 3: (1, 0)})
    assert physical_cores({0, 1}, sys_cpu) == 1
    assert physical_cores({0, 1, 2, 3}, sys_cpu) == 3  # package 1's core 0 is another core
    assert physical_cores({0, 8, 9}, sys_cpu) == 3  # no topology for 8 and 9: one core each


def test_one_host_keeps_its_last_cpu_for_the_gateway_only_with_two_physical_cores(tmp_path):
    if len(HOST) < 2:
        assert local_default() == ""
        return
    two_cores = _topology(tmp_path / "two", {cpu: (0, n) for n, cpu in enumerate(HOST)})
    one_core = _topology(tmp_path / "one", {cpu: (0, 0) for cpu in HOST})  # a VM's two hyperthreads
    assert local_default(two_cores) == str(HOST[-1])
    assert local_default(one_core) == ""  # vLLM would bind its worker to that last CPU itself


def test_a_value_set_by_the_caller_wins_and_empty_pins_nothing(monkeypatch):
    """`make run` and the integration session run with what the caller set, else the default."""
    monkeypatch.delenv(GATEWAY_CPUS_ENV, raising=False)
    assert local_setting() == local_default()
    monkeypatch.setenv(GATEWAY_CPUS_ENV, "")
    assert local_setting() == ""
    monkeypatch.setenv(GATEWAY_CPUS_ENV, "0")
    assert local_setting() == "0"
    shown = subprocess.run([sys.executable, "-m", "serve_app.runtime.cpus"], capture_output=True, text=True,
                           env={**os.environ, GATEWAY_CPUS_ENV: ""}, check=True)
    assert shown.stdout == "\n"  # what `make run` exports: nothing pinned


def _run_pinned(value: str) -> subprocess.Popen:
    """A process with a thread started before the call and one after, calling what a router or
    model replica calls when it starts; it prints its pid and waits for stdin to close."""
    script = (
        "import sys, threading\n"
        "from serve_app.runtime.cpus import keep_off_engine_cores\n"
        "stop = threading.Event()\n"
        "threading.Thread(target=stop.wait).start()\n"
        "print(keep_off_engine_cores('test'), flush=True)\n"
        "threading.Thread(target=stop.wait).start()\n"
        "print(len(threading.enumerate()), flush=True)\n"
        "sys.stdin.read(); stop.set()\n"
    )
    env = {**os.environ, GATEWAY_CPUS_ENV: value}
    return subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@needs_two
def test_every_thread_of_a_gateway_process_is_on_the_gateway_cpu_before_and_after_the_call():
    last = HOST[-1]
    proc = _run_pinned(str(last))
    try:
        assert proc.stdout.readline().strip() == f"{{{last}}}"
        assert int(proc.stdout.readline()) == 3
        masks = thread_masks(proc.pid)
        assert len(masks) >= 3 and set(masks.values()) == {str(last)}
    finally:
        proc.communicate("", timeout=30)
    assert proc.returncode == 0


@needs_two
def test_a_bad_value_is_logged_and_leaves_the_process_where_it_was():
    proc = _run_pinned("engine")
    try:
        assert proc.stdout.readline().strip() == "None"
        proc.stdout.readline()
        assert set(thread_masks(proc.pid).values()) == {thread_masks(os.getpid())[os.getpid()]}
    finally:
        _, stderr = proc.communicate("", timeout=30)
    assert "test left where the kernel puts it" in stderr and GATEWAY_CPUS_ENV in stderr


@needs_two
def test_a_node_started_pinned_gives_its_engine_the_whole_host_and_keeps_the_rest_pinned():
    """``python -m serve_app.runtime.cpus <command>`` (how `make run` starts Ray): the command runs
    on the gateway's CPU; inside it, a process born in ``engine_start`` (the engine core) has the
    whole host, and the starting process is back on the gateway's CPU afterwards, every thread."""
    last = HOST[-1]
    script = (
        "import json, os, subprocess, sys, threading\n"
        "from serve_app.runtime.cpus import engine_start\n"
        "before = sorted(os.sched_getaffinity(0))\n"
        "stop = threading.Event()\n"
        "threading.Thread(target=stop.wait).start()\n"
        "with engine_start('test'):\n"
        "    engine = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'], stdin=subprocess.PIPE)\n"
        "masks = {frozenset(os.sched_getaffinity(int(t))) for t in os.listdir('/proc/self/task')}\n"
        "print(json.dumps([before, sorted(os.sched_getaffinity(engine.pid)), [sorted(m) for m in masks]]), flush=True)\n"
        "engine.communicate(b''); stop.set()\n"
    )
    env = {**os.environ, GATEWAY_CPUS_ENV: str(last)}
    done = subprocess.run([sys.executable, "-m", "serve_app.runtime.cpus", sys.executable, "-c", script],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=True)
    started_on, engine, threads = json.loads(done.stdout)
    assert started_on == [last]  # the command (Ray, in `make run`) on the gateway's CPU
    assert engine == HOST  # the engine's process born with the whole host
    assert threads == [[last]]  # and every thread of the starting process back on the gateway's


@needs_two
def test_an_engine_is_given_back_the_starters_cpus_not_the_whole_host():
    """A node whose starter could use only the gateway's CPU: the engine gets that, no more."""
    last = HOST[-1]
    script = (
        "import os, subprocess, sys\n"
        "from serve_app.runtime.cpus import engine_start\n"
        "with engine_start('test'):\n"
        "    engine = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'], stdin=subprocess.PIPE)\n"
        "print(sorted(os.sched_getaffinity(engine.pid)), flush=True)\n"
        "engine.communicate(b'')\n"
    )
    env = {**os.environ, GATEWAY_CPUS_ENV: str(last), HOST_CPUS_ENV: str(last)}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60, check=True)
    assert json.loads(done.stdout) == [last]


def test_a_node_start_with_a_bad_value_fails_before_the_command_runs():
    done = subprocess.run([sys.executable, "-m", "serve_app.runtime.cpus", "true"], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, GATEWAY_CPUS_ENV: "first"}, timeout=60)
    assert done.returncode != 0 and GATEWAY_CPUS_ENV in done.stderr and "Traceback" not in done.stderr


# A stand-in for vLLM's engine: a process titled as its engine core, which starts one titled as its
# worker (``WORKER_TITLE``); the worker binds its threads to ``WORKER_CPUS`` (as vLLM's CPU worker
# binds its OpenMP threads: all to one core here, one core each on a larger host), then both say
# so and wait for stdin to close.
FAKE_ENGINE = (
    "import os, subprocess, sys, threading\n"
    "open('/proc/self/comm', 'w').write('VLLM::EngineCore')\n"
    "threading.Thread(target=threading.Event().wait, daemon=True).start()  # a thread started before\n"
    "worker = subprocess.Popen([sys.executable, '-c', sys.argv[1]], stdin=subprocess.PIPE, stdout=subprocess.PIPE)\n"
    "worker.stdout.readline()\n"
    "print('ready', flush=True)\n"
    "sys.stdin.read(); worker.communicate(b'')\n"
)
FAKE_WORKER = (
    "import os, sys, threading\n"
    "open('/proc/self/comm', 'w').write(os.environ.get('WORKER_TITLE', 'VLLM::Worker'))\n"
    "cpus = [int(c) for c in os.environ['WORKER_CPUS'].split(',')]\n"
    "threading.Thread(target=threading.Event().wait, daemon=True).start()\n"
    "if os.environ.get('ONE_CPU_PER_THREAD'):\n"
    "    for cpu, tid in zip(cpus, sorted(os.listdir('/proc/self/task'), key=int)):\n"
    "        os.sched_setaffinity(int(tid), {cpu})\n"
    "else:\n"
    "    for tid in os.listdir('/proc/self/task'):\n"
    "        os.sched_setaffinity(int(tid), set(cpus))\n"
    "print('bound', flush=True); sys.stdin.read()\n"
)
# The fake engine below a process of its own (as below a model replica), so that only it is looked
# at, never an engine of another test's Ray below pytest.
UNDER_A_PARENT = "import subprocess, sys; subprocess.run(sys.argv[1:])"


@needs_two
def test_once_the_engine_is_up_its_engine_core_runs_beside_its_worker_and_the_starter_on_the_gateway():
    """In ``engine_start`` (a model replica's engine start, `make run`'s placement): the engine
    core is born with the whole host; once the engine is up, every thread of it is on the CPUs its
    worker's threads are bound to, and the starting process is back on the gateway's CPU."""
    first, last = HOST[0], HOST[-1]
    script = (
        "import json, logging, os, subprocess, sys\n"
        "from serve_app.runtime.cpus import engine_start\n"
        "logging.basicConfig(level=logging.INFO)\n"
        f"engine_argv = [sys.executable, '-c', {FAKE_ENGINE!r}, {FAKE_WORKER!r}]\n"
        "with engine_start('test'):\n"
        "    engine = subprocess.Popen(engine_argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)\n"
        "    born = sorted(os.sched_getaffinity(engine.pid))\n"
        "    engine.stdout.readline()  # the engine is up\n"
        "def masks(pid):\n"
        "    return sorted({tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir(f'/proc/{pid}/task')})\n"
        "print(json.dumps([born, masks(engine.pid), masks(os.getpid())]), flush=True)\n"
        "engine.communicate('')\n"
    )
    env = {**os.environ, GATEWAY_CPUS_ENV: str(last), "WORKER_CPUS": str(first)}
    done = subprocess.run([sys.executable, "-m", "serve_app.runtime.cpus", sys.executable, "-c", script],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=True)
    born, engine_core, starter = json.loads(done.stdout)
    assert born == HOST  # vLLM binds its worker as it would without us
    assert engine_core == [[first]]  # every thread, the one started before included
    assert starter == [[last]]
    assert "test: engine core" in done.stderr and f"on CPUs [{first}], beside its worker" in done.stderr


def thread_cpus(pid: int) -> set[frozenset[int]]:
    """The distinct masks of ``pid``'s threads."""
    return {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}


class FakeEngine:
    """The stand-in engine, under a parent of its own, once its worker has bound its threads."""

    def __init__(self, worker_cpus: list[int], **env: str):
        env = {**os.environ, "WORKER_CPUS": ",".join(map(str, worker_cpus)), **env}
        self.parent = subprocess.Popen([sys.executable, "-c", UNDER_A_PARENT, sys.executable, "-c", FAKE_ENGINE,
                                        FAKE_WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.parent.stdout.readline()
        self.core = next(pid for pid, (parent, _) in _process_tree().items() if parent == self.parent.pid)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.parent.communicate("", timeout=30)


@needs_two
def test_an_engine_core_whose_worker_may_run_anywhere_stays_where_it_is():
    with FakeEngine(HOST) as engine:
        assert engine_core_beside_worker({HOST[-1]}, engine.parent.pid) == {engine.core: None}
        assert thread_cpus(engine.core) == {frozenset(HOST)}


@needs_two
def test_a_worker_named_as_one_of_several_is_found():
    with FakeEngine([HOST[0]], WORKER_TITLE="VLLM::Worker_TP0") as engine:
        assert engine_core_beside_worker({HOST[-1]}, engine.parent.pid) == {engine.core: {HOST[0]}}
        assert thread_cpus(engine.core) == {frozenset({HOST[0]})}


@needs_two
def test_an_engine_core_with_a_cpu_of_its_own_besides_the_gateways_stays_where_it_is():
    """Only the measured layout moves: the engine core's CPUs are its worker's and gateway CPUs.
    Here its other CPU is not a gateway CPU (the gateway's are elsewhere: on a larger host, a CPU
    vLLM left to the engine core alone)."""
    with FakeEngine([HOST[0]]) as engine:
        assert engine_core_beside_worker(set(), engine.parent.pid) == {engine.core: None}
        assert thread_cpus(engine.core) == {frozenset(HOST)}


@pytest.mark.skipif(len(HOST) < 3, reason="a worker on a strict subset of two CPUs needs three")
def test_the_engine_core_joins_all_of_its_workers_cpus_not_its_main_threads_alone():
    """On a larger host vLLM binds each OpenMP thread to a core of its own: the engine core gets
    them all (the worker's main thread alone is on one)."""
    with FakeEngine(HOST[:2], ONE_CPU_PER_THREAD="1") as engine:
        assert engine_core_beside_worker(set(HOST[2:]), engine.parent.pid) == {engine.core: set(HOST[:2])}
        assert thread_cpus(engine.core) == {frozenset(HOST[:2])}


@needs_two
def test_the_benchmark_places_bare_vllms_engine_core_as_a_replica_does_and_only_where_make_run_pins(monkeypatch):
    from serve_app.bench import vllm

    with FakeEngine([HOST[0]]) as engine:
        monkeypatch.setenv(GATEWAY_CPUS_ENV, "")  # `make run` pinning nothing: nor does the benchmark
        vllm.place_like_ours(engine.parent.pid)
        assert thread_cpus(engine.core) == {frozenset(HOST)}
        monkeypatch.setenv(GATEWAY_CPUS_ENV, str(HOST[-1]))
        vllm.place_like_ours(engine.parent.pid)
        assert thread_cpus(engine.core) == {frozenset({HOST[0]})}

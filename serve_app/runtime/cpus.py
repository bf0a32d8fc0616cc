"""On a CPU host: every process of the Ray node but the engine, off the cores the engine computes on.

vLLM's CPU worker binds its OpenMP threads, one per core, to the cores it may use but the ones it
reserves for its scheduler (one on x86 with one worker, the last: ``core ids=[0]``,
``reserved_cpus=[1]`` on a 2-core host). Nothing keeps other processes off the worker's cores, and
a decode step waits every time one of them runs there. Bare vLLM has two other processes (its API
server and engine core); a Ray node has some thirty, most of them at nice 0 where the worker runs
at a Ray worker's nice 15, and each wakes every few milliseconds even idle (Ray's core worker,
gRPC pollers: docs/benchmarks.md, "The idle floor").

``SERVE_APP_GATEWAY_CPUS`` (a CPU list: ``1``, ``2-3``, ``0,4``) names the cores for all of them:

- the node starts on them (``python -m serve_app.runtime.cpus <command>`` pins itself, then execs
  the command: `make run` starts ``serve run`` so), and every process Ray starts inherits them;
- a model replica gives its engine the CPUs the node's starter had (``SERVE_APP_HOST_CPUS``) while
  it starts it (``engine_start``): the engine's processes keep the mask they were born with, so
  vLLM binds its worker as it would without us; then the replica goes back to the gateway's cores;
- once the engine is up, its engine core joins its worker's CPUs (``engine_core_beside_worker``).
  The engine core waits for each step by spinning with ``sched_yield``: beside the worker it hands
  the worker the CPU and costs next to nothing, where on the gateway's CPU it spins against the
  router and the replica, and where the kernel leaves it free it drifts between the two (measured
  on the 2-core host, docs/benchmarks.md, "The engine core beside its worker": its CPU per 1,000
  tokens 0.35 → 0.06 CPU-s, 16 and 32 streams' tok/s +18 % and +34 %, one stream's −4 %, and
  as steady from one batch to the next as bare vLLM's, whose engine core ``serve-app bench``
  places the same way);
- the router replica and HAProxy (its launcher, before the exec) pin themselves on start too
  (``keep_off_engine_cores``), which holds where the node was started otherwise (``ray start``).

On one host (`make run`, the integration tests) its value is ``local_default()``: the last CPU,
the one vLLM reserves on a single-socket x86 host with two physical cores or more (none on one
core: vLLM would bind its worker there). Empty: nothing is pinned. Unset (every GPU
region, whose worker computes on the GPU): nothing is pinned. Measured: docs/benchmarks.md,
"Where the gateway runs".
"""

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

GATEWAY_CPUS_ENV = "SERVE_APP_GATEWAY_CPUS"
# The CPUs the node's starter had before it pinned itself (``exec_pinned``): what an engine is
# given back, never more than the operator allowed (``taskset -c 0-3 make run``).
HOST_CPUS_ENV = "SERVE_APP_HOST_CPUS"
SYS_CPU = "/sys/devices/system/cpu"

# serve_app.telemetry.logs.module_logger's name (a replica's log), without importing telemetry:
# `make run` and HAProxy's launcher import this module.
logger = logging.getLogger(f"ray.serve.{__name__}")


def local_default(sys_cpu: str = SYS_CPU) -> str:
    """The gateway's CPU on one host: the last one this process may use, which vLLM reserves when
    it binds one logical CPU per physical core and has two cores or more to choose from. Empty
    where it would bind the worker there itself (one physical core, e.g. a 2-vCPU VM made of one
    core's two hyperthreads) and where the OS has no CPU affinity (macOS)."""
    if not hasattr(os, "sched_getaffinity"):
        return ""
    allowed = os.sched_getaffinity(0)
    return str(max(allowed)) if physical_cores(allowed, sys_cpu) > 1 else ""


def local_setting() -> str:
    """The value one host runs with (`make run`, the integration tests): ``SERVE_APP_GATEWAY_CPUS``
    as the caller set it (empty: nothing pinned), else ``local_default()``."""
    setting = os.environ.get(GATEWAY_CPUS_ENV)
    return local_default() if setting is None else setting


def physical_cores(cpus: set[int], sys_cpu: str = SYS_CPU) -> int:
    """How many physical cores ``cpus`` span (sysfs topology); one per CPU where sysfs says nothing."""
    cores = set()
    for cpu in cpus:
        try:
            topology = [open(f"{sys_cpu}/cpu{cpu}/topology/{name}").read().strip()
                        for name in ("physical_package_id", "core_id")]
        except OSError:
            topology = ["cpu", str(cpu)]
        cores.add(tuple(topology))
    return len(cores)


def parse_cpu_list(text: str) -> set[int]:
    """``"1"``, ``"0,2-3"`` → the CPU numbers (the kernel's cpulist format); ValueError otherwise."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{GATEWAY_CPUS_ENV}={text!r} is not a CPU list (e.g. 1, 2-3, 0,4)")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ValueError(f"{GATEWAY_CPUS_ENV}={text!r}: the range {part} is empty")
        cpus.update(range(low, high + 1))
    return cpus


def gateway_cpus(env: dict[str, str] | None = None) -> set[int] | None:
    """The CPUs named by ``SERVE_APP_GATEWAY_CPUS`` that this host has; None when it is unset or
    empty. Raises ValueError on a value that is not a CPU list or names none of this host's CPUs."""
    text = (os.environ if env is None else env).get(GATEWAY_CPUS_ENV, "").strip()
    if not text:
        return None
    host = host_cpus()
    cpus = parse_cpu_list(text) & host
    if not cpus:
        raise ValueError(f"{GATEWAY_CPUS_ENV}={text!r} names none of the CPUs this node may use ({sorted(host)})")
    return cpus


def host_cpus() -> set[int]:
    """The CPUs the node may use: its starter's before it pinned itself, else this process's."""
    saved = os.environ.get(HOST_CPUS_ENV, "").strip()
    return parse_cpu_list(saved) if saved else os.sched_getaffinity(0)


def pin_threads(cpus: set[int], pid: int | None = None) -> int:
    """Every thread of process ``pid`` (this one by default) on ``cpus``; the threads pinned. A
    thread started later inherits the mask of the thread that starts it, so all of them keep it."""
    done: set[int] = set()
    while True:  # again while new threads appear: one started by a thread not yet pinned has its mask
        new = {int(tid) for tid in os.listdir(f"/proc/{pid or os.getpid()}/task")} - done
        if not new:
            return len(done)
        for tid in new:
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:  # the thread ended meanwhile
                pass
        done |= new


def keep_off_engine_cores(process: str) -> set[int] | None:
    """Pin this process to the gateway's CPUs when ``SERVE_APP_GATEWAY_CPUS`` names them; a bad
    value is logged and changes nothing (a serving process does not fail over its placement)."""
    try:
        cpus = gateway_cpus()
        if cpus is None:
            return None
        threads = pin_threads(cpus)
    except (ValueError, OSError, AttributeError) as err:  # AttributeError: no affinity on this OS
        logger.warning("%s left where the kernel puts it: %s", process, err)
        return None
    logger.info("%s: %d threads on CPUs %s (%s)", process, threads, sorted(cpus), GATEWAY_CPUS_ENV)
    return cpus


@contextlib.contextmanager
def engine_start(process: str) -> Iterator[None]:
    """Around an engine's start: the whole host while the engine's processes are born (they keep
    that mask), then, the engine up, its engine core beside its worker and this process back on
    the gateway's CPUs. Nothing when the variable is unset."""
    try:
        pinned = gateway_cpus() is not None
        if pinned:
            pin_threads(host_cpus())
    except (ValueError, OSError, AttributeError):
        pinned = False  # keep_off_engine_cores logs it once the engine is up
    try:
        yield
        if pinned:
            place_engine_cores(process)
    finally:
        keep_off_engine_cores(process)


# vLLM's process titles as /proc/<pid>/comm holds them (cut to 15 characters), matched as prefixes:
# with several workers vLLM names them ``VLLM::Worker_TP0``…, several engine cores ``…EngineCore_DP0``.
ENGINE_CORE_NAME, WORKER_NAME = "VLLM::EngineCor", "VLLM::Worker"


def _process_tree() -> dict[int, tuple[int, str]]:
    """Every process of the host: pid -> (its parent's pid, its name), from /proc/<pid>/stat."""
    tree = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:  # ended meanwhile
                continue
            name_ends = stat.rindex(")")  # the name may hold spaces and parentheses
            tree[int(entry)] = (int(stat[name_ends + 2:].split()[1]), stat[stat.index("(") + 1:name_ends])
    return tree


def _descendants(tree: dict[int, tuple[int, str]], pid: int, prefix: str) -> list[int]:
    """The processes below ``pid`` whose name starts with ``prefix``, nearest first."""
    found, level = [], [pid]
    while level:
        level = [child for child, (parent, _) in tree.items() if parent in level]
        found += [child for child in level if tree[child][1].startswith(prefix)]
    return found


def _thread_cpus(pid: int) -> set[int]:
    """The CPUs any thread of ``pid`` may run on (vLLM binds each OpenMP thread to one core)."""
    cpus: set[int] = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            cpus |= os.sched_getaffinity(int(tid))
    return cpus


def engine_core_beside_worker(gateway: set[int], parent: int | None = None) -> dict[int, set[int] | None]:
    """Every vLLM engine core started below ``parent`` (this process by default) onto the CPUs its
    workers are bound to: each engine core found, and the CPUs it went to (None: left where it is).

    Only in the layout that was measured: the engine core's CPUs are its workers' and, besides
    them, gateway CPUs alone (vLLM's reserved one). Where vLLM left a CPU to nobody else (a larger
    host, ``SERVE_APP_GATEWAY_CPUS`` set to other CPUs), or bound its worker nowhere in particular,
    the engine core stays where it is: beside a worker of several OpenMP threads it would hold up
    the one it shares a core with, and every step waits for the slowest."""
    tree, placed = _process_tree(), {}
    for core in _descendants(tree, parent or os.getpid(), ENGINE_CORE_NAME):
        workers: set[int] = set()
        for worker in _descendants(tree, core, WORKER_NAME):
            workers |= _thread_cpus(worker)
        allowed = os.sched_getaffinity(core)
        if workers and workers < allowed and allowed - workers <= gateway:
            pin_threads(workers, core)
            placed[core] = workers
        else:
            placed[core] = None
    return placed


def place_engine_cores(process: str, parent: int | None = None,
                       env: dict[str, str] | None = None) -> dict[int, set[int] | None]:
    """``engine_core_beside_worker`` where the gateway's CPUs are named (``env``: where to read
    ``SERVE_APP_GATEWAY_CPUS``, this process's environment by default), each engine core's
    placement said in the log; one it cannot place (it ended, the OS has no affinity) is logged
    and left where it is."""
    gateway = None
    try:
        gateway = gateway_cpus(env)
        placed = engine_core_beside_worker(gateway, parent) if gateway is not None else {}
    except (OSError, ValueError, AttributeError) as err:
        logger.warning("%s: its engine core left where the kernel puts it: %s", process, err)
        return {}
    if not placed and gateway is not None:
        logger.warning("%s: no vLLM engine core found below it to place beside its worker", process)
    for core, workers in placed.items():
        if workers is None:
            logger.info("%s: engine core %d left where it is (its CPUs are not its worker's and the "
                        "gateway's alone, or its worker is bound to none in particular)", process, core)
        else:
            logger.info("%s: engine core %d on CPUs %s, beside its worker", process, core, sorted(workers))
    return placed


def exec_pinned(argv: list[str]) -> None:
    """``python -m serve_app.runtime.cpus <command> [args]``: this process on the gateway's CPUs
    (when the variable names them), then the command in its place, which every process it starts
    inherits."""
    cpus = gateway_cpus()
    if cpus is not None:
        os.environ[HOST_CPUS_ENV] = ",".join(map(str, sorted(os.sched_getaffinity(0))))
        os.sched_setaffinity(0, cpus)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        try:
            exec_pinned(sys.argv[1:])
        except (ValueError, OSError, AttributeError) as err:  # CPUs outside a container's cpuset; macOS
            raise SystemExit(f"serve_app.runtime.cpus: {err}") from None
    else:  # `make run`: the value it runs with
        print(local_setting())

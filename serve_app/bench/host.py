"""The real host's ``ProcessTable`` (Linux): psutil for processes, sockets and CPU times,
``/proc/<pid>/task`` for the CPU lists each thread is pinned to."""

import os
from collections.abc import Sequence

from serve_app.bench.procs import MAIN_THREAD, Proc

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class PsutilTable:
    """``serve_app.bench.procs.ProcessTable`` over this host."""

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self._handles: dict[int, object] = {}

    def processes(self) -> list[Proc]:
        rows = []
        for p in self._psutil.process_iter(["pid", "ppid", "cmdline", "name", "create_time"]):
            info = p.info
            cmdline = tuple(info.get("cmdline") or ()) or ((info.get("name") or "?"),)
            rows.append(Proc(info["pid"], info.get("ppid") or 0, cmdline, info.get("create_time") or 0.0))
        return rows

    def listeners(self, port: int) -> set[int]:
        psutil = self._psutil

        def listening(connection) -> bool:
            return connection.status == psutil.CONN_LISTEN and connection.laddr.port == port

        try:
            return {c.pid for c in psutil.net_connections(kind="tcp") if c.pid and listening(c)}
        except psutil.AccessDenied:  # some systems: only per process, for the processes we may read
            pids = set()
            for p in psutil.process_iter():
                try:
                    if any(listening(c) for c in p.net_connections(kind="tcp")):
                        pids.add(p.pid)
                except (psutil.AccessDenied, psutil.NoSuchProcess):
                    continue
            return pids

    def _process(self, pid: int, create_time: float):
        """psutil's handle for that very process; None if the pid now belongs to another one
        (psutil's ``cpu_times`` would read whichever process has the pid)."""
        handle = self._handles.get(pid)
        if handle is None or handle.create_time() != create_time:
            handle = self._handles[pid] = self._psutil.Process(pid)
        return handle if not create_time or abs(handle.create_time() - create_time) < 0.01 else None

    def cpu_seconds(self, pid: int, create_time: float) -> float | None:
        try:
            handle = self._process(pid, create_time)
            if handle is None:
                return None
            times = handle.cpu_times()
            return times.user + times.system
        except (self._psutil.NoSuchProcess, self._psutil.AccessDenied, self._psutil.ZombieProcess):
            self._handles.pop(pid, None)
            return None

    def signal(self, pid: int, create_time: float, signum: int) -> bool:
        try:
            handle = self._process(pid, create_time)
            if handle is None:
                return False
            handle.send_signal(signum)
            return True
        except (self._psutil.NoSuchProcess, self._psutil.AccessDenied, self._psutil.ZombieProcess):
            self._handles.pop(pid, None)
            return False

    def host_busy_s(self) -> float | None:
        times = self._psutil.cpu_times()
        idle = times.idle + getattr(times, "iowait", 0.0)
        # guest time is already inside user on Linux; counting it twice would invent load
        return sum(times) - idle - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)

    def thread_cpu(self, pid: int, create_time: float) -> dict[int, tuple[str, float]] | None:
        return self._per_thread(pid, create_time, "stat", parse_thread_stat)

    def thread_wakeups(self, pid: int, create_time: float) -> dict[int, tuple[str, int]] | None:
        return self._per_thread(pid, create_time, "status", parse_thread_switches)

    def _per_thread(self, pid: int, create_time: float, file: str, parse) -> dict | None:
        """``parse`` of every thread's ``/proc/<pid>/task/<tid>/<file>`` → (name, value), by thread
        id; None once the process is gone (or its pid is someone else's)."""
        try:
            if self._process(pid, create_time) is None:
                return None
            tasks = os.listdir(f"/proc/{pid}/task")
        except (self._psutil.NoSuchProcess, self._psutil.AccessDenied, self._psutil.ZombieProcess, OSError):
            return None
        threads: dict = {}
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/{file}") as text:
                    name, value = parse(text.read())
            except (OSError, ValueError, IndexError):  # the thread ended between the listing and the read
                continue
            threads[int(tid)] = (MAIN_THREAD if tid == str(pid) else name, value)
        return threads

    def engine_env(self, pid: int, names: Sequence[str]) -> dict:
        psutil = self._psutil
        out: dict = {}
        try:
            p = psutil.Process(pid)
            out["nice"] = p.nice()
            out["affinity"] = sorted(p.cpu_affinity())
            out["threads"] = p.num_threads()
        except (psutil.NoSuchProcess, psutil.AccessDenied, AttributeError) as err:
            out["error"] = type(err).__name__
            return out
        try:
            environ = _environ(pid)
        except OSError:
            out["env"] = None
        else:
            own = {name: environ.get(name) for name in names}
            ancestors = _ancestor_environs(p) if _retitled(pid) else []
            out["env"], inherited = fill_from_ancestors(own, ancestors)
            if inherited:
                out["env_inherited"] = inherited
        out["thread_affinities"] = affinities = _thread_affinities(pid)
        if affinities:  # the threads this listing read: num_threads() above was a moment earlier
            out["threads"] = sum(affinities.values())
        return out


def fill_from_ancestors(own: dict[str, str | None], ancestors: Sequence[tuple[int, dict[str, str]]]
                        ) -> tuple[dict[str, str | None], dict[str, int]]:
    """A retitled process's missing variables, from the nearest ancestor that has them (its title
    overwrote the start of its environ block, which the kernel still reports; vLLM's worker loses
    OMP_NUM_THREADS that way under bare vLLM). The values and ``{name: the pid it was read from}``."""
    env, inherited = dict(own), {}
    for name, value in own.items():
        if value is None:
            found = next(((pid, environ[name]) for pid, environ in ancestors if name in environ), None)
            if found is not None:
                inherited[name], env[name] = found
    return env, inherited


def _retitled(pid: int) -> bool:
    """setproctitle pads the title it writes over argv with NULs: a run of them ends the cmdline."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().endswith(b"\0\0")
    except OSError:
        return False


def _ancestor_environs(process, levels: int = 3) -> list[tuple[int, dict[str, str]]]:
    found = []
    for parent in process.parents()[:levels]:
        try:
            found.append((parent.pid, _environ(parent.pid)))
        except OSError:
            continue
    return found


def _environ(pid: int) -> dict[str, str]:
    """A process's environment as its ``/proc/<pid>/environ`` holds it, every ``NAME=value`` entry.
    psutil stops at the first empty entry, and a process whose title was set (vLLM's engine core:
    setproctitle) can start its block with empty entries: psutil then reads nothing at all."""
    with open(f"/proc/{pid}/environ", "rb") as block:
        return parse_environ(block.read())


def parse_thread_stat(line: str) -> tuple[str, float]:
    """``/proc/<pid>/task/<tid>/stat`` → (the thread's name, utime + stime in seconds). The name is
    between the first ``(`` and the last ``)``: it may hold spaces and parentheses itself."""
    name = line[line.index("(") + 1:line.rindex(")")]
    fields = line[line.rindex(")") + 2:].split()
    return name, (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def parse_thread_switches(status: str) -> tuple[str, int]:
    """``/proc/<pid>/task/<tid>/status`` → (the thread's name, how many times it was switched out:
    voluntary + not). An idle thread is switched out once per wake-up, so over a window the count
    is its wake-ups, which unlike its CPU do not depend on the host's speed."""
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    switches = int(fields["voluntary_ctxt_switches"]) + int(fields["nonvoluntary_ctxt_switches"])
    return fields["Name"].strip("\t\n"), switches


def parse_environ(block: bytes) -> dict[str, str]:
    return dict(entry.decode(errors="replace").split("=", 1) for entry in block.split(b"\0") if b"=" in entry)


def _thread_affinities(pid: int) -> dict[str, int] | None:
    """How many threads run on each CPU list: vLLM's CPU backend pins its OpenMP threads one by
    one (``VLLM_CPU_OMP_THREADS_BIND``), so the process's own affinity does not show it."""
    counts: dict[str, int] = {}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as status:
                line = next((ln for ln in status if ln.startswith("Cpus_allowed_list:")), "")
        except OSError:
            continue
        if line:
            cpus = line.split(":", 1)[1].strip()
            counts[cpus] = counts.get(cpus, 0) + 1
    return counts

"""Which processes on this host belong to each side of the benchmark, and what each one is.

The measuring code never imports Ray: it reads the host's process table (``ProcessTable``: psutil
in ``PsutilTable``, a dict in the unit tests) and recognises Ray's processes by what Ray itself
puts on their command lines (``ray/_private/services.py`` for 2.60):

- a cluster's **session**: ``gcs_server``, ``raylet``, the dashboard, the log monitor and the
  autoscaler monitor name it in a flag (``--session-name=``, ``--session-dir=``, ``--logs-dir=``
  …); every other process of the cluster (the dashboard's and runtime env's agents, every
  ``ray::`` worker, the Serve actors, HAProxy, vLLM's engine core) is a descendant of one of them
  (the raylet starts the agents and workers; setproctitle has replaced their command lines, so
  the tree is what ties them to the session);
- a process that names one of the session's **node ids** exactly (``--node-id=<id>``: Ray's
  client server) and **HAProxy** by the node id in its config path (``-f
  /tmp/haproxy-serve/<node id>/haproxy.cfg``; serve_app/haproxy/state_dirs.py), so a HAProxy
  that outlived its manager and was reparented still counts;
- the **driver** (``serve run``'s Python process, which ``ray.init`` makes the parent of
  ``gcs_server``) and its children (the autoscaler monitor, the reaper) when there is one.

Which session is ours is decided by the target's port: the cluster whose processes include the
one listening on it (HAProxy, or Serve's proxy actor). Bare vLLM is the process listening on the
baseline's port and all its children. Nothing is matched by a name pattern alone.
"""

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from serve_app.haproxy.state_dirs import NODE_ID

OURS, BASELINE, CLIENT = "ours", "baseline", "client"
# A process's first thread: in a Ray worker, the one Ray's core worker wakes every 10 ms to check
# for signals (``CoreWorker::RunTaskExecutionLoop``), whatever the actor does.
MAIN_THREAD = "main"
SESSION = re.compile(r"session_\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}_\d+_\d+")
# Flags whose value names the session (its name, or a directory inside /tmp/ray/<session>/).
SESSION_FLAGS = ("--session-name=", "--session_name=", "--session-dir=", "--session_dir=", "--logs-dir=",
                 "--log-dir=", "--log_dir=")
NODE_FLAGS = ("--node_id=", "--node-id=")
_METHOD = re.compile(r"\.[A-Za-z_]\w*(\(\))?$")
# Ray's own programs: a session flag on anything else (``tail -f .../session_x/...``) is not Ray.
RAY_PROGRAMS = ("gcs_server", "raylet", "dashboard.py", "agent.py", "log_monitor.py", "monitor.py", "main.py")

# Report order; every process falls in exactly one group (``group_of``).
GROUPS = ("HAProxy", "router replica", "model replica actor", "EngineCore", "engine worker", "API server",
          "controller", "Serve proxy", "HAProxy manager", "rate-limit actor", "GCS", "raylet", "dashboard",
          "dashboard agent", "runtime env agent", "driver", "other Ray", "other")


@dataclass(frozen=True)
class Proc:
    """One row of the process table; ``create_time`` tells a recycled pid from the process it had."""

    pid: int
    ppid: int
    cmdline: tuple[str, ...]
    create_time: float = 0.0


@dataclass(frozen=True)
class Tracked:
    """A process the benchmark counts: its side, its group (``GROUPS``) and a readable label."""

    pid: int
    create_time: float
    side: str
    group: str
    label: str


class ProcessTable(Protocol):
    def processes(self) -> list[Proc]: ...

    def listeners(self, port: int) -> set[int]:
        """Pids with a TCP socket listening on ``port``."""
        ...

    def cpu_seconds(self, pid: int, create_time: float) -> float | None:
        """utime + stime of that process, None once it is gone (or its pid is someone else's)."""
        ...

    def host_busy_s(self) -> float | None:
        """The whole host's busy CPU-seconds since boot (every core, every process)."""
        ...

    def signal(self, pid: int, create_time: float, signum: int) -> bool:
        """Send ``signum`` to that very process; False when it is gone (or its pid is someone else's)."""
        ...

    def thread_cpu(self, pid: int, create_time: float) -> dict[int, tuple[str, float]] | None:
        """utime + stime of each thread of that process, by thread id: (its name, ``MAIN_THREAD``
        for the thread whose id is the pid; seconds); None once it is gone (or its pid is someone
        else's)."""
        ...

    def thread_wakeups(self, pid: int, create_time: float) -> dict[int, tuple[str, int]] | None:
        """Context switches of each thread of that process (voluntary + not), by thread id as
        ``thread_cpu``; None once it is gone."""
        ...

    def engine_env(self, pid: int, names: Sequence[str]) -> dict:
        """Niceness, CPU affinity, thread count and per-thread affinities, and the ``names``
        variables of its environment (``serve_app.bench.engine_env``)."""
        ...


@dataclass
class Session:
    """One local Ray cluster: its processes (pid → Proc) and its raylets' node ids."""

    name: str
    procs: dict[int, Proc] = field(default_factory=dict)
    node_ids: set[str] = field(default_factory=set)
    driver: int | None = None


class DiscoveryError(RuntimeError):
    """The side's processes cannot be found (said in a sentence an operator can act on)."""


def _basename(arg: str) -> str:
    return os.path.basename(arg.split(" ", 1)[0])


def _is_ray_program(proc: Proc) -> bool:
    return any(_basename(arg) in RAY_PROGRAMS and "/ray/" in arg for arg in proc.cmdline[:3])


def session_of(proc: Proc) -> str | None:
    """The session a Ray program's command line names, else None."""
    if not _is_ray_program(proc):
        return None
    for arg in proc.cmdline:
        if arg.startswith(SESSION_FLAGS) and (found := SESSION.search(arg)):
            return found.group(0)
    return None


def node_id_of(proc: Proc) -> str | None:
    for arg in proc.cmdline:
        if arg.startswith(NODE_FLAGS) and NODE_ID.fullmatch(value := arg.split("=", 1)[1]):
            return value
    return None


def _is_python_driver(proc: Proc) -> bool:
    return bool(proc.cmdline) and (_basename(proc.cmdline[0]).startswith("python")
                                   or _basename(proc.cmdline[0]) in ("serve", "ray"))


def _is_haproxy(proc: Proc) -> bool:
    return bool(proc.cmdline) and "haproxy" in _basename(proc.cmdline[0])


def children_map(procs: Iterable[Proc]) -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for proc in procs:
        children.setdefault(proc.ppid, []).append(proc.pid)
    return children


def descendants(roots: Iterable[int], children: Mapping[int, list[int]]) -> set[int]:
    """``roots`` and everything below them."""
    seen, stack = set(), list(roots)
    while stack:
        pid = stack.pop()
        if pid not in seen:
            seen.add(pid)
            stack.extend(children.get(pid, ()))
    return seen


def ancestors(pid: int, by_pid: Mapping[int, Proc]) -> set[int]:
    seen = set()
    while pid in by_pid and pid not in seen:
        seen.add(pid)
        pid = by_pid[pid].ppid
    return seen


def ray_sessions(procs: Sequence[Proc], exclude: set[int] = frozenset()) -> dict[str, Session]:
    """Every Ray cluster on the host, by session name (``exclude``: the benchmark and its ancestors)."""
    by_pid = {p.pid: p for p in procs}
    children = children_map(procs)
    sessions: dict[str, Session] = {}
    for proc in procs:
        if (name := session_of(proc)) is not None and proc.pid not in exclude:
            session = sessions.setdefault(name, Session(name))
            session.procs[proc.pid] = proc
            if (node := node_id_of(proc)) is not None:
                session.node_ids.add(node)
    for session in sessions.values():
        roots = set(session.procs)
        for proc in procs:
            # A process that names one of the session's nodes exactly (Ray's client server,
            # --node-id=<id>), or a HAProxy whose config is that node's (reparented when its
            # manager died): node ids are random 28-byte values, nothing else names them.
            node_flag = node_id_of(proc) in session.node_ids
            if node_flag or (_is_haproxy(proc) and any(n in arg for n in session.node_ids for arg in proc.cmdline)):
                roots.add(proc.pid)
        gcs = [by_pid[pid] for pid in roots if by_pid[pid].cmdline and _basename(by_pid[pid].cmdline[0]) == "gcs_server"]
        parent = by_pid.get(gcs[0].ppid) if gcs else None
        # ray.init() makes the driver (serve run) gcs_server's parent, and of the autoscaler
        # monitor and the reaper beside it; `ray start` leaves them to init (or a subreaper such
        # as systemd --user, which is not the service's: only a Python driver counts).
        if parent and parent.pid > 1 and parent.pid not in exclude and _is_python_driver(parent):
            session.driver = parent.pid
            roots.add(parent.pid)
        session.procs = {pid: by_pid[pid] for pid in descendants(roots, children) - exclude}
    return sessions


def _label(argv: Sequence[str]) -> str:
    """What a reader recognises: a process title as set (``ray::ServeController``), else the
    program and, for an interpreter, its script (``python3.11 dashboard.py``)."""
    title = argv[0]
    if title.startswith(("ray::", "VLLM::", "ray-dashboard-")):
        return title.split(" (", 1)[0]  # dashboard modules append their parent's title in brackets
    program = _basename(title)
    if program.startswith("python"):
        for i, arg in enumerate(argv[1:], 1):
            if arg == "-c":
                return f"{program} -c"
            if arg == "-m":
                return f"{program} -m {argv[i + 1] if i + 1 < len(argv) else ''}".rstrip()
            if not arg.startswith("-"):
                return f"{program} {_basename(arg)}"
    return program


_FIXED_GROUPS = {"gcs_server": "GCS", "raylet": "raylet", "ray::ServeController": "controller",
                 "ray::ProxyActor": "Serve proxy", "ray::HAProxyManager": "HAProxy manager",
                 "ray::RateLimiter": "rate-limit actor", "ray::DashboardAgent": "dashboard agent",
                 "ray::RuntimeEnvAgent": "runtime env agent"}


def group_of(proc: Proc, driver: int | None = None) -> tuple[str, str]:
    """(group, label) for one process of a side (``GROUPS``)."""
    argv = proc.cmdline or ("?",)
    label = _label(argv)
    title = argv[0]
    # Ray titles an actor ray::Class, and ray::Class.method() while one of its tasks runs (a
    # method is an identifier: the dots of a model id, model-qwen-3.6-35b-a3b, stay).
    actor = _METHOD.sub("", title.split(" ", 1)[0])
    if proc.pid == driver:
        return "driver", label
    if title.startswith("VLLM::EngineCore"):
        return "EngineCore", label
    if title.startswith("VLLM::Worker"):
        return "engine worker", label
    if _is_haproxy(proc):
        return "HAProxy", "haproxy"
    if (group := _FIXED_GROUPS.get(_basename(title)) or _FIXED_GROUPS.get(actor)) is not None:
        return group, actor if actor.startswith("ray::") else label
    if actor.startswith("ray::ServeReplica:"):  # ServeReplica:<app>:<deployment>
        deployment = actor.rsplit(":", 1)[1]
        if deployment == "Router":
            return "router replica", actor
        return ("model replica actor" if deployment.startswith("model-") else "other Ray"), actor
    if title.startswith("ray-dashboard-") or label.endswith(" dashboard.py"):
        return "dashboard", label
    if title.startswith("ray::") or any((a.endswith(".py") and "/ray/" in a) or a.startswith("ray.") for a in argv[1:4]):
        return "other Ray", label  # a worker, or a Python program of Ray's (monitor, reaper, client server)
    return "other", label


def listening_session(sessions: Mapping[str, Session], listeners: set[int], port: int) -> Session:
    owners = [s for s in sessions.values() if listeners & set(s.procs)]
    if len(owners) == 1:
        return owners[0]
    if not sessions:
        raise DiscoveryError("no local Ray cluster on this host (no gcs_server/raylet with a session)")
    if not listeners and len(sessions) == 1:  # the listener is not ours to see: the only cluster it is
        return next(iter(sessions.values()))
    names = ", ".join(sorted(sessions))
    raise DiscoveryError(f"no Ray cluster on this host listens on port {port} (clusters: {names}; listeners: "
                         f"{sorted(listeners) or 'none visible'})")


def find_ours(table: ProcessTable, port: int, procs: Sequence[Proc], exclude: set[int]) -> list[Tracked]:
    """Every process of the Ray cluster serving ``port``."""
    session = listening_session(ray_sessions(procs, exclude), table.listeners(port), port)
    return [Tracked(p.pid, p.create_time, OURS, *group_of(p, session.driver)) for p in session.procs.values()]


def find_tree(table: ProcessTable, port: int, procs: Sequence[Proc], exclude: set[int], side: str) -> list[Tracked]:
    """The process listening on ``port`` (bare vLLM's API server) and all its children."""
    listeners = table.listeners(port) - exclude
    if not listeners:
        raise DiscoveryError(f"no process of this host visibly listens on port {port} (or it is the benchmark itself)")
    by_pid = {p.pid: p for p in procs}
    members = descendants(listeners, children_map(procs)) - exclude
    found = []
    for pid in sorted(members & set(by_pid)):
        group, label = group_of(by_pid[pid])
        found.append(Tracked(pid, by_pid[pid].create_time, side, "API server" if pid in listeners else group, label))
    return found


def find_client(procs: Sequence[Proc], pid: int) -> list[Tracked]:
    proc = next((p for p in procs if p.pid == pid), Proc(pid, 0, ("bench client",)))
    return [Tracked(pid, proc.create_time, CLIENT, "client", "serve-app bench")]


def discover(
    table: ProcessTable, *, ours_port: int | None, baseline_port: int | None = None, client_pid: int | None = None
) -> list[Tracked]:
    """Ours (the Ray cluster on ``ours_port``), the baseline (the tree on ``baseline_port``) and
    the client; a pid belongs to one side only. Raises DiscoveryError for a side not found."""
    client_pid = os.getpid() if client_pid is None else client_pid
    procs = table.processes()
    # The benchmark's own process and its ancestors are never a server's (it may be their child).
    exclude = ancestors(client_pid, {p.pid: p for p in procs}) | {client_pid}
    found = find_client(procs, client_pid)
    if ours_port is not None:
        found += find_ours(table, ours_port, procs, exclude)
    if baseline_port is not None:
        taken = {t.pid for t in found}
        found += find_tree(table, baseline_port, procs, exclude | taken, BASELINE)
    return found

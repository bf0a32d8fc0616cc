"""A host's process table for the benchmark's unit tests: two local Ray clusters (ours on port
8000, another on 8001), a bare vLLM on 8100 started by the benchmark, the benchmark itself.

Command lines are those Ray 2.60 and vLLM 0.32 give their processes (``ray/_private/services.py``,
setproctitle titles, ``VLLM::EngineCore``). CPU is a rate per pid on a fake clock, so a test says
how busy each process is and reads exact CPU-seconds back.
"""

from dataclasses import dataclass, field

from serve_app.bench.procs import MAIN_THREAD, Proc

S = "session_2026-12-01_23-15-00_123456_7890"
S2 = "session_2026-12-02_08-00-00_654321_1111"
N = "ab" * 28  # ours' node id
N2 = "cd" * 28
RAY = "/venv/lib/python3.11/site-packages/ray"
PY = "/venv/bin/python3.11"
CLIENT = 400
OTHER_TENANT = -1  # set_rate(OTHER_TENANT, cores): a job on the host outside every side


def _ray(session: str, node: str, base: int, driver: bool = True) -> list[Proc]:
    parent = base if driver else 1
    procs = [
        Proc(base + 1, parent, (f"{RAY}/core/src/ray/gcs/gcs_server", "--log_dir=/tmp/ray/x", "--gcs_server_port=6379",
                                f"--session-name={session}", f"--session-dir=/tmp/ray/{session}", f"--node-id={node}")),
        Proc(base + 2, parent, (f"{RAY}/core/src/ray/raylet/raylet", f"--raylet_socket_name=/tmp/ray/{session}/sockets/raylet",
                                f"--node_id={node}", f"--session_dir=/tmp/ray/{session}", f"--session-name={session}")),
        Proc(base + 3, parent, (PY, "-u", f"{RAY}/dashboard/dashboard.py", "--host=127.0.0.1", "--port=8265",
                                f"--session-dir=/tmp/ray/{session}")),
        Proc(base + 4, base + 3, (f"ray-dashboard-ServeHead-0 ({PY} -c from multiprocessing.spawn import spawn_main)",)),
        Proc(base + 5, parent, (PY, "-u", f"{RAY}/_private/log_monitor.py", f"--session-dir=/tmp/ray/{session}")),
        Proc(base + 10, base + 2, ("ray::DashboardAgent",)),
        Proc(base + 11, base + 2, ("ray::RuntimeEnvAgent",)),
        Proc(base + 20, base + 2, ("ray::ServeController",)),
        Proc(base + 21, base + 2, ("ray::HAProxyManager",)),
        Proc(base + 22, base + 21, (f"{RAY}/serve/_private/haproxy_bin/haproxy", "-db", "-f",
                                    f"/tmp/haproxy-serve/{node}/haproxy.cfg")),
        Proc(base + 23, base + 2, ("ray::ProxyActor",)),
        Proc(base + 24, base + 2, ("ray::ServeReplica:serve_app:Router.handle_request()",)),
        Proc(base + 25, base + 2, ("ray::ServeReplica:serve_app:model-qwen-3.6-35b-a3b",)),
        Proc(base + 26, base + 25, ("VLLM::EngineCore",)),
        Proc(base + 27, base + 2, ("ray::RateLimiter",)),
        Proc(base + 28, base + 2, ("ray::IDLE",)),
        Proc(base + 29, base + 25, (PY, "-c", "from multiprocessing.resource_tracker import main;main(7)")),
    ]
    if driver:
        procs += [
            Proc(base, 100, (PY, "/venv/bin/serve", "run", "configs/local.yaml")),
            # the driver's other children: the autoscaler monitor (its flags name only the logs
            # directory) and the reaper (no flag at all)
            Proc(base + 6, base, (PY, "-u", f"{RAY}/autoscaler/_private/monitor.py", f"--logs-dir=/tmp/ray/{session}/logs")),
            Proc(base + 7, base, (PY, "-u", f"{RAY}/_private/ray_process_reaper.py")),
        ]
    # Ray's client server, started beside the raylet, tied to the node by its flag only
    procs.append(Proc(base + 8, parent, (PY, "-m", "ray.util.client.server", "--port=10001", f"--node-id={node}")))
    return procs


def host_procs() -> list[Proc]:
    return [
        Proc(1, 0, ("/sbin/init",)),
        Proc(100, 1, ("bash",)),
        *_ray(S, N, 200),
        *_ray(S2, N2, 500, driver=False),
        # A HAProxy whose manager died, reparented to init: its config still names our node.
        Proc(230, 1, ("/usr/local/bin/serve-app-haproxy", "-db", "-f", f"/tmp/haproxy-serve/{N}/haproxy.cfg")),
        # Names our session but is no Ray program: not counted.
        Proc(240, 100, ("/usr/bin/python3", "mine.py", f"--session-dir=/tmp/ray/{S}")),
        Proc(CLIENT, 100, (PY, "/venv/bin/serve-app", "bench", "--baseline-vllm", "configs/local.yaml")),
        Proc(300, CLIENT, (PY, "-m", "vllm.entrypoints.openai.api_server", "--model", "m", "--port", "8100")),
        Proc(301, 300, ("VLLM::EngineCore",)),
        Proc(302, 300, (PY, "-c", "from multiprocessing.resource_tracker import main;main(5)")),
    ]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds

    def sleep_sync(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class FakeTable:
    """``ProcessTable`` over ``procs``: CPU-seconds = base + rate × clock time; pids in ``gone``
    have exited; ``OTHER_TENANT``'s CPU is in the host's busy time only."""

    clock: Clock
    procs: list[Proc] = field(default_factory=host_procs)
    listening: dict[int, set[int]] = field(default_factory=lambda: {8000: {222}, 8001: {522}, 8100: {300}})
    rates: dict[int, float] = field(default_factory=dict)  # cores per pid
    base: dict[int, float] = field(default_factory=dict)
    gone: set[int] = field(default_factory=set)
    envs: dict[int, dict] = field(default_factory=dict)
    thread_shares: dict[int, dict[str, float]] = field(default_factory=dict)  # pid → {thread name: share}
    wakeup_rates: dict[int, dict[str, float]] = field(default_factory=dict)  # pid → {thread name: per second}
    wakeup_counts: dict[int, dict[int, tuple[str, int]]] = field(default_factory=dict)  # pid → {tid: (name, count)}
    signals: list[tuple[int, int]] = field(default_factory=list)  # (pid, signal number) sent, in order
    last_read: dict[int, float] = field(default_factory=dict)  # pid → CPU-seconds when last seen (host_busy_s)

    def signal(self, pid: int, create_time: float, signum: int) -> bool:
        """Recorded, never sent: the pids are made up (or this test's own)."""
        if self.cpu_seconds(pid, create_time) is None:
            return False
        self.signals.append((pid, signum))
        return True

    def processes(self) -> list[Proc]:
        return [p for p in self.procs if p.pid not in self.gone]

    def listeners(self, port: int) -> set[int]:
        return set(self.listening.get(port, set())) - self.gone

    def cpu_seconds(self, pid: int, create_time: float) -> float | None:
        proc = next((p for p in self.procs if p.pid == pid), None)
        if proc is None or pid in self.gone or proc.create_time != create_time:
            return None
        return self.base.get(pid, 0.0) + self.rates.get(pid, 0.0) * self.clock.now

    def host_busy_s(self) -> float | None:
        """Every process's CPU, an exited one's as it was when last read (the host's total never
        goes down), and ``OTHER_TENANT``'s."""
        for p in self.processes():
            if (used := self.cpu_seconds(p.pid, p.create_time)) is not None:
                self.last_read[p.pid] = used
        every = sum(self.last_read.values())
        return every + self.base.get(OTHER_TENANT, 0.0) + self.rates.get(OTHER_TENANT, 0.0) * self.clock.now

    def thread_cpu(self, pid: int, create_time: float) -> dict[int, tuple[str, float]] | None:
        used = self.cpu_seconds(pid, create_time)
        if used is None:
            return None
        shares = self.thread_shares.get(pid, {MAIN_THREAD: 1.0})
        return {pid * 1000 + i: (name, share * used) for i, (name, share) in enumerate(shares.items())}

    def thread_wakeups(self, pid: int, create_time: float) -> dict[int, tuple[str, int]] | None:
        """One thread per name of ``wakeup_rates`` (rate × clock time), plus ``wakeup_counts``'s
        threads as they stand (a test adds and removes them: threads born and ended)."""
        if self.cpu_seconds(pid, create_time) is None:
            return None
        rates = self.wakeup_rates.get(pid, {})
        threads = {pid * 1000 + i: (name, round(rate * self.clock.now)) for i, (name, rate) in enumerate(rates.items())}
        return threads | self.wakeup_counts.get(pid, {})

    def engine_env(self, pid: int, names) -> dict:
        return self.envs.get(pid, {"nice": 15, "affinity": [0, 1], "threads": 4, "thread_affinities": {"0-1": 4},
                                   "env": {name: None for name in names}})

    def set_rate(self, pid: int, cores: float) -> None:
        """Change a rate without rewriting the CPU already used."""
        used = self.base.get(pid, 0.0) + self.rates.get(pid, 0.0) * self.clock.now
        self.rates[pid] = cores
        self.base[pid] = used - cores * self.clock.now

"""CPU-seconds per process around every batch, and the measured quiet before it.

``Meter`` holds the processes ``serve_app.bench.procs`` found for each side and reads their
utime + stime (``/proc/<pid>/stat`` through psutil):

- **quiet** (``Meter.wait_quiet``): before a batch, sample the host's CPU (every process but the
  benchmark's client: the servers and anything else that would share the batch's cores) over
  ``window_s`` windows until one is at most ``threshold_cores`` (the idle floor measured when the
  run starts, ``Meter.measure_floor``, plus ``margin_cores``), or ``timeout_s`` passed (the
  batch then starts anyway and the record says so). The floor is there because our service is
  not idle when idle (issue #24: ≈ 27 % of a core on the 2-core host): an absolute few % would
  never be reached; once the idle tax is gone the floor is ≈ 0 and the threshold is the margin.
  What ran beside a batch anyway is its ``host_other_cores`` (``cpu_between``): a round where
  it passed ``stats.OUTSIDE_CORES`` is left out of the ratios (``stats.round_ratios``).
- **the batch's CPU** (``Meter.snapshot`` before, and after the batch *and* the quiet after it,
  ``cpu_between``): what the load caused, the engine's post-batch spin and deferred work (the
  ledger's writes) included. A process that appeared meanwhile counts whole (it was born in the
  window); one that exited is listed, its last seconds lost (``exited``). This window also
  charges each side's idle cost for as long as the quiet takes to come, which is longer for a
  side whose idle rate is noisier (ours: Ray's), however fast the batch was.
- **the steady-load CPU** (``steady_cpu``): snapshots every ``window_s`` during the batch, and the
  CPU between the first and the last of them inside the batch's sustained window (every worker
  streaming: ``serve_app.bench.stats.sustained``), over the tokens that arrived between the same
  two instants. It is what a server under constant load spends per token, every process counted,
  its idle cost at the rate it runs under load, with neither ramp-up, tail nor the quiet after.

``per_1k_tokens`` turns the batches of one concurrency into CPU-seconds per 1,000 completion
tokens per side and group: the gateway's cost as a ratio independent of the host's speed.
"""

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from serve_app.bench.procs import BASELINE, CLIENT, GROUPS, OURS, DiscoveryError, ProcessTable, Tracked

SERVERS = (OURS, BASELINE)
BORN_MARGIN_S = 1.5


@dataclass
class Snapshot:
    at: float  # the meter's clock (monotonic)
    wall: float  # time.time(), to compare with processes' create_time
    cpu: dict[int, tuple[float, float]] = field(default_factory=dict)  # pid → (create_time, cpu s)
    host_busy_s: float | None = None


@dataclass
class Meter:
    table: ProcessTable
    find: Callable[[], list[Tracked]]  # discovery (``procs.discover`` with the run's ports)
    window_s: float = 0.5
    margin_cores: float = 0.05
    timeout_s: float = 15.0
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    run_clock: Callable[[], float] = time.perf_counter  # the client's runs' clock (bench.client)
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    floor_cores: float = 0.0
    # Each side's idle floor measured with the other stopped (``bench.alone``): a batch of one side
    # waits for quiet against its own floor, not one that holds the stopped side's idle cost too.
    floors: dict[str, float] = field(default_factory=dict)
    tracked: dict[int, Tracked] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tracked = {t.pid: t for t in self.find()}

    @property
    def threshold_cores(self) -> float:
        return self.floor_cores + self.margin_cores

    def refresh(self) -> None:
        """Add processes born since (a new Ray worker, a reloaded HAProxy), take a living one's
        group as it is now (a title set since: a run started while a replica loaded saw its engine
        worker before vLLM titled it, and counted it as "other"); keep the gone ones' labels."""
        try:
            found = self.find()
        except DiscoveryError:  # e.g. the port between two HAProxy processes: keep what we know
            return
        for t in found:
            self.tracked[t.pid] = t

    def _busy(self) -> tuple[float | None, dict[int, float]]:
        """The host's busy CPU-seconds less the client's (None where the host's are unknown), and
        every server process's, by pid."""
        servers, client = {}, 0.0
        for t in self.tracked.values():
            if (value := self.table.cpu_seconds(t.pid, t.create_time)) is None:
                continue
            if t.side in SERVERS:
                servers[t.pid] = value
            else:
                client += value
        host = self.table.host_busy_s()
        return (None if host is None else host - client), servers

    async def _window(self) -> float:
        """The host's CPU over one window less the client's, in cores (1.0 = one core busy): the
        servers' and anything else's, since a batch shares the host with both. Where the host's
        is unknown, the servers' processes alive at both ends (one that exits meanwhile takes its
        lifetime's seconds with it, which would read as a negative rate)."""
        (host, servers), at = self._busy(), self.clock()
        await self.sleep(self.window_s)
        (host_after, servers_after), elapsed = self._busy(), self.clock() - at
        if elapsed <= 0:
            return 0.0
        if host is not None and host_after is not None:
            return max(host_after - host, 0.0) / elapsed
        return sum(servers_after[pid] - servers[pid] for pid in servers.keys() & servers_after.keys()) / elapsed

    async def measure_floor(self, windows: int = 4, side: str | None = None) -> float:
        """The host's idle CPU (cores): the least of ``windows`` windows, so one spike does not
        count; ``side``: the floor of that side running alone (``floors``)."""
        floor = min([await self._window() for _ in range(max(windows, 1))])
        if side is None:
            self.floor_cores = floor
        else:
            self.floors[side] = floor
        return floor

    def threshold(self, side: str | None = None) -> float:
        """Quiet: at most this many cores, ``side`` running (alone, if its floor was measured so)."""
        return self.floors.get(side, self.floor_cores) + self.margin_cores

    async def wait_quiet(self, side: str | None = None) -> dict[str, Any]:
        """Wait until the host is idle (see the module doc); how long it took, and the last rate."""
        started, threshold = self.clock(), self.threshold(side)
        while True:
            cores = await self._window()
            waited = self.clock() - started
            if cores <= threshold or waited >= self.timeout_s:
                return {"waited_s": waited, "cores": cores, "threshold_cores": threshold,
                        "timed_out": cores > threshold}

    def snapshot(self, refresh: bool = True) -> Snapshot:
        """Every tracked process's CPU now; ``refresh`` first looks for new processes (a scan of
        the host's process table: skipped by the samples taken during a batch)."""
        if refresh:
            self.refresh()
        snap = Snapshot(self.clock(), self.wall(), host_busy_s=self.table.host_busy_s())
        for t in self.tracked.values():
            if (value := self.table.cpu_seconds(t.pid, t.create_time)) is not None:
                snap.cpu[t.pid] = (t.create_time, value)
        return snap

    def cpu_between(self, before: Snapshot, after: Snapshot) -> dict[str, Any]:
        """``{"window_s", "sides": {side: {"total", "groups", "processes"}}, "host_other_s", "exited", "missed"}``."""
        sides: dict[str, dict[str, Any]] = {}
        exited, missed = [], []
        for pid, t in self.tracked.items():
            start, end = before.cpu.get(pid), after.cpu.get(pid)
            if end is None:
                if start is not None:
                    exited.append(f"{t.label} [{pid}]")
                continue
            if start is not None and start[0] == end[0]:
                used = end[1] - start[1]
            # Born in the window: all its CPU is the window's. psutil's create_time counts from the
            # boot time in whole seconds, so it reads up to 1 s early.
            elif end[0] >= before.wall - BORN_MARGIN_S:
                used = end[1]
            else:  # older than the window but not seen at its start: its share is unknown
                missed.append(f"{t.label} [{pid}]")
                continue
            side = sides.setdefault(t.side, {"total": 0.0, "groups": {}, "processes": {}})
            side["total"] += used
            side["groups"][t.group] = side["groups"].get(t.group, 0.0) + used
            key = f"{t.label} [{pid}]"
            side["processes"][key] = side["processes"].get(key, 0.0) + used
        busy = None
        if before.host_busy_s is not None and after.host_busy_s is not None:
            counted = sum(side["total"] for side in sides.values())
            busy = max(after.host_busy_s - before.host_busy_s - counted, 0.0)
        window = after.at - before.at
        return {"window_s": window, "sides": sides, "host_other_s": busy,
                "host_other_cores": busy / window if busy is not None and window > 0 else None,
                "exited": exited, "missed": missed}


# (client clock, snapshot): taken every ``window_s`` while a batch runs, for ``steady_cpu``
Samples = list[tuple[float, Snapshot]]


async def measured(meter: Meter, run: Callable[[], Awaitable[Any]],
                   side: str | None = None) -> tuple[Any, dict[str, Any], Samples]:
    """``run()`` between two snapshots, the second after the host is quiet again (``side``'s
    quiet: ``Meter.threshold``); and the snapshots sampled while it ran (its start and end included)."""
    before = meter.snapshot()
    samples: Samples = [(meter.run_clock(), before)]

    async def sample() -> None:
        while True:
            await meter.sleep(meter.window_s)
            samples.append((meter.run_clock(), meter.snapshot(refresh=False)))

    sampler = asyncio.ensure_future(sample())
    try:
        result = await run()
    finally:
        sampler.cancel()
    samples.append((meter.run_clock(), meter.snapshot(refresh=False)))
    settle = await meter.wait_quiet(side)
    cpu = meter.cpu_between(before, meter.snapshot())
    cpu["settle"] = settle
    return result, cpu, samples


def steady_cpu(meter: Meter, samples: Samples, window: Mapping[str, float] | None,
               tokens_between: Callable[[float, float], float]) -> dict[str, Any] | None:
    """The CPU between the first and the last sample inside ``window`` (the batch's sustained
    ``{"start", "end"}``, client clock) and ``tokens_between`` the same two instants; None when
    fewer than two samples fall inside (a window shorter than the sampling period)."""
    if not window:
        return None
    inside = [(at, snap) for at, snap in samples if window["start"] <= at <= window["end"]]
    if len(inside) < 2:
        return None
    (start, first), (end, last) = inside[0], inside[-1]
    cpu = meter.cpu_between(first, last)
    cpu["tokens"] = tokens_between(start, end)
    return cpu


def _per_1k(cpu_s: float, tokens: float) -> float | None:
    return 1000 * cpu_s / tokens if tokens else None


def per_1k_tokens(batches: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The counted batches of one concurrency (``{"side", "completion_tokens", "cpu"}`` each, and
    ``"steady_cpu"`` when measured) → per loaded side: CPU-s per 1,000 completion tokens of its
    own processes (by group and in total), of the client, the other server's CPU-seconds
    meanwhile (its idle tax, ≈ 0 where it was stopped: ``bench.alone``), the CPU-seconds of
    processes of neither side, and the processes that exited or were missed; ``steady``: the same per
    group and in total over the batches' steady-load windows (``steady_cpu``); plus ``ratio_total``
    and ``ratio_steady`` = ours / baseline."""
    out: dict[str, Any] = {}
    for batch in batches:
        cpu = batch.get("cpu")
        if not cpu:
            continue
        loaded = batch["side"]
        entry = out.setdefault(loaded, {"tokens": 0, "cpu_s": 0.0, "groups_cpu_s": {}, "processes_cpu_s": {},
                                        "client_cpu_s": 0.0, "other_server_cpu_s": 0.0, "outside_cpu_s": 0.0,
                                        "exited": [], "missed": [], "window_s": 0.0,
                                        "steady": {"tokens": 0.0, "cpu_s": 0.0, "groups_cpu_s": {}, "window_s": 0.0}})
        entry["tokens"] += batch["completion_tokens"]
        entry["window_s"] += cpu["window_s"]
        own = cpu["sides"].get(loaded, {})
        entry["cpu_s"] += own.get("total", 0.0)
        for name, key in (("groups", "groups_cpu_s"), ("processes", "processes_cpu_s")):
            _add(entry[key], own.get(name, {}))
        entry["client_cpu_s"] += cpu["sides"].get(CLIENT, {}).get("total", 0.0)
        entry["other_server_cpu_s"] += sum(cpu["sides"].get(s, {}).get("total", 0.0) for s in SERVERS if s != loaded)
        entry["outside_cpu_s"] += cpu.get("host_other_s") or 0.0
        entry["exited"] += cpu.get("exited", [])
        entry["missed"] += cpu.get("missed", [])
        if steady := batch.get("steady_cpu"):
            mine, acc = steady["sides"].get(loaded, {}), entry["steady"]
            acc["tokens"] += steady["tokens"]
            acc["window_s"] += steady["window_s"]
            acc["cpu_s"] += mine.get("total", 0.0)
            _add(acc["groups_cpu_s"], mine.get("groups", {}))
    for entry in out.values():
        tokens = entry["tokens"]
        entry["total"] = _per_1k(entry["cpu_s"], tokens)
        entry["client"] = _per_1k(entry["client_cpu_s"], tokens)
        entry["groups"] = _groups_per_1k(entry["groups_cpu_s"], tokens)
        entry["processes"] = {p: _per_1k(v, tokens) for p, v in sorted(entry["processes_cpu_s"].items())}
        steady = entry["steady"]
        steady["total"] = _per_1k(steady["cpu_s"], steady["tokens"])
        steady["groups"] = _groups_per_1k(steady["groups_cpu_s"], steady["tokens"])
    if OURS in out and BASELINE in out:
        for key, pick in (("ratio_total", lambda e: e["total"]), ("ratio_steady", lambda e: e["steady"]["total"])):
            ours, base = pick(out[OURS]), pick(out[BASELINE])
            if ours and base:
                out[key] = ours / base
    return out


def _add(into: dict[str, float], values: Mapping[str, float]) -> None:
    for item, value in values.items():
        into[item] = into.get(item, 0.0) + value


def _groups_per_1k(groups_cpu_s: Mapping[str, float], tokens: float) -> dict[str, float | None]:
    order = {g: i for i, g in enumerate(GROUPS)}
    return {g: _per_1k(v, tokens) for g, v in sorted(groups_cpu_s.items(), key=lambda kv: order.get(kv[0], len(order)))}

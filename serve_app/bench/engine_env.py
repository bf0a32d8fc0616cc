"""Is the engine run the same way on both sides? Its niceness and its threads, read from the host.

The ratio compares two copies of one engine; it means nothing if one copy runs at another
niceness (Ray's workers are nice 15, ``--baseline-vllm`` starts bare vLLM at 15 for that), with
another OpenMP thread count, or pinned to other CPUs. So the benchmark reads, for every vLLM
engine core of each side (``VLLM::EngineCore`` and its ``VLLM::Worker`` processes, where the
model runs): niceness, the process's CPU affinity, its thread count and the CPU lists its
threads are pinned to (vLLM's CPU backend binds its OpenMP threads one by one, and torch's
thread pool shows up as those threads), and the environment variables that set them (a process
whose title was set can have lost the start of its environ block: what it lacks is read from the
nearest ancestor that has it, and ``env_inherited`` names that ancestor's pid). Any field
that differs between the sides is a warning printed on stderr, at the top of the Markdown report
and in the JSON.
"""

from collections.abc import Iterable, Mapping
from typing import Any

from serve_app.bench.procs import BASELINE, OURS, ProcessTable, Tracked

ENGINE_GROUPS = ("EngineCore", "engine worker")
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCH_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND",
              "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_KVCACHE_SPACE")
COMPARED = ("nice", "affinity", "threads", "thread_affinities", "env")


def engine_envs(table: ProcessTable, tracked: Iterable[Tracked]) -> dict[str, list[dict[str, Any]]]:
    """Per side, one entry per engine process alive now: ``{"group", "label", "pid", "nice", …}``
    (one that exited, a replaced replica's, is not compared, nor a process its pid now names)."""
    out: dict[str, list[dict[str, Any]]] = {OURS: [], BASELINE: []}
    for t in sorted(tracked, key=lambda t: (t.side, t.group, t.pid)):
        if t.side in out and t.group in ENGINE_GROUPS and table.cpu_seconds(t.pid, t.create_time) is not None:
            out[t.side].append({"group": t.group, "label": t.label, "pid": t.pid,
                                **table.engine_env(t.pid, THREAD_ENV)})
    return out


def _fingerprint(entry: Mapping[str, Any]) -> dict[str, Any]:
    return {key: entry.get(key) for key in COMPARED}


def mismatches(envs: Mapping[str, list[Mapping[str, Any]]]) -> list[str]:
    """One sentence per difference between ours' and the baseline's engine processes (by group)."""
    if not envs.get(OURS) or not envs.get(BASELINE):
        missing = [side for side in (OURS, BASELINE) if not envs.get(side)]
        return [f"no vLLM engine process found for {' and '.join(missing)}: the engine environment was not compared"]
    problems = []
    for group in ENGINE_GROUPS:
        sides = {side: [_fingerprint(e) for e in envs[side] if e["group"] == group] for side in (OURS, BASELINE)}
        if not sides[OURS] and not sides[BASELINE]:
            continue
        if len(sides[OURS]) != len(sides[BASELINE]):
            problems.append(f"{group}: {len(sides[OURS])} process(es) in ours, {len(sides[BASELINE])} in the baseline")
            continue
        for ours, base in zip(sides[OURS], sides[BASELINE]):
            for key in COMPARED:
                if key == "env" and isinstance(ours.get(key), dict) and isinstance(base.get(key), dict):
                    for name in THREAD_ENV:
                        if ours[key].get(name) != base[key].get(name):
                            problems.append(f"{group}: {name} is {ours[key].get(name)!r} in ours, "
                                            f"{base[key].get(name)!r} in the baseline")
                elif ours.get(key) != base.get(key):
                    problems.append(f"{group}: {key} is {ours.get(key)!r} in ours, {base.get(key)!r} in the baseline")
    return problems


def warning_block(problems: list[str]) -> str:
    """The loud form, for stderr and the top of the report."""
    if not problems:
        return ""
    lines = ["WARNING: the engine does not run the same way on both sides; the ratios compare unlike engines:"]
    return "\n".join(lines + [f"  - {p}" for p in problems])

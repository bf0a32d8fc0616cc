"""Processes the benchmarks start and wait for: bare vLLM's OpenAI server, health polling, ports."""

import math
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import yaml

from serve_app import catalog
from serve_app.devtools.local_services import free_port, wait_healthy
from serve_app.runtime import cpus

# Ray starts its worker processes (the Serve replicas, hence our engine) at nice 15. On a 2-core
# machine a bare vLLM at nice 0 would win every scheduling contest against the router and proxy
# the other side still runs idle, so the baseline runs at the same niceness as the engine it is
# compared with.
RAY_WORKER_NICENESS = 15


def engine_environment(base: dict[str, str], model_env: dict[str, str], num_cpus: float | None) -> dict[str, str]:
    """The environment the replica's engine gets, for bare vLLM: ``base`` (what started it), the
    model's own variables, and OpenMP's thread count as Ray sets it in every worker that does not
    set one (``ray._private.utils.set_omp_num_threads_if_unset``: the floor of the CPUs the actor
    was given, at least 1). Without it bare vLLM ran torch's default, one OpenMP thread per core,
    against our engine's one on the 2-core host: the engines compared were not alike (the bench's
    engine check said so once both sides ran one engine)."""
    env = {**base, **model_env}
    env.setdefault("OMP_NUM_THREADS", str(max(math.floor(num_cpus if num_cpus is not None else 1), 1)))
    return env


def vllm_command(flags: list[str], port: int, niceness: int | None) -> list[str]:
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *flags,
               "--host", "127.0.0.1", "--port", str(port)]
    return ["nice", "-n", str(niceness), *command] if niceness is not None else command


def place_like_ours(pid: int) -> None:
    """Bare vLLM's engine core beside its worker, as a model replica places its own on this host
    (``runtime/cpus.py``: wherever `make run` pins its gateway, here or as
    ``SERVE_APP_GATEWAY_CPUS`` says): the ratio then compares gateways, not engine placements. The
    benchmark's engine check reads both sides' engine cores and says if they still differ."""
    setting = cpus.local_setting()
    if not setting:
        return
    for core, where in cpus.place_engine_cores("bare vLLM", pid, {cpus.GATEWAY_CPUS_ENV: setting}).items():
        placed = f"on CPUs {sorted(where)}, beside its worker" if where else "left where it is"
        print(f"bare vLLM's engine core {core} {placed} (as ours on this host)")


def replica_model(config: dict, model_id: str | None = None):
    """The model ``model_id`` (default: the first) as the config's model application runs it.
    The router's settings list it (``parse_region``) and the drift check holds them equal to the
    model applications Serve builds the replicas from; a config that fails it is refused (bare
    vLLM would not get the replica's flags), and so is a model it does not serve."""
    from serve_app.regions.layout import parse_region, problems

    if drift := problems(config):
        raise ValueError("the config's model applications are not what its router's settings render: "
                         + "; ".join(drift))
    models = parse_region(config).models
    wanted = None if model_id is None else catalog.canonical_id(model_id) or model_id  # an alias names its model
    chosen = [m for m in models if wanted is None or m.id == wanted]
    if not chosen:
        raise ValueError(f"the config serves no model {model_id!r} (it serves {', '.join(m.id for m in models)})")
    return chosen[0]


@contextmanager
def bare_vllm(config_path: Path, niceness: int | None = RAY_WORKER_NICENESS, model_id: str | None = None):
    """Bare vLLM's OpenAI server with the same engine flags the config gives the Serve replica
    of ``model_id`` (default: the config's first model).

    Yields ``(url, served model id)``; stops the process (by PID) on exit. ``niceness``: run it
    under ``nice -n`` (default: Ray's worker niceness, see above); None runs it at ours.
    """
    from serve_app.app import resolve_model_path

    model = replica_model(yaml.safe_load(config_path.read_text()), model_id)
    port = free_port()
    flags = model.engine_cli_args(resolve_model_path(model))
    command = vllm_command(flags, port, niceness)
    env = engine_environment(dict(os.environ), model.resources.env, model.resources.num_cpus)
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-vllm-{port}.log", "w")
    started = time.monotonic()
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:

        def exited() -> str | None:
            return None if process.poll() is None else f"bare vLLM exited with {process.returncode}; see {log.name}"

        wait_healthy(url, 600, failed=exited)
        print(f"bare vLLM ready after {time.monotonic() - started:.1f} s")
        place_like_ours(process.pid)
        yield url, model.id
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()

"""What the fault suite reads from the Ray cluster behind the URL it tests (same machine).

Processes are found by Ray's own state API (the replica actors' pids), never by a name pattern;
the one process the suite kills, the replica's vLLM engine core, is a child of that pid. Whether a
router imported vLLM is read from the libraries its process has mapped (``libtorch``, vLLM's
``_C``): importing vLLM maps torch's shared objects, and they stay mapped.
"""

import os
import signal
from dataclasses import dataclass
from pathlib import Path

import psutil

ENGINE_CORE_TITLE = "VLLM::EngineCore"
_HEAVY_LIBRARIES = ("libtorch", "/vllm/")


@dataclass(frozen=True)
class Replica:
    deployment: str  # Router, model-qwen-3.6-35b-a3b, ...
    app: str
    pid: int
    replica_id: str = ""  # Serve's (pg_metadata.replica names the one that served a request)

    @property
    def rss_mib(self) -> float:
        """The replica process and its children (a model replica's vLLM engine core)."""
        process = psutil.Process(self.pid)
        total = process.memory_info().rss
        for child in process.children(recursive=True):
            try:
                total += child.memory_info().rss
            except psutil.NoSuchProcess:
                continue
        return total / 2**20

    def imported_vllm(self) -> bool:
        maps = Path(f"/proc/{self.pid}/maps").read_text()
        return any(library in maps for library in _HEAVY_LIBRARIES)

    def engine_core(self) -> psutil.Process | None:
        for child in psutil.Process(self.pid).children(recursive=True):
            try:
                if ENGINE_CORE_TITLE in " ".join(child.cmdline()) or child.name().startswith("VLLM::Engine"):
                    return child
            except psutil.NoSuchProcess:
                continue
        return None


def connect(address: str = "auto") -> None:
    """Join the cluster (``serve run`` / ``make run`` starts one on this machine) unless this
    process already did (the integration tests)."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address, namespace="serve", logging_level="ERROR", log_to_driver=False)


def replicas(app: str) -> list[Replica]:
    import ray
    from ray.util.state import list_actors

    found = []
    # The cluster this process joined, not whichever one "auto" would find on the machine.
    address = ray.get_runtime_context().gcs_address
    for actor in list_actors(address=address, filters=[("state", "=", "ALIVE")], detail=True, limit=1000):
        # Serve names its replica actors' classes ServeReplica:<app>:<deployment>.
        kind, _, rest = (actor.class_name or "").partition(":")
        actor_app, _, deployment = rest.partition(":")
        if kind == "ServeReplica" and actor_app == app and actor.pid:
            # Its actor is named SERVE_REPLICA::<app>#<deployment>#<replica id>.
            replica_id = (actor.name or "").rpartition("#")[2]
            found.append(Replica(deployment=deployment, app=actor_app, pid=actor.pid, replica_id=replica_id))
    return found


def routers(app: str) -> list[Replica]:
    return [r for r in replicas(app) if r.deployment == "Router"]


def model_replicas(app: str, model_deployment: str) -> list[Replica]:
    return [r for r in replicas(app) if r.deployment == model_deployment]


def unfinished_requests(app: str, model_deployment: str) -> int:
    """Requests vLLM still holds (running or waiting) on the replica the handle picks: the local
    config runs one, which is where the suite runs."""
    from ray import serve

    handle = serve.get_deployment_handle(model_deployment, app_name=app)
    return int(handle.engine_stats.remote().result(timeout_s=30)["unfinished_requests"])


def kill_engine_core(replica: Replica) -> int:
    """SIGKILL the replica's engine core (as an OOM kill or a driver fault would); its pid."""
    core = replica.engine_core()
    if core is None:
        raise RuntimeError(f"no {ENGINE_CORE_TITLE} process under replica pid {replica.pid}")
    os.kill(core.pid, signal.SIGKILL)
    return core.pid

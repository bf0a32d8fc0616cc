"""Hot-load: which models a region wants loaded, and what state each one is in.

A model deployment is always part of the Serve application, but it runs replicas only while it is
*wanted loaded*. The wanted state (``loaded`` or ``cold``) is set by ``POST /v1/models/load`` and
``/v1/models/unload`` and kept in Ray's GCS key-value store, under the Serve application and
deployment names (the routers also set a required model found cold back to ``loaded``:
``tracker.py``), so every router replica and the Serve controller (where the autoscaling policy,
``serve_app.hot_load.autoscaling``, runs) read the same value, and it survives router and
controller restarts. Until a model has been loaded or unloaded, its config's ``initial_state``
stands. The KV store lives as long as the Ray cluster; a new cluster starts from the config.

What a caller sees (``/v1/models``) is derived from the wanted state and the replicas Serve
reports:

========== ===================================================================================
loaded     wanted loaded and at least one replica running: requests are served
loading    wanted loaded, no replica running yet (weights loading, or waiting for a GPU)
recovering wanted loaded, no replica running: a replica failed its health checks (its engine
           died) and Serve is replacing it; transient, seconds to a minute (docs/reliability.md)
failed     wanted loaded, no replica running, and Serve gave up starting one
unloading  wanted cold, replicas still draining their in-flight requests
cold       wanted cold, no replicas: costs nothing, needs a load before it serves
========== ===================================================================================

``message`` says in our words what a state without a running replica waits for. Serve's own
message (resources asked for and available, actor ids, a failed constructor's traceback with the
image's paths) is for operators: the router logs it (``tracker.py``), callers never see it.

Only ``loaded`` models receive requests; the others answer 503 with ``Retry-After`` (or the
request fails over to a peer region). Nothing is ever sent to a cold deployment's handle, because a
request queued there would make Serve start a replica by itself.
"""

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

LOADED, LOADING, RECOVERING, FAILED, UNLOADING, COLD = (
    "loaded", "loading", "recovering", "failed", "unloading", "cold"
)
Wanted = Literal["loaded", "cold"]
KV_NAMESPACE = "serve_app"
READ_TIMEOUT_S = 10  # a GCS that does not answer: the refresh fails and the last view stands
# The policy reads in Serve's controller loop, which updates every application in turn: a read
# with no deadline held them all for as long as the GCS did not answer (the last state stands).
POLICY_READ_TIMEOUT_S = 1.0

# Serve's replica states (ray.serve._private.common.ReplicaState) grouped for the caller. Serve
# routes to a replica RUNNING or PENDING_MIGRATION (its node drains, a KubeRay scale-down or a
# preemption: it serves until its replacement runs, minutes for an engine); one RECOVERING (the
# controller restarted and finds it again) it lists as before until recovered. UPDATING (an
# in-place change of its options) is out of Serve's routing for a moment, its calls queued: the
# model still serves (``updating``), but that replica is not one a call can go to now. Until
# 2026-12-07 all four but RUNNING counted as starting: a model whose replicas were all in one
# read "loading", new requests were 503 ``model_loading`` and /health failed the region.
_ROUTABLE = ("RUNNING", "PENDING_MIGRATION", "RECOVERING")
_STARTING = ("STARTING",)
# UNHEALTHY: a replica failed its health checks and Serve is starting its replacement.
# DEPLOY_FAILED: replicas failed to start, again and again; Serve gave up until the next deploy.


@dataclass(frozen=True)
class WantedRecord:
    state: Wanted
    since: float  # unix time the state was last set
    # key id of the admin who set it; tracker.REQUIRED_BY when routers loaded a required model left
    # cold; None: the config's initial_state
    by: str | None = None


def _key(app_name: str, deployment: str) -> bytes:
    return f"hot_load/{app_name}/{deployment}".encode()


def read_wanted(app_name: str, deployment: str) -> WantedRecord | None:
    """The wanted state set through the API, or None if it was never set in this cluster."""
    from ray.experimental import internal_kv

    gcs = internal_kv.internal_kv_get_gcs_client()
    raw = gcs.internal_kv_get(_key(app_name, deployment), KV_NAMESPACE.encode(), timeout=POLICY_READ_TIMEOUT_S)
    return _record(raw)


async def read_wanted_all(locations: Iterable[tuple[str, str]]) -> dict[tuple[str, str], WantedRecord]:
    """The wanted states of ``locations`` (application, deployment) set through the API; those never
    set are left out. One GCS call from the event loop: the router asks every second
    (serve_app/hot_load/tracker.py), and a call per model from a worker thread cost that thread and
    the GCS a wake-up each (docs/benchmarks.md, "The router's idle event loop")."""
    from ray.experimental import internal_kv

    keys = {_key(app_name, deployment): (app_name, deployment) for app_name, deployment in locations}
    if not keys:
        return {}
    found = await internal_kv.internal_kv_get_gcs_client().async_internal_kv_multi_get(
        list(keys), KV_NAMESPACE.encode(), timeout=READ_TIMEOUT_S
    )
    return {keys[key]: record for key, raw in found.items() if (record := _record(raw)) is not None}


def _record(raw: bytes | None) -> WantedRecord | None:
    if not raw:
        return None
    data = json.loads(raw)
    return WantedRecord(state=data["state"], since=float(data["since"]), by=data.get("by"))


def write_wanted(app_name: str, deployment: str, state: Wanted, by: str) -> WantedRecord:
    from ray.experimental import internal_kv

    record = WantedRecord(state=state, since=time.time(), by=by)
    # A deadline: a put the GCS never answers held the router's refresh (a required model's
    # write-back) and the admin's load or unload with it.
    internal_kv.internal_kv_get_gcs_client().internal_kv_put(
        _key(app_name, deployment),
        json.dumps({"state": record.state, "since": record.since, "by": record.by}).encode(),
        True,
        KV_NAMESPACE.encode(),
        timeout=READ_TIMEOUT_S,
    )
    return record


@dataclass(frozen=True)
class ModelState:
    state: str  # one of LOADED, LOADING, RECOVERING, FAILED, UNLOADING, COLD
    wanted: Wanted
    running: int = 0  # replicas a call can go to now (the direct line, a resume's count of others)
    starting: int = 0
    stopping: int = 0
    updating: int = 0  # serving, out of Serve's routing for an in-place change (shown as running)
    since: float | None = None  # when the wanted state was set (None: since deploy)
    message: str | None = None  # while loading, recovering or failed, when Serve says why: ours

    @property
    def serving(self) -> bool:
        return self.state == LOADED

    def to_json(self, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        return {
            "state": self.state,
            "replicas": {"running": self.running + self.updating, "starting": self.starting, "stopping": self.stopping},
            "since": self.since,
            "elapsed_s": None if self.since is None else round(max(now - self.since, 0.0), 1),
            "message": self.message,
        }


# What a caller reads while a model it wants has no running replica and Serve says why.
PUBLIC_MESSAGES = {
    LOADING: "a replica is starting: waiting for a GPU, or loading the weights",
    RECOVERING: "a replica failed its health checks and is being replaced",
    FAILED: "replicas failed to start; the region's operators have the details in its logs",
}


def derive_state(
    wanted: WantedRecord,
    replica_states: Mapping[str, int],
    deployment_status: str | None = None,
    message: str | None = None,
) -> ModelState:
    """The caller-facing state from the wanted state and Serve's replica counts by state name;
    ``message``, Serve's own, only decides whether the state carries one of ours."""
    running = sum(int(replica_states.get(name, 0)) for name in _ROUTABLE)
    starting = sum(int(replica_states.get(name, 0)) for name in _STARTING)
    stopping = int(replica_states.get("STOPPING", 0))
    updating = int(replica_states.get("UPDATING", 0))
    counts = {"running": running, "starting": starting, "stopping": stopping, "updating": updating}
    since = wanted.since if wanted.by is not None else None
    if wanted.state == "cold":
        state = UNLOADING if running or starting or stopping or updating else COLD
        return ModelState(state, "cold", since=since, **counts)
    if running or updating:
        return ModelState(LOADED, "loaded", since=since, **counts)
    state = {"DEPLOY_FAILED": FAILED, "UNHEALTHY": RECOVERING}.get(deployment_status or "", LOADING)
    return ModelState(state, "loaded", since=since, message=PUBLIC_MESSAGES[state] if message else None, **counts)

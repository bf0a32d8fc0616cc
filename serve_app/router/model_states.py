"""The router's view of each model's hot-load state (serve_app/model_state.py), kept fresh.

A background task refreshes every model's state from the wanted state in the GCS KV store once a
second (one small KV read per model) and from Serve's status only when it may have changed: every
``STATUS_MAX_AGE_S``, or at once while a model is not settled as loaded or its wanted state changed.
``serve.status()`` builds and pickles every deployment's config in the router's process; polling
it once a second cost ~8 % of a core under load on the 2-core host (py-spy, docs/benchmarks.md).
The request path reads the view from memory. A router replica that takes a load or unload updates
its own view at once; the others follow within a second.
"""

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from serve_app.config import ModelDeploymentArgs
from serve_app.errors import retry_later
from serve_app.model_state import (
    COLD,
    FAILED,
    LOADED,
    LOADING,
    UNLOADING,
    ModelState,
    Wanted,
    WantedRecord,
    derive_state,
    read_wanted,
    write_wanted,
)

logger = logging.getLogger("ray.serve")

REFRESH_S = 1.0
# While every model is steadily loaded, Serve's status is read this rarely: a replica that dies in
# between is still answered (503 ``engine_unavailable``/``replica_unavailable``, then failover).
STATUS_MAX_AGE_S = 10.0
# Retry hints for requests that reach a model that is not serving: a load of the FP8 checkpoint
# takes minutes on a GPU; a cold model serves only after an admin loads it.
RETRY_AFTER_S = {LOADING: 30, FAILED: 60, UNLOADING: 60, COLD: 60}


class ModelStates:
    def __init__(
        self,
        app_name: str,
        models: Sequence[ModelDeploymentArgs],
        *,
        serve_status: Callable[[], Any] | None = None,
        read: Callable[[str, str], WantedRecord | None] = read_wanted,
        write: Callable[[str, str, Wanted, str], WantedRecord] = write_wanted,
    ):
        self.app_name = app_name
        self.deployments = {model.id: model.deployment_name for model in models}
        self._initial = {model.id: WantedRecord(model.initial_state, time.time()) for model in models}
        self._serve_status = serve_status or _serve_status
        self._read, self._write = read, write
        self._states: dict[str, ModelState] = {
            model_id: derive_state(wanted, {}) for model_id, wanted in self._initial.items()
        }
        self._refreshed = False
        self._task: asyncio.Task | None = None
        self._wanted: dict[str, WantedRecord] = {}
        self._deployments: dict[str, Any] = {}  # Serve's status per deployment, last read
        self._status_read_at = float("-inf")

    def get(self, model_id: str) -> ModelState:
        return self._states[model_id]

    async def ensure_fresh(self, max_status_age_s: float | None = None) -> None:
        """Start the refresh loop (first call in the replica's event loop); wait for a first view,
        or for a new one when Serve's status was read more than ``max_status_age_s`` ago."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._refresh_forever())
        stale = max_status_age_s is not None and time.monotonic() - self._status_read_at > max_status_age_s
        if not self._refreshed or stale:
            await self.refresh()

    async def refresh(self, *, status: bool = True, wanted: dict[str, WantedRecord] | None = None) -> None:
        """Re-read the wanted states (unless given), and Serve's status too when ``status``."""
        if wanted is None:
            wanted = await asyncio.to_thread(self._read_all)
        if status:
            self._deployments = _deployments_of(await asyncio.to_thread(self._serve_status), self.app_name)
            self._status_read_at = time.monotonic()
        self._wanted = wanted
        for model_id, deployment in self.deployments.items():
            self._states[model_id] = _state_of(wanted[model_id], self._deployments.get(deployment))
        self._refreshed = True

    def _status_may_have_changed(self, wanted: dict[str, WantedRecord]) -> bool:
        return (
            time.monotonic() - self._status_read_at > STATUS_MAX_AGE_S
            or wanted != self._wanted
            or any(state.state != LOADED or state.message for state in self._states.values())
        )

    async def set_wanted(self, model_id: str, state: Wanted, by: str) -> ModelState:
        """Record the wanted state for every router and the autoscaling policy; return the new view."""
        deployment = self.deployments[model_id]
        await asyncio.to_thread(self._write, self.app_name, deployment, state, by)
        await self.refresh()
        return self._states[model_id]

    def stop(self) -> None:
        """Stop the refresh loop (the replica is shutting down)."""
        if self._task is not None:
            self._task.cancel()

    def require_serving(self, model_id: str, region: str) -> None:
        """A 503 with Retry-After unless the model is loaded here (the router may then fail over)."""
        state = self._states[model_id]
        if state.serving:
            return
        reasons = {
            LOADING: "is loading in region {region}",
            FAILED: "failed to load in region {region}",
            UNLOADING: "is being unloaded in region {region}",
            COLD: "is not loaded in region {region}; an admin can POST /v1/models/load",
        }
        raise retry_later(
            f"{model_id} {reasons[state.state].format(region=region)}",
            f"model_{state.state}",
            retry_after_s=RETRY_AFTER_S[state.state],
            param="model",
        )

    def _read_all(self) -> dict[str, WantedRecord]:
        return {
            model_id: self._read(self.app_name, deployment) or self._initial[model_id]
            for model_id, deployment in self.deployments.items()
        }

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            try:
                wanted = await asyncio.to_thread(self._read_all)
                await self.refresh(status=self._status_may_have_changed(wanted), wanted=wanted)
            except Exception:  # the controller restarting, say: keep the last view and retry
                logger.warning("could not refresh model states", exc_info=True)


def _serve_status():
    from ray import serve

    return serve.status()


def _deployments_of(status: Any, app_name: str) -> dict[str, Any]:
    app = status.applications.get(app_name)
    return dict(app.deployments) if app is not None else {}


def _state_of(wanted: WantedRecord, deployment: Any) -> ModelState:
    if deployment is None:  # not deployed yet (the app is still being built)
        return derive_state(wanted, {})
    replica_states = {str(getattr(k, "value", k)): n for k, n in deployment.replica_states.items()}
    status = str(getattr(deployment.status, "value", deployment.status))
    return derive_state(wanted, replica_states, status, deployment.message)

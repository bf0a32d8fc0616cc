"""The router's view of each model's hot-load state (serve_app/hot_load/state.py), kept fresh.

A background task refreshes every model's state from the wanted state in the GCS KV store once a
second (one small KV call for all models, from the event loop) and from Serve's status only when it
may have changed: every ``STATUS_MAX_AGE_S``, or at once while a model is not settled as loaded or
its wanted state changed.
Serve's status is read as the controller's plain details dict (``_serve_status``): ``serve.status()``
builds pydantic models of it and cloudpickles every deployment's request router class, ~0.2 s of
the router's CPU a call under load (py-spy, docs/benchmarks.md).
The request path reads the view from memory. A router replica that takes a load or unload updates
its own view at once; the others follow within a second.

A model the region's ``/health`` requires (``region_health: required``) is not left wanted cold:
its unload is refused (409 ``model_required``), and a ``cold`` set before this router took it as
required (an admin unloaded it before a deploy marked it required) is written back to ``loaded`` on
the refresh that reads it, with a warning. Otherwise that deploy would keep the region's ``/health``
503, out of global routing, until someone loaded the model by hand. A ``cold`` set later came through
a router on other settings (the model made optional, then unloaded, while this router drains): left.

Each model runs in a Serve application of its own (serve_app/regions/layout.py), named after the
router's: its status and its wanted state are looked up under that application and the model's
deployment. The models served change in place when the router is reconfigured (``set_models``).
"""

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from serve_app.config import ModelDeploymentArgs
from serve_app.errors import retry_later
from serve_app.regions.layout import model_app_name
from serve_app.hot_load.state import (
    COLD,
    FAILED,
    LOADED,
    LOADING,
    RECOVERING,
    UNLOADING,
    ModelState,
    Wanted,
    WantedRecord,
    derive_state,
    read_wanted_all,
    write_wanted,
)
from serve_app.telemetry.logs import module_logger

logger = module_logger(__name__)

REFRESH_S = 1.0
# How long Serve's controller may take to say its status: as the GCS read of the wanted states
# (``state.READ_TIMEOUT_S``). A controller that never answers (restarting, wedged) made a router's
# first request wait with it, and every later refresh.
STATUS_TIMEOUT_S = 10.0
Location = tuple[str, str]  # a model's Serve application and deployment
# While every model is steadily loaded, Serve's status is read this rarely: a replica that dies in
# between is still answered (503 ``engine_unavailable``/``replica_unavailable``, then failover; a
# call Serve's queue holds for want of a replica, once the view says so: ``call.SERVING_CHECK_S``).
STATUS_MAX_AGE_S = 10.0
# After a replica reports a dead engine: long enough to cover Serve's health checks failing
# three times and the replica being stopped (about 10 s here, docs/reliability.md).
SUSPECT_S = 30.0
# How long a model whose deployment Serve stops listing keeps its last status: a redeploy of its
# application rebuilds it (seconds); past this the model reads as not deployed (loading).
REBUILD_GRACE_S = 30.0
# Retry hints for requests that reach a model that is not serving: a load of the FP8 checkpoint
# takes minutes on a GPU; a replica being replaced is back within about a minute here (measured,
# docs/reliability.md), and clients should look again soon; a cold model serves only after an
# admin loads it.
RETRY_AFTER_S = {LOADING: 30, RECOVERING: 5, FAILED: 60, UNLOADING: 60, COLD: 60}
# Who set a required model's wanted state back to loaded, in its record (an admin's key id otherwise).
REQUIRED_BY = "region_health: required"


class ModelStates:
    def __init__(
        self,
        router_app: str,
        models: Sequence[ModelDeploymentArgs],
        *,
        serve_status: Callable[[], Any] | None = None,
        read_all: Callable[[Iterable[Location]], Awaitable[Mapping[Location, WantedRecord]]] = read_wanted_all,
        write: Callable[[str, str, Wanted, str], WantedRecord] = write_wanted,
    ):
        self.router_app = router_app
        self.locations: dict[str, tuple[str, str]] = {}  # model id -> (its application, its deployment)
        self._initial: dict[str, WantedRecord] = {}
        self._states: dict[str, ModelState] = {}
        self._serve_status = serve_status or _serve_status
        self._read_all_of, self._write = read_all, write
        # Refreshes may overlap (the loop's, a first view's, an admin's load): each is numbered when
        # it starts, and what it read replaces only what an earlier-started one read (the last to
        # end used to win, and an unload could read "loaded" again for a second).
        self._refreshes = self._wanted_from = self._status_from = 0
        self._refreshed = False
        self._task: asyncio.Task | None = None
        self._wanted: dict[str, WantedRecord] = {}
        self._deployments: dict[str, Any] = {}  # Serve's status per model's deployment, last read
        self._missing_since: dict[str, float] = {}  # a model whose deployment Serve stopped listing
        self._required_since: dict[str, float] = {}  # when this router first had each model required
        self.set_models(models)
        self._status_read_at = float("-inf")
        self._suspect_until = float("-inf")
        self._pending: asyncio.Task | None = None  # a refresh a caller asked for, in flight
        self._serve_messages: dict[str, str] = {}  # Serve's message per model, last logged
        self._writing: set[str] = set()  # required models being written back to loaded
        self._said: set[tuple[str, float]] = set()  # (model, its cold record's time) already logged

    def set_models(self, models: Sequence[ModelDeploymentArgs]) -> None:
        """Follow ``models`` from now on (the router's settings changed): a new model starts from
        its ``initial_state`` until the next refresh; one no longer listed keeps its last state
        for the requests already on their way to it, and is refreshed no more."""
        joined = {m.id for m in models} - self.locations.keys()
        self.locations = {m.id: (model_app_name(self.router_app, m.id), m.deployment_name) for m in models}
        self.required = {m.id for m in models if m.region_health == "required"}
        now = time.time()
        self._required_since = {m: self._required_since.get(m, now) for m in self.required}
        self._initial = {
            m.id: self._initial[m.id]
            if m.id in self._initial and self._initial[m.id].state == m.initial_state
            else WantedRecord(m.initial_state, time.time())
            for m in models
        }
        for model_id, wanted in self._initial.items():
            if model_id in joined:  # a model added back is not what it was when it left: not deployed yet
                self._states[model_id] = derive_state(wanted, {})
            else:
                self._states.setdefault(model_id, derive_state(wanted, {}))
        self._wanted = {}  # the next refresh reads Serve's status: a model may have joined

    def get(self, model_id: str) -> ModelState:
        return self._states[model_id]

    async def ensure_fresh(self, max_status_age_s: float | None = None, wait_s: float | None = None) -> None:
        """Start the refresh loop (first call in the replica's event loop); wait for a first view,
        or for a new one when Serve's status was read more than ``max_status_age_s`` ago — at
        most ``wait_s`` for that one: ``serve.status()`` asks the controller, which can take
        seconds while it handles a failed replica, and ``/health`` must answer at once (from the
        last view) even then. The refresh it started goes on and updates the view."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._refresh_forever())
        if not self._refreshed:
            # One first read for every request that arrives before it answers (each one its own
            # was a thread each, all stuck while the controller hangs).
            if self._pending is None or self._pending.done():
                self._pending = asyncio.get_running_loop().create_task(self.refresh())
                self._pending.add_done_callback(_log_failure)
            try:  # /health waits ``wait_s`` at most, as for a later view
                await asyncio.wait_for(asyncio.shield(self._pending), wait_s)
            except Exception as err:  # nothing to answer from yet: a 503 the router may fail over
                if self._refreshed:  # the refresh loop's own read answered meanwhile
                    return
                raise retry_later("this region's model states could not be read yet (Serve's controller or the GCS has "
                                  "not answered)", "model_states_unavailable", retry_after_s=5) from err
            return
        if max_status_age_s is None or time.monotonic() - self._status_read_at <= max_status_age_s:
            return
        if self._pending is None or self._pending.done():
            self._pending = asyncio.get_running_loop().create_task(self.refresh())
            self._pending.add_done_callback(_log_failure)
        if wait_s is None:
            await asyncio.shield(self._pending)
        else:
            await asyncio.wait({self._pending}, timeout=wait_s)

    async def refresh(self, *, status: bool = True, wanted: dict[str, WantedRecord] | None = None,
                      number: int | None = None) -> None:
        """Re-read the wanted states (unless given: ``number`` is then the one taken before they
        were read, ``_number``), and Serve's status too when ``status``."""
        number = number or self._number()
        if wanted is None:
            wanted = await self._read_all()
        wanted = await self._load_required(wanted)
        locations = self.locations  # as they are now: set_models may run while Serve answers
        asked = time.monotonic()
        deployments = await asyncio.to_thread(self._serve_status) if status else None
        if deployments is not None and number > self._status_from:
            self._status_from = number
            self._deployments = self._with_rebuilding(_deployments_of(deployments, locations))
            self._status_read_at = asked  # as old as the question: an answer may be seconds late
        if number > self._wanted_from:
            self._wanted_from, self._wanted = number, wanted
        wanted = self._wanted
        for model_id in locations.keys() & wanted.keys():
            status_of = self._deployments.get(model_id)
            self._log_serve_message(model_id, getattr(status_of, "message", "") or "")
            self._states[model_id] = _state_of(wanted[model_id], status_of)
        self._refreshed = True

    async def _load_required(self, wanted: dict[str, WantedRecord]) -> dict[str, WantedRecord]:
        """``wanted``, with each required model found wanted cold *since before this router made it
        required* written back to loaded (best effort: a failed write leaves the record as read, and
        the next refresh tries again). A cold set later came through a router on other settings (an
        operator making it optional, deploying, then unloading, while this one still drains): left
        alone. Each case is logged once per record."""
        locations = self.locations  # as they are now: set_models may run during the writes
        wanted = dict(wanted)
        for model_id in sorted(self.required & wanted.keys() & locations.keys()):
            record = wanted[model_id]
            if record.state != "cold" or model_id in self._writing:
                continue
            set_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record.since))
            if record.since > self._required_since.get(model_id, float("inf")):
                self._warn_once(record, "%s is required here (region_health: required) but was unloaded at %s by "
                                "%s, through a router on other settings: left cold", model_id, set_at, record.by)
                continue
            self._writing.add(model_id)
            try:
                wanted[model_id] = await asyncio.to_thread(self._write, *locations[model_id], "loaded", REQUIRED_BY)
            except Exception:
                self._warn_once(record, "could not load %s, required here but wanted cold", model_id, exc_info=True)
                continue
            finally:
                self._writing.discard(model_id)
            logger.warning("%s is required here (region_health: required) but was wanted cold (set %s by %s): "
                           "loaded it, as /health is 503 while it serves nowhere", model_id, set_at,
                           record.by or "the config")
        return wanted

    def _warn_once(self, record: WantedRecord, message: str, model_id: str, *args, **kwargs) -> None:
        """A warning about this model's cold record, logged the first time only (refreshes repeat)."""
        if (model_id, record.since) not in self._said:
            self._said.add((model_id, record.since))
            logger.warning(message, model_id, *args, **kwargs)

    def _with_rebuilding(self, found: dict[str, Any]) -> dict[str, Any]:
        """``found``, plus the last status of a model whose deployment Serve has stopped listing
        for less than ``REBUILD_GRACE_S``: a redeploy of its application (a new engine flag, new
        weights) rebuilds it, and for those seconds Serve lists no deployment in it while the old
        replicas still serve; without this the model would read as loading, a 503 per request."""
        now = time.monotonic()
        for model_id in found.keys() & self._missing_since.keys():
            del self._missing_since[model_id]  # listed again
        kept = dict(found)
        for model_id, last in self._deployments.items():
            if model_id in found or model_id not in self.locations:
                continue
            if now - self._missing_since.setdefault(model_id, now) < REBUILD_GRACE_S:
                kept[model_id] = last
        return kept

    def _log_serve_message(self, model_id: str, message: str) -> None:
        """Serve's words about a deployment, for operators: logged once each time they change
        (the state callers see says what they mean in ours, ``state.PUBLIC_MESSAGES``)."""
        if message != self._serve_messages.get(model_id, ""):
            self._serve_messages[model_id] = message
            if message:
                logger.warning("Serve on %s of %s: %s", *reversed(self.locations[model_id]), message)

    def suspect(self) -> None:
        """A replica answered that its engine died or could not be reached: read Serve's status
        every refresh for a while, so the view turns ``recovering`` within a second of Serve
        stopping the replica and new requests get a quick 503 (or fail over) instead of waiting
        in Serve's queue for the replacement to start."""
        self._suspect_until = time.monotonic() + SUSPECT_S

    def _status_may_have_changed(self, wanted: dict[str, WantedRecord]) -> bool:
        return (
            time.monotonic() - self._status_read_at > STATUS_MAX_AGE_S
            or time.monotonic() < self._suspect_until
            or wanted != self._wanted
            or any(not _settled(state) for model_id, state in self._states.items() if model_id in self.locations)
        )

    async def set_wanted(self, model_id: str, state: Wanted, by: str) -> ModelState:
        """Record the wanted state for every router and the autoscaling policy; return the new view."""
        app, deployment = self.locations[model_id]
        try:
            await asyncio.to_thread(self._write, app, deployment, state, by)
        except Exception as err:  # the GCS did not answer within its deadline: it may still land
            logger.warning("could not record %s wanted %s: %s: %s", model_id, state, type(err).__name__, err)
            raise retry_later(f"{model_id}'s wanted state could not be recorded (the cluster's store did not "
                              "answer); it may still be: read the model's state, then retry",
                              "model_state_unavailable", retry_after_s=5) from None
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
            RECOVERING: "is recovering in region {region}: a replica failed and is being replaced",
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

    async def _read_all(self) -> dict[str, WantedRecord]:
        locations, initial = self.locations, self._initial  # set_models may replace either meanwhile
        models = [model_id for model_id in initial if model_id in locations]
        found = await self._read_all_of([locations[model_id] for model_id in models])
        return {model_id: found.get(locations[model_id]) or initial[model_id] for model_id in models}

    def _number(self) -> int:
        self._refreshes += 1
        return self._refreshes

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            try:
                number = self._number()
                wanted = await self._read_all()
                await self.refresh(status=self._status_may_have_changed(wanted), wanted=wanted, number=number)
            except Exception:  # the controller restarting, say: keep the last view and retry
                logger.warning("could not refresh model states", exc_info=True)


def _settled(state: ModelState) -> bool:
    """Nothing to watch for: loaded with nothing to say, or cold with no replica left. A model an
    admin unloaded read Serve's status every second (each read a thread hop here and, in the
    controller, a checkpoint read and a validation of every application) for as long as it stayed
    cold; a change of its wanted state still reads at once. (Cold means no replica left:
    ``derive_state`` says unloading while any is.)"""
    return state.state == COLD or (state.state == LOADED and not state.message)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("could not refresh model states", exc_info=task.exception())


@dataclass(frozen=True)
class DeploymentView:
    """What the tracker reads of one deployment in Serve's status."""

    status: str
    message: str
    replica_states: dict[str, int]


def status_name(status: Any) -> str:
    """A status as Serve names it ("RUNNING", "DEPLOY_FAILED"…): ``serve.status()`` gives its
    enums (str-valued), the controller's details dict plain strings; either reads the same here."""
    return str(getattr(status, "value", status))


def status_view(details: dict[str, Any]) -> Any:
    """``serve.status()``'s shape (``applications[app].deployments[name]``: status, message,
    replicas by state), made from the controller's details as the plain dict it sends."""
    applications = {}
    for app_name, app in (details.get("applications") or {}).items():
        deployments = {}
        for name, deployment in (app.get("deployments") or {}).items():
            states = Counter(status_name(r.get("state")) for r in deployment.get("replicas") or ())
            status = deployment.get("status")
            deployments[name] = DeploymentView(status_name(status), deployment.get("message") or "",
                                                 dict(states))
        applications[app_name] = SimpleNamespace(deployments=deployments)
    return SimpleNamespace(applications=applications)


def _serve_status():
    """Serve's status of every deployment, from the controller's details dict. ``serve.status()``
    asks for the same dict and then builds pydantic models of it, re-serialising each deployment's
    request router class with cloudpickle on the way: 65 ms of the router's CPU a call on an idle
    host, ~0.2 s under load (py-spy), where this takes ~2 ms. Serve's client is private API (Ray
    2.60 as pinned): ``tests/unit/test_hot_load.py`` holds the dict to ``serve.status()``'s reading."""
    import ray
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return status_view({})
    # ``client.get_serve_details()``, bounded (it waits on the controller for good); a call given
    # up on is cancelled, so that a wedged controller's queue does not grow by one every read.
    details = client._controller.get_serve_instance_details.remote()
    try:
        return status_view(ray.get(details, timeout=STATUS_TIMEOUT_S))
    except ray.exceptions.GetTimeoutError:
        ray.cancel(details)
        raise


def _deployments_of(status: Any, locations: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """Serve's status of each model's deployment, by model id (absent: not deployed yet)."""
    found = {}
    for model_id, (app_name, deployment) in locations.items():
        app = status.applications.get(app_name)
        if app is not None and deployment in app.deployments:
            found[model_id] = app.deployments[deployment]
    return found


def _state_of(wanted: WantedRecord, deployment: Any) -> ModelState:
    if deployment is None:  # not deployed yet (the app is still being built)
        return derive_state(wanted, {})
    replica_states = {status_name(k): n for k, n in deployment.replica_states.items()}
    status = status_name(deployment.status)
    return derive_state(wanted, replica_states, status, deployment.message)

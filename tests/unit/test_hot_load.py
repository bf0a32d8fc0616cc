"""Hot-load: the state model, the autoscaling policy (run through Serve's own policy wrapper), and
the router's state tracker. The Serve controller and the GCS KV store are replaced by in-memory
fakes here; tests/integration/test_hot_load_failover.py loads and unloads a real model."""

import asyncio
import dataclasses
import logging
import time
from types import SimpleNamespace

import pytest
from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from serve_app.config import REQUEST_TIMEOUT_S, ModelDeploymentArgs
from serve_app.regions.layout import autoscaling_config, model_app_name
from serve_app.hot_load.autoscaling import HotLoadPolicy
from serve_app.errors import APIError
from serve_app.hot_load.state import WantedRecord, derive_state
from serve_app.hot_load import tracker as model_states
from serve_app.hot_load.tracker import REQUIRED_BY, ModelStates

MODEL = "qwen-3.6-35b-a3b"
SIBLING = "qwen-3.5-27b"


# --- states ------------------------------------------------------------------------------------
LOADED_BY_API = WantedRecord("loaded", 100.0, by="key-admin")
COLD_BY_API = WantedRecord("cold", 100.0, by="key-admin")


@pytest.mark.parametrize(
    "wanted, replicas, status, expected",
    [
        (LOADED_BY_API, {"RUNNING": 1}, "HEALTHY", "loaded"),
        (LOADED_BY_API, {"RUNNING": 1, "STARTING": 2}, "UPSCALING", "loaded"),
        (LOADED_BY_API, {"STARTING": 1}, "UPDATING", "loading"),
        (LOADED_BY_API, {}, "UPDATING", "loading"),
        (LOADED_BY_API, {"STARTING": 1}, "DEPLOY_FAILED", "failed"),
        (LOADED_BY_API, {}, "UNHEALTHY", "recovering"),  # a replica failed health checks: replaced
        (LOADED_BY_API, {"STARTING": 1}, "UNHEALTHY", "recovering"),
        (LOADED_BY_API, {"RUNNING": 1, "STARTING": 1}, "UNHEALTHY", "loaded"),  # one of two died
        (COLD_BY_API, {"RUNNING": 1}, "DOWNSCALING", "unloading"),
        (COLD_BY_API, {"STOPPING": 1}, "HEALTHY", "unloading"),
        (COLD_BY_API, {}, "HEALTHY", "cold"),
        # Replicas that serve though not RUNNING: their node drains (Serve routes to them until
        # their replacement runs), an in-place option change, a controller restart finding them.
        (LOADED_BY_API, {"PENDING_MIGRATION": 1, "STARTING": 1}, "HEALTHY", "loaded"),
        (LOADED_BY_API, {"UPDATING": 1}, "UPDATING", "loaded"),
        (LOADED_BY_API, {"RECOVERING": 2}, "HEALTHY", "loaded"),
        (COLD_BY_API, {"PENDING_MIGRATION": 1}, "HEALTHY", "unloading"),
    ],
)
def test_state_follows_wanted_state_and_replicas(wanted, replicas, status, expected):
    assert derive_state(wanted, replicas, status, "msg").state == expected


def test_a_replica_updating_in_place_serves_but_is_no_replica_a_call_can_go_to_now():
    """Serve takes an UPDATING replica out of its routing for the change: the model is loaded (no
    503), but the router does not count it where it picks a replica's line or counts the others a
    resume could go to; callers see it among the running."""
    state = derive_state(LOADED_BY_API, {"UPDATING": 1, "RUNNING": 1}, "UPDATING")
    assert (state.state, state.running, state.updating) == ("loaded", 1, 1)
    assert state.to_json(now=100.0)["replicas"] == {"running": 2, "starting": 0, "stopping": 0}


def test_a_wanted_state_the_store_did_not_take_is_a_503_to_retry_not_a_500():
    fake = FakeServe()

    def unanswered(app, deployment, state, by):
        raise TimeoutError("the GCS did not answer within its deadline")

    states = ModelStates("llm", [ModelDeploymentArgs(id=MODEL)], serve_status=fake.status, read_all=fake.read_all,
                         write=unanswered)
    asyncio.run(states.refresh())
    with pytest.raises(APIError) as refused:
        asyncio.run(states.set_wanted(MODEL, "cold", "admin"))
    assert (refused.value.status, refused.value.code, refused.value.headers["Retry-After"]) == (
        503, "model_state_unavailable", "5")


def test_state_reports_progress_and_when_it_was_asked_for():
    serve_says = "Deployment 'model-x' has 1 replicas that have taken more than 30s to be scheduled."
    state = derive_state(LOADED_BY_API, {"STARTING": 1}, "UPDATING", serve_says)
    shown = state.to_json(now=112.5)
    assert shown == {
        "state": "loading",
        "replicas": {"running": 0, "starting": 1, "stopping": 0},
        "since": 100.0,
        "elapsed_s": 12.5,
        "message": "a replica is starting: waiting for a GPU, or loading the weights",
    }
    assert derive_state(LOADED_BY_API, {"STARTING": 1}, "UPDATING", "").to_json()["message"] is None
    # A state from the config (nobody asked through the API) has no start time.
    assert derive_state(WantedRecord("loaded", 5.0), {}).to_json()["since"] is None


# --- the policy, inside Serve's own wrapper -----------------------------------------------------
def _model(**overrides) -> ModelDeploymentArgs:
    return ModelDeploymentArgs.model_validate(
        {
            "id": MODEL,
            "autoscaling": {
                "min_replicas": 1,
                "max_replicas": 4,
                "target_ongoing_requests": 8,
                "upscale_delay_s": 15,
                "downscale_delay_s": 600,
            },
            **overrides,
        }
    )


class Cluster:
    """Plays the controller: calls the policy Serve builds from our config, as Serve does."""

    def __init__(self, model: ModelDeploymentArgs, wanted: dict):
        self.config = AutoscalingConfig(**autoscaling_config(model))
        self.wanted = wanted  # the fake GCS KV store
        policy = self.config.policy
        policy.serialize_policy()  # what a deploy does: import the path, pickle by value
        instance = _resolve_policy_callable(policy)
        instance._read = lambda app, deployment: wanted.get((app, deployment))
        instance.wanted_refresh_s = 0  # every tick reads the wanted state
        self.policy = _apply_autoscaling_config(instance)
        self.state: dict = {}
        # A new deployment: Serve's target starts at -1, clipped to its bounds (no initial_replicas).
        self.target = max(self.config.min_replicas, min(self.config.max_replicas, -1))
        self.running = self.target

    def tick(self, requests: float = 0, now: float | None = None, line_calls: dict | None = None) -> int:
        """One control-loop tick: ``requests`` as the handles count them, ``line_calls`` the
        replicas' direct-line calls (their ``record_autoscaling_stats``, by replica)."""
        ctx = AutoscalingContext(
            deployment_id=None,
            deployment_name="model-x",
            app_name="llm",
            current_num_replicas=self.running,
            target_num_replicas=self.target,
            running_replicas=[],
            total_num_requests=requests,
            total_queued_requests=0,
            aggregated_metrics={"line_calls": line_calls} if line_calls else {},
            raw_metrics={},
            capacity_adjusted_min_replicas=self.config.min_replicas,
            capacity_adjusted_max_replicas=self.config.max_replicas,
            policy_state=self.state,
            last_scale_up_time=None,
            last_scale_down_time=None,
            current_time=now or time.time(),
            config=self.config,
        )
        decision, self.state = self.policy(ctx)
        self.target = max(self.config.min_replicas, min(self.config.max_replicas, decision))
        self.running = self.target  # replicas start and stop at once here
        return self.target


def test_config_serve_accepts_starts_loaded_or_cold():
    """Serve's own initial_replicas stays unset (it would reset the target on every config
    change): the policy starts a loaded model, and a cold one stays at Serve's floor of 0."""
    loaded = Cluster(_model(autoscaling={"min_replicas": 1, "initial_replicas": 2, "max_replicas": 4}), {})
    assert loaded.config.initial_replicas is None
    assert loaded.tick() == 2  # the first tick of a deploy: straight to initial_replicas
    cold = Cluster(_model(initial_state="cold"), {})
    assert (cold.config.min_replicas, cold.config.max_replicas) == (0, 4)
    assert cold.tick() == 0


def test_a_change_of_the_model_deployments_config_keeps_its_replicas():
    """Serve re-registers a deployment whose config changed (any change: a queue bound, the
    health check period) and, were initial_replicas set, would reset its target to it: a model
    loaded through the API, or scaled out, would lose its replicas (Ray 2.60,
    ``_private/autoscaling_state.py``, ``register``). Run through Serve's own code here."""
    from ray.serve._private.autoscaling_state import DeploymentAutoscalingState
    from ray.serve._private.common import DeploymentID
    from ray.serve._private.config import DeploymentConfig, ReplicaConfig
    from ray.serve._private.deployment_info import DeploymentInfo

    def info(model: ModelDeploymentArgs) -> DeploymentInfo:
        config = DeploymentConfig(autoscaling_config=autoscaling_config(model), max_queued_requests=model.max_queued_requests)
        return DeploymentInfo(config, ReplicaConfig.create(lambda: None), start_time_ms=0, deployer_job_id="job", version="v")

    scaled_out = 3  # the API loaded it, or it autoscaled: the target Serve holds now
    state = DeploymentAutoscalingState(DeploymentID("model-x", "llm-x"))
    state.register(info(_model(initial_state="cold")), scaled_out)
    assert state.register(info(_model(initial_state="cold", max_queued_requests=65)), scaled_out) == scaled_out
    state.register(info(_model()), scaled_out)
    assert state.register(info(_model(health_check_period_s=3)), scaled_out) == scaled_out


# What Serve 2.60's defaults make it: a record interval (look_back_period_s 30 x 0.2), a push
# interval (10 s) and a second for the push.
REPORT_LAG_S = 30 * 0.2 + 10 + 1


def test_a_load_goes_straight_to_the_floor_and_an_unload_straight_to_zero():
    wanted = {}
    cluster = Cluster(_model(initial_state="cold"), wanted)
    assert cluster.tick() == 0
    assert cluster.tick(requests=0) == 0  # cold stays cold

    wanted[("llm", "model-x")] = WantedRecord("loaded", time.time(), "admin")
    assert cluster.tick() == 1  # no upscale delay for a load

    cluster.running = cluster.target = 3  # busy: autoscaled out
    asked = time.time()
    wanted[("llm", "model-x")] = WantedRecord("cold", asked, "admin")
    late = asked + REPORT_LAG_S + 0.1  # the handles' reports from before the unload are in
    assert cluster.tick(requests=0, now=late) == 1  # Serve steps down to one first...
    assert cluster.tick(now=late + 0.1) == 0  # ...and to zero on the next tick, not after downscale_delay_s


def test_an_unload_waits_for_the_handles_reports_of_what_ran_before_it():
    """The controller hears of a request up to a record interval plus a push interval after it
    ran: zero replicas before then, and a report arriving late would restart the model (CI)."""
    wanted = {("llm", "model-x"): WantedRecord("cold", 1000.0, "admin")}
    cluster = Cluster(_model(), wanted)
    cluster.running = cluster.target = 1
    assert cluster.tick(requests=0, now=1001) == 1  # nothing reported yet: not yet known idle
    assert cluster.tick(requests=0, now=1000 + REPORT_LAG_S - 0.5) == 1
    assert cluster.tick(requests=0.2, now=1000 + REPORT_LAG_S - 0.1) == 1  # a late report: draining
    assert cluster.tick(requests=0, now=1000 + REPORT_LAG_S + 1) == 1  # and its look-back window
    look_back = cluster.config.look_back_period_s
    assert cluster.tick(requests=0, now=1000 + REPORT_LAG_S + look_back) == 0


def test_an_unload_waits_for_in_flight_requests_but_not_forever():
    """Zero replicas with a request in flight would make Serve start a replica for it at once."""
    wanted = {("llm", "model-x"): WantedRecord("cold", 1000.0, "admin")}
    cluster = Cluster(_model(graceful_shutdown_timeout_s=120), wanted)
    cluster.running = cluster.target = 2
    assert cluster.tick(requests=3, now=1001) == 2  # draining
    assert cluster.tick(requests=1, now=1060) == 2
    look_back = cluster.config.look_back_period_s
    assert cluster.tick(requests=0, now=1061) == 2  # idle, but the last request is in the metrics' window
    assert cluster.tick(requests=0, now=1060 + look_back + 1) == 1  # drained: down (Serve's 1-then-0 steps)
    assert cluster.tick(requests=0, now=1060 + look_back + 1.1) == 0
    cluster.running = cluster.target = 1
    assert cluster.tick(requests=1, now=1000 + REQUEST_TIMEOUT_S + 1) == 0  # a request stuck longer than any may last


def test_an_unload_right_after_traffic_does_not_start_the_replica_it_just_stopped():
    """Once the last replica is gone, Serve reads what the routers' handles report over the
    look-back window; a request that ended in that window reads as in flight, and Serve's
    cold-start fast path (which runs before any policy) starts a replica at once (seen in CI). So
    the last replica stops only once that window holds no request."""
    wanted = {("llm", "model-x"): WantedRecord("cold", 1000.0, "admin")}
    cluster = Cluster(_model(), wanted)
    cluster.running = cluster.target = 1
    look_back = cluster.config.look_back_period_s
    assert cluster.tick(requests=1, now=1000.5) == 1  # the last request of a burst
    assert cluster.tick(requests=0, now=1001) == 1  # the replicas say idle: still in the window
    # Were it zero now, the handles' window (still holding that request) would bring it back:
    cluster.running = cluster.target = 0
    assert cluster.tick(requests=0.09, now=1002) == 1  # Serve's fast path, not ours: what must not happen
    cluster.running = cluster.target = 1
    assert cluster.tick(requests=0, now=1000.5 + look_back + 0.5) == 0  # the window is quiet: zero
    assert cluster.tick(requests=0, now=1000.5 + look_back + 1) == 0  # and it stays there


def test_while_loaded_it_autoscales_with_the_regions_delays():
    cluster = Cluster(_model(), {})
    start = 1000.0
    assert cluster.tick(requests=0, now=start) == 1
    assert cluster.tick(requests=30, now=start + 1) == 1  # wants 4, waits upscale_delay_s (15)
    assert cluster.tick(requests=30, now=start + 10) == 1
    assert cluster.tick(requests=30, now=start + 16) == 4
    assert cluster.tick(requests=0, now=start + 20) == 4  # idle: waits downscale_delay_s (600)
    assert cluster.tick(requests=0, now=start + 500) == 4
    assert cluster.tick(requests=0, now=start + 621) == 1  # never below min_replicas while loaded
    assert cluster.tick(requests=0, now=start + 2000) == 1


def test_calls_on_the_replicas_direct_lines_count_as_requests_for_scaling_and_an_unloads_wait():
    """No handle counts a direct-line call (wire/line.py): the replicas report them, and the
    policy adds them to what the handles counted."""
    cluster = Cluster(_model(), {})
    start = 1000.0
    assert cluster.tick(now=start) == 1
    assert cluster.tick(requests=2, line_calls={"r1": 28.0}, now=start + 1) == 1  # wants 4: waits
    assert cluster.tick(requests=2, line_calls={"r1": 28.0}, now=start + 16) == 4
    handles_only = Cluster(_model(), {})
    handles_only.tick(now=start)
    handles_only.tick(requests=2, now=start + 1)
    assert handles_only.tick(requests=2, now=start + 16) == 1  # the same load, the line calls unseen
    wanted = {}
    unloading = Cluster(_model(), wanted)
    unloading.tick(now=start)
    wanted[("llm", "model-x")] = WantedRecord("cold", start + 100)
    # Long after the handles' reports could lag, a line call still under way holds the replica.
    assert unloading.tick(line_calls={"r1": 1.0}, now=start + 150) == 1
    assert unloading.tick(now=start + 250) == 0


def test_a_config_turned_cold_drains_as_an_unload_asked_now_does():
    """A model no admin ever set, whose region file turns it from loaded to cold: its wanted state
    is the config's as of the policy's build (Serve builds one per config change), so the unload
    waits for its requests and the handles' reports; dated 1970 it went to zero at once, and a
    late report made Serve's fast path start the replica it had just stopped."""
    built = time.time()
    cluster = Cluster(_model(initial_state="cold"), {})
    cluster.running = cluster.target = 2  # it was loaded and serving under the previous config
    assert cluster.tick(requests=1, now=built + 1) == 2  # a request in flight: draining
    assert cluster.tick(requests=0, now=built + 2) == 2  # the handles' reports may still come
    drained = built + REPORT_LAG_S + cluster.config.look_back_period_s + 1
    assert cluster.tick(requests=0, now=drained) == 1  # Serve steps down to one first...
    assert cluster.tick(requests=0, now=drained + 0.1) == 0  # ...then to zero


def test_a_policy_that_raises_holds_its_target_and_says_so_once_a_minute(caplog):
    """Serve 2.60 updates every application in one loop without a guard: a policy that raised
    stalled every later application's autoscaling, and deploys, on every pass."""
    cluster = Cluster(_model(), {("llm", "model-x"): WantedRecord("loaded", 1.0, "admin")})
    cluster.running = cluster.target = 2
    cluster.state = {"direction": "down", "since": 5.0}

    def broken(ctx):
        raise AttributeError("a field a Serve upgrade renamed")

    cluster.policy.__wrapped__._decide = broken  # the instance Serve's wrapper calls
    with caplog.at_level(logging.ERROR, logger="ray.serve.serve_app.hot_load.autoscaling"):
        assert cluster.tick() == 2 and (cluster.state["direction"], cluster.state["since"]) == ("down", 5.0)
        assert cluster.tick() == 2
    assert sum("hot-load policy of llm/model-x failed" in r.getMessage() for r in caplog.records) == 1


def test_a_kv_outage_keeps_the_last_known_state():
    policy = HotLoadPolicy(1, "cold", 0, 0)
    policy.wanted_refresh_s = 0
    policy._read = lambda app, deployment: WantedRecord("loaded", 1.0, "admin")
    ctx = SimpleNamespace(app_name="llm", deployment_name="d")
    assert policy._wanted_record(ctx).state == "loaded"

    def broken(app, deployment):
        raise ConnectionError("GCS unavailable")

    policy._read = broken
    assert policy._wanted_record(ctx).state == "loaded"


def test_a_policy_serve_rebuilt_changes_nothing_until_its_first_read_answers():
    """Serve builds a new policy on every change of the deployment's config and on a controller
    restart: a failed first read must not take the config's initial_state (cold here) for the
    state of a model an admin loaded, which scaled a busy model from 3 replicas to 0."""
    wanted = {("llm", "model-x"): WantedRecord("loaded", time.time() - 3600, "admin")}
    cluster = Cluster(_model(initial_state="cold"), wanted)
    cluster.running = cluster.target = 3
    reads = []

    def flaky(app, deployment):
        reads.append(app)
        if len(reads) <= 2:
            raise ConnectionError("GCS unavailable")
        return wanted.get((app, deployment))

    cluster.policy.__wrapped__._read = flaky
    now = time.time()
    assert [cluster.tick(requests=20, now=now + i) for i in range(4)] == [3, 3, 3, 3]
    assert len(reads) == 4


def test_a_wanted_state_that_cannot_be_read_is_logged_once_a_minute_while_the_policy_holds(caplog):
    cluster = Cluster(_model(initial_state="cold"), {})
    cluster.running = cluster.target = 2

    def broken(app, deployment):
        raise KeyError("since")  # a record no read will ever parse

    cluster.policy.__wrapped__._read = broken
    caplog.set_level(logging.WARNING)
    assert [cluster.tick(requests=5) for _ in range(3)] == [2, 2, 2]
    said = [r.getMessage() for r in caplog.records if "wanted state cannot be read" in r.getMessage()]
    assert len(said) == 1 and "holding the current target" in said[0] and "model-x" in said[0]


# --- the router's tracker -----------------------------------------------------------------------
class FakeServe:
    def __init__(self):
        self.replicas = {"model-" + MODEL: {"RUNNING": 1}, "model-" + SIBLING: {}}
        self.statuses: dict = {}  # deployment → Serve's status, HEALTHY unless set
        self.messages: dict = {}  # deployment → Serve's message, "" unless set
        self.kv: dict = {}

    def status(self):
        """As ``serve.status()`` says it: each model's deployment in an application of its own."""
        applications = {
            model_app_name("llm", name.removeprefix("model-")): SimpleNamespace(deployments={
                name: SimpleNamespace(
                    replica_states=counts, status=self.statuses.get(name, "HEALTHY"), message=self.messages.get(name, "")
                )
            })
            for name, counts in self.replicas.items()
        }
        return SimpleNamespace(applications=applications)

    def read(self, app, deployment):
        return self.kv.get((app, deployment))

    async def read_all(self, locations):
        """``state.read_wanted_all`` on this fake's store: those never set left out."""
        return {location: self.kv[location] for location in locations if location in self.kv}

    def write(self, app, deployment, state, by):
        self.kv[(app, deployment)] = record = WantedRecord(state, time.time(), by)
        return record


def _states(fake: FakeServe) -> ModelStates:
    models = [ModelDeploymentArgs(id=MODEL), ModelDeploymentArgs(id=SIBLING, initial_state="cold")]
    return ModelStates("llm", models, serve_status=fake.status, read_all=fake.read_all, write=fake.write)


def test_router_serves_only_loaded_models_and_says_why_not():
    fake = FakeServe()
    states = _states(fake)
    asyncio.run(states.refresh())
    states.require_serving(MODEL, "yul-02")
    with pytest.raises(APIError) as cold:
        states.require_serving(SIBLING, "yul-02")
    assert (cold.value.status, cold.value.code) == (503, "model_cold")
    assert int(cold.value.headers["Retry-After"]) > 0
    assert "POST /v1/models/load" in cold.value.message


def test_a_model_application_being_rebuilt_keeps_serving_from_its_last_status(monkeypatch):
    """A redeploy of a model's application (new engine flag, new weights) rebuilds it: for a few
    seconds Serve lists no deployment in it while the old replica still serves. The model stays
    loaded meanwhile (it was a 503 model_loading per request); absent past the grace, it is not."""
    from serve_app.hot_load import tracker

    clock = [1000.0]
    monkeypatch.setattr(tracker.time, "monotonic", lambda: clock[0])
    fake = FakeServe()
    states = _states(fake)
    asyncio.run(states.refresh())
    rebuilt = fake.status

    def rebuilding():
        status = rebuilt()
        status.applications[model_app_name("llm", MODEL)] = SimpleNamespace(deployments={})
        return status

    states._serve_status = rebuilding
    asyncio.run(states.refresh())
    states.require_serving(MODEL, "yul-02")  # still loaded: no 503
    clock[0] += tracker.REBUILD_GRACE_S - 1
    asyncio.run(states.refresh())
    states.require_serving(MODEL, "yul-02")
    clock[0] += 2  # gone for longer than any rebuild
    asyncio.run(states.refresh())
    with pytest.raises(APIError) as gone:
        states.require_serving(MODEL, "yul-02")
    assert gone.value.code == "model_loading"
    states._serve_status = rebuilt  # listed again; a later rebuild gets its own grace
    asyncio.run(states.refresh())
    states.require_serving(MODEL, "yul-02")
    states._serve_status = rebuilding
    asyncio.run(states.refresh())
    states.require_serving(MODEL, "yul-02")


def test_a_replica_being_replaced_is_recovering_with_a_short_retry_not_failed():
    fake = FakeServe()
    states = _states(fake)
    fake.replicas["model-" + MODEL] = {"STARTING": 1}  # its engine died; Serve starts another
    fake.statuses["model-" + MODEL] = "UNHEALTHY"
    asyncio.run(states.refresh())
    with pytest.raises(APIError) as recovering:
        states.require_serving(MODEL, "yul-02")
    assert (recovering.value.status, recovering.value.code) == (503, "model_recovering")
    assert int(recovering.value.headers["Retry-After"]) <= 5
    fake.statuses["model-" + MODEL] = "DEPLOY_FAILED"  # Serve gave up: that one is failed
    asyncio.run(states.refresh())
    with pytest.raises(APIError) as failed:
        states.require_serving(MODEL, "yul-02")
    assert failed.value.code == "model_failed"


def test_serves_own_words_about_a_failed_deployment_reach_the_log_never_a_caller(caplog):
    """A replica constructor that failed: Serve's message carries its traceback (the image's
    paths, the exception's text). GET /v1/models/{id} shows the state in our words."""
    fake = FakeServe()
    states = _states(fake)
    deployment = "model-" + MODEL
    fake.replicas[deployment] = {}
    fake.statuses[deployment] = "DEPLOY_FAILED"
    fake.messages[deployment] = (
        "The deployment failed to start 3 times in a row. Error:\nTraceback (most recent call last):\n"
        '  File "/opt/serve_app/.venv/lib/python3.11/site-packages/vllm/engine/arg_utils.py", line 1, in x\n'
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 178 GiB total)"
    )
    caplog.set_level(logging.WARNING)
    asyncio.run(states.refresh())
    asyncio.run(states.refresh())
    shown = states.get(MODEL).to_json()
    assert shown["state"] == "failed"
    assert shown["message"] == "replicas failed to start; the region's operators have the details in its logs"
    for internal in ("Traceback", "/opt/", "OutOfMemoryError", "GiB"):
        assert internal not in str(shown)
    logged = [r.getMessage() for r in caplog.records if "OutOfMemoryError" in r.getMessage()]
    assert len(logged) == 1 and deployment in logged[0]  # once, not every refresh


def test_load_and_unload_write_the_wanted_state_and_update_the_view():
    fake = FakeServe()
    states = _states(fake)

    async def scenario():
        await states.refresh()
        loading = await states.set_wanted(SIBLING, "loaded", by="key-admin")
        assert loading.state == "loading"
        assert fake.kv[(model_app_name("llm", SIBLING), "model-" + SIBLING)].by == "key-admin"
        with pytest.raises(APIError) as err:
            states.require_serving(SIBLING, "r")
        assert err.value.code == "model_loading"

        fake.replicas["model-" + SIBLING] = {"RUNNING": 1}
        await states.refresh()
        assert states.get(SIBLING).state == "loaded"

        assert (await states.set_wanted(MODEL, "cold", by="key-admin")).state == "unloading"
        fake.replicas["model-" + MODEL] = {}
        await states.refresh()
        assert states.get(MODEL).state == "cold"

    asyncio.run(scenario())


def test_another_routers_change_is_seen_on_refresh():
    fake = FakeServe()
    states = _states(fake)
    asyncio.run(states.refresh())
    fake.write(model_app_name("llm", MODEL), "model-" + MODEL, "cold", "elsewhere")
    asyncio.run(states.refresh())
    assert states.get(MODEL).wanted == "cold"


def test_serve_status_is_read_only_when_it_may_have_changed():
    """serve.status() is costly in the router's process: a steady, all-loaded view skips it."""
    fake = FakeServe()
    calls = []
    models = [ModelDeploymentArgs(id=MODEL)]
    states = ModelStates(
        "llm", models, serve_status=lambda: calls.append(1) or fake.status(), read_all=fake.read_all, write=fake.write
    )
    asyncio.run(states.refresh())
    assert states.get(MODEL).state == "loaded" and len(calls) == 1
    assert not states._status_may_have_changed(asyncio.run(states._read_all()))  # steady: the KV read only
    fake.write(model_app_name("llm", MODEL), "model-" + MODEL, "cold", "elsewhere")
    assert states._status_may_have_changed(asyncio.run(states._read_all()))  # an unload elsewhere: read it
    states._status_read_at -= model_states.STATUS_MAX_AGE_S + 1
    fake.kv.clear()
    assert states._status_may_have_changed(asyncio.run(states._read_all()))  # too old: read it

    asyncio.run(states.ensure_fresh(max_status_age_s=1.0))  # /health wants a recent view
    assert len(calls) == 2
    assert not states._status_may_have_changed(asyncio.run(states._read_all()))
    states.suspect()  # a replica said its engine died: follow Serve closely for a while
    assert states._status_may_have_changed(asyncio.run(states._read_all()))


def test_a_model_left_cold_costs_no_status_read_once_its_replicas_are_gone():
    """An unloaded model is a steady state: it read Serve's status every second (a thread here, a
    checkpoint read and every application's validation in the controller) for as long as it
    stayed cold. Its replicas stopping, and a change of its wanted state, are still followed."""
    fake = FakeServe()  # MODEL loaded and running, SIBLING cold with no replica
    states = _states(fake)
    asyncio.run(states.refresh())
    assert (states.get(MODEL).state, states.get(SIBLING).state) == ("loaded", "cold")
    assert not states._status_may_have_changed(asyncio.run(states._read_all()))
    fake.replicas["model-" + SIBLING] = {"STOPPING": 1}  # an unload under way
    asyncio.run(states.refresh())
    assert states.get(SIBLING).state == "unloading" and states._status_may_have_changed(asyncio.run(states._read_all()))
    fake.write(model_app_name("llm", SIBLING), "model-" + SIBLING, "loaded", "admin")
    assert states._status_may_have_changed(asyncio.run(states._read_all()))


def test_a_refresh_that_read_before_another_does_not_overwrite_its_newer_view():
    """Refreshes overlap (the loop's and an admin's unload): the one that started first may end
    last, and its older read must not bring "loaded" back over the unload."""
    fake = FakeServe()
    key = (model_app_name("llm", MODEL), "model-" + MODEL)
    released = None

    async def read_all(locations):
        found = await fake.read_all(locations)
        if read_all.slow:  # the first refresh's read: answered before the unload, returned after it
            read_all.slow = False
            await released.wait()
        return found

    read_all.slow = False
    models = [ModelDeploymentArgs(id=MODEL)]
    states = ModelStates("llm", models, serve_status=fake.status, read_all=read_all, write=fake.write)

    async def scenario():
        nonlocal released
        released = asyncio.Event()
        await states.refresh()
        read_all.slow = True
        older = asyncio.ensure_future(states.refresh())  # reads "loaded", then waits
        await asyncio.sleep(0)
        fake.kv[key] = WantedRecord("cold", time.time(), "admin")  # the unload, and its own refresh
        fake.replicas["model-" + MODEL] = {}
        await states.refresh()
        assert states.get(MODEL).state == "cold"
        released.set()
        await older

    asyncio.run(scenario())
    assert states.get(MODEL).state == "cold"


def test_in_flight_says_busy_when_every_slot_is_taken_and_shedding_when_the_queue_is_too():
    from serve_app.router.in_flight import InFlight

    in_flight = InFlight([ModelDeploymentArgs(id=MODEL, max_ongoing_requests=2, max_queued_requests=1)])
    releases = [in_flight.begin(MODEL) for _ in range(2)]
    assert in_flight.load(MODEL, running=1) == {"in_flight": 2, "slots": 2, "busy": True, "shedding": False}
    assert in_flight.load(MODEL, running=2)["busy"] is False  # a second replica: room again
    releases.append(in_flight.begin(MODEL))
    assert in_flight.load(MODEL, running=1)["shedding"] is True
    for release in releases + releases:  # releasing twice uncounts once
        release()
    assert in_flight.load(MODEL, running=1) == {"in_flight": 0, "slots": 2, "busy": False, "shedding": False}
    assert in_flight.load(MODEL, running=0)["busy"] is False  # no replica: down, not busy


def test_health_answers_from_the_last_view_while_serve_is_slow_to_say():
    """A refresh that takes long (the controller busy with a failed replica) does not hold
    /health: it gets the last view after ``wait_s``, and the refresh still lands later."""
    fake = FakeServe()
    slow = {"on": False}

    def status():
        if slow["on"]:
            time.sleep(0.5)
        return fake.status()

    states = ModelStates("llm", [ModelDeploymentArgs(id=MODEL)], serve_status=status, read_all=fake.read_all,
                         write=fake.write)

    async def scenario():
        await states.ensure_fresh()
        slow["on"] = True
        fake.replicas["model-" + MODEL] = {}
        fake.statuses["model-" + MODEL] = "UNHEALTHY"
        states._status_read_at -= 10
        await states.ensure_fresh(max_status_age_s=2.0, wait_s=0.05)
        assert not states._pending.done()  # it answered without waiting for Serve
        assert states.get(MODEL).state == "loaded"  # the last view
        await asyncio.wait_for(asyncio.shield(states._pending), 10)  # however slow the host
        assert states.get(MODEL).state == "recovering"  # the refresh it started has landed
        states.stop()

    asyncio.run(scenario())


def test_each_model_is_followed_in_its_own_application():
    """Serve's status lists each model's deployment under its own application; a deployment of
    the same name in another application (another region on the host) is someone else's."""
    fake = FakeServe()
    states = _states(fake)
    status = fake.status()
    status.applications["peer-" + MODEL] = SimpleNamespace(deployments={
        "model-" + MODEL: SimpleNamespace(replica_states={}, status="HEALTHY", message="")
    })
    del status.applications[model_app_name("llm", SIBLING)]  # not deployed yet
    states._serve_status = lambda: status
    asyncio.run(states.refresh())
    assert states.get(MODEL).state == "loaded"  # ours runs; the peer's cold one is not ours
    assert states.get(SIBLING).state == "cold"  # its initial state until Serve reports it
    assert states.locations[SIBLING] == ("llm-" + SIBLING, "model-" + SIBLING)


def test_models_joining_and_leaving_the_settings_are_followed_in_place():
    fake = FakeServe()
    states = ModelStates("llm", [ModelDeploymentArgs(id=MODEL)], serve_status=fake.status, read_all=fake.read_all,
                         write=fake.write)

    async def scenario():
        await states.refresh()
        states.set_models([ModelDeploymentArgs(id=MODEL), ModelDeploymentArgs(id=SIBLING)])
        assert states.get(SIBLING).state == "loading"  # wanted loaded, no replica seen yet
        assert states._status_may_have_changed(await states._read_all())  # a model joined: ask Serve
        fake.replicas["model-" + SIBLING] = {"RUNNING": 1}
        await states.refresh()
        assert states.get(SIBLING).state == "loaded"
        await states.set_wanted(SIBLING, "cold", by="key-admin")
        assert (model_app_name("llm", SIBLING), "model-" + SIBLING) in fake.kv
        states.set_models([ModelDeploymentArgs(id=SIBLING)])  # MODEL left the settings
        fake.replicas["model-" + MODEL] = {}
        await states.refresh()
        assert states.get(MODEL).state == "loaded"  # its last state, for requests on their way
        assert set(states.locations) == {SIBLING}

    asyncio.run(scenario())


def test_a_deploy_that_marks_a_cold_model_required_loads_it(caplog):
    """An admin unloaded the sibling; a later deploy marks it the region's required model. Left
    cold, /health would stay 503 (out of global routing) until someone loaded it by hand: the
    refresh that reads the new settings writes it back to loaded, once, and says so. An optional
    model an admin unloaded stays unloaded."""
    fake = FakeServe()
    states = ModelStates(
        "llm", [ModelDeploymentArgs(id=MODEL), ModelDeploymentArgs(id=SIBLING)],
        serve_status=fake.status, read_all=fake.read_all, write=fake.write,
    )
    sibling = (model_app_name("llm", SIBLING), "model-" + SIBLING)

    async def scenario():
        await states.refresh()
        await states.set_wanted(SIBLING, "cold", by="key-admin")
        await states.refresh()
        assert states.get(SIBLING).state == "cold" and fake.kv[sibling].by == "key-admin"
        caplog.set_level(logging.WARNING)
        states.set_models([ModelDeploymentArgs(id=MODEL), ModelDeploymentArgs(id=SIBLING, region_health="required")])
        await states.refresh()
        assert fake.kv[sibling].state == "loaded" and fake.kv[sibling].by == REQUIRED_BY
        assert states.get(SIBLING).state == "loading" and states.get(SIBLING).wanted == "loaded"
        written = fake.kv[sibling]
        await states.refresh()
        assert fake.kv[sibling] is written  # loaded now: not written again
        fake.replicas["model-" + SIBLING] = {"RUNNING": 1}
        await states.refresh()
        assert states.get(SIBLING).state == "loaded"

    asyncio.run(scenario())
    logged = [r.getMessage() for r in caplog.records if "required" in r.getMessage()]
    assert len(logged) == 1 and SIBLING in logged[0] and "key-admin" in logged[0]


def test_a_required_model_found_cold_when_a_router_starts_is_loaded_by_its_background_refresh(caplog):
    """The record predates this router (an unload, then a restart with the model required): the
    every-second refresh, which reads the wanted states itself, writes it back."""
    fake = FakeServe()
    fake.write(model_app_name("llm", MODEL), "model-" + MODEL, "cold", "key-admin")
    models = [ModelDeploymentArgs(id=MODEL, region_health="required"),
              ModelDeploymentArgs(id=SIBLING, initial_state="cold")]
    fake.write(model_app_name("llm", SIBLING), "model-" + SIBLING, "cold", "key-admin")
    time.sleep(0.01)
    states = ModelStates("llm", models, serve_status=fake.status, read_all=fake.read_all, write=fake.write)
    caplog.set_level(logging.WARNING)
    asyncio.run(states.refresh(wanted=asyncio.run(states._read_all())))
    record = fake.kv[(model_app_name("llm", MODEL), "model-" + MODEL)]
    assert (record.state, record.by) == ("loaded", REQUIRED_BY) and states.get(MODEL).state == "loaded"
    assert states.get(SIBLING).state == "cold"  # optional: the admin's unload stands
    assert sum("loaded it" in r.getMessage() and MODEL in r.getMessage() for r in caplog.records) == 1


def test_an_unload_through_a_router_on_other_settings_after_this_one_required_the_model_is_left_alone(caplog):
    """An operator made the model optional, deployed and unloaded it while this router (still on
    the settings that require it) drains: undoing that unload would fight the operator. Left cold,
    said once."""
    fake = FakeServe()
    states = ModelStates("llm", [ModelDeploymentArgs(id=MODEL, region_health="required")],
                         serve_status=fake.status, read_all=fake.read_all, write=fake.write)
    asyncio.run(states.refresh())
    time.sleep(0.01)
    fake.write(model_app_name("llm", MODEL), "model-" + MODEL, "cold", "key-admin")
    caplog.set_level(logging.WARNING)
    asyncio.run(states.refresh())
    asyncio.run(states.refresh())
    assert fake.kv[(model_app_name("llm", MODEL), "model-" + MODEL)].by == "key-admin"
    assert states.get(MODEL).wanted == "cold"
    assert sum("left cold" in r.getMessage() for r in caplog.records) == 1


def test_a_failed_write_back_leaves_the_view_refreshing_and_is_said_once(caplog):
    fake = FakeServe()
    fake.write(model_app_name("llm", SIBLING), "model-" + SIBLING, "cold", "key-admin")
    time.sleep(0.01)

    def broken(app, deployment, state, by):
        raise ConnectionError("GCS unavailable")

    models = [ModelDeploymentArgs(id=MODEL), ModelDeploymentArgs(id=SIBLING, region_health="required")]
    states = ModelStates("llm", models, serve_status=fake.status, read_all=fake.read_all, write=broken)
    fake.replicas["model-" + MODEL] = {"RUNNING": 1}
    caplog.set_level(logging.WARNING)
    asyncio.run(states.refresh())
    fake.statuses["model-" + MODEL] = "UNHEALTHY"
    fake.replicas["model-" + MODEL] = {}
    asyncio.run(states.refresh())
    assert states.get(MODEL).state == "recovering"  # the rest of the view still follows Serve
    assert states.get(SIBLING).state == "cold"  # as read, until a write succeeds
    assert sum("could not load" in r.getMessage() for r in caplog.records) == 1
    states._write = fake.write
    asyncio.run(states.refresh())
    assert states.get(SIBLING).wanted == "loaded"


def test_the_status_read_from_the_controllers_details_is_what_serve_status_says():
    """``tracker._serve_status`` reads the controller's details dict instead of ``serve.status()``
    (which builds pydantic models of it, cloudpickling each request router class): both readings
    of one details dict must agree on what the tracker uses."""
    from ray.serve._private.common import DeploymentStatus, DeploymentStatusTrigger, ReplicaState
    from ray.serve.schema import ServeInstanceDetails

    from serve_app.hot_load.tracker import status_view

    def replica(n, state):
        return {"replica_id": f"r{n}", "state": state, "start_time_s": 1.0}

    def deployment(name, status, message, replicas):
        return {"name": name, "status": status, "status_trigger": DeploymentStatusTrigger.UPSCALE_COMPLETED,
                "message": message, "deployment_config": {"name": name}, "target_num_replicas": len(replicas),
                "required_resources": {}, "replicas": replicas}

    details = {"proxies": {}, "applications": {"llm-m": {
        "name": "llm-m", "route_prefix": None, "docs_path": None, "status": "RUNNING", "message": "",
        "last_deployed_time_s": 1.0, "source": "declarative", "external_scaler_enabled": False,
        "deployments": {
            "model-m": deployment("model-m", DeploymentStatus.UPDATING, "replacing a replica", [
                replica(1, ReplicaState.RUNNING), replica(2, ReplicaState.STARTING), replica(3, ReplicaState.RUNNING)]),
            "ModelEntry": deployment("ModelEntry", DeploymentStatus.HEALTHY, "", []),
        }}}}
    theirs = ServeInstanceDetails(**details)._get_status()
    ours = status_view(details)
    for name in ("model-m", "ModelEntry"):
        serve_says, we_read = theirs.applications["llm-m"].deployments[name], ours.applications["llm-m"].deployments[name]
        assert we_read.status == str(getattr(serve_says.status, "value", serve_says.status))
        assert we_read.message == serve_says.message
        assert we_read.replica_states == {str(getattr(k, "value", k)): n for k, n in serve_says.replica_states.items()}
    assert ours.applications["llm-m"].deployments["model-m"].replica_states == {"RUNNING": 2, "STARTING": 1}
    assert status_view({}).applications == {}


def test_a_first_view_that_cannot_be_read_is_a_503_the_router_can_fail_over_not_a_500():
    fake = FakeServe()
    away = {"on": True}

    async def read_all(locations):
        if away["on"]:
            raise TimeoutError("the GCS did not answer")
        return await fake.read_all(locations)

    states = ModelStates("llm", [ModelDeploymentArgs(id=MODEL)], serve_status=fake.status, read_all=read_all,
                         write=fake.write)

    async def scenario():
        with pytest.raises(APIError) as refused:
            await states.ensure_fresh()
        assert (refused.value.status, refused.value.code) == (503, "model_states_unavailable")
        assert refused.value.headers["Retry-After"] == "5"
        away["on"] = False
        await states.ensure_fresh()  # the next request reads it
        assert states.get(MODEL).state == "loaded"
        states.stop()

    asyncio.run(scenario())



def test_requests_before_the_first_view_share_one_read_and_all_get_the_503():
    """While the controller is slow to answer, each request arriving before the first view waits
    on the same read (one thread, not one each) and each gets the 503 when it fails."""
    fake = FakeServe()
    calls = []

    def status():
        calls.append(1)
        time.sleep(0.2)
        raise TimeoutError("Serve's controller did not answer")

    states = ModelStates("llm", [ModelDeploymentArgs(id=MODEL)], serve_status=status, read_all=fake.read_all,
                         write=fake.write)

    async def scenario():
        outcomes = await asyncio.gather(*(states.ensure_fresh() for _ in range(5)), return_exceptions=True)
        assert [(o.status, o.code) for o in outcomes] == [(503, "model_states_unavailable")] * 5
        assert len(calls) == 1
        states.stop()

    asyncio.run(scenario())


def test_a_controller_that_never_answers_fails_the_status_read_instead_of_holding_it(monkeypatch):
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.serve import context

    details = SimpleNamespace(remote=lambda: "details-ref")
    client = SimpleNamespace(_controller=SimpleNamespace(get_serve_instance_details=details))
    monkeypatch.setattr(context, "_get_global_client", lambda **_: client)
    waits = []

    def get(ref, *, timeout=None):  # the controller never answers: only a bounded wait ends
        waits.append((ref, timeout))
        if timeout is None:
            raise AssertionError("waited on the controller without a bound")
        raise GetTimeoutError("Get timed out")

    monkeypatch.setattr(ray, "get", get)
    cancelled = []
    monkeypatch.setattr(ray, "cancel", cancelled.append)
    with pytest.raises(GetTimeoutError):
        model_states._serve_status()
    assert waits == [("details-ref", model_states.STATUS_TIMEOUT_S)]
    assert cancelled == ["details-ref"]  # not left queued on the wedged controller


def test_health_before_the_first_view_waits_its_bound_and_a_view_read_meanwhile_answers():
    """/health must answer at once (``wait_s``) even before the first view: a 503 while the read
    goes on, then the view once it lands; a request whose wait failed while the refresh loop's own
    read answered takes that view instead of a 503."""
    fake = FakeServe()
    gate = {"slow": True}

    def status():
        if gate["slow"]:
            time.sleep(0.3)
            raise TimeoutError("Serve's controller did not answer")
        return fake.status()

    states = ModelStates("llm", [ModelDeploymentArgs(id=MODEL)], serve_status=status, read_all=fake.read_all,
                         write=fake.write)

    async def scenario():
        started = time.monotonic()
        with pytest.raises(APIError) as refused:
            await states.ensure_fresh(max_status_age_s=2.0, wait_s=0.05)
        assert refused.value.code == "model_states_unavailable" and time.monotonic() - started < 0.25
        gate["slow"] = False
        waiting = asyncio.ensure_future(states.ensure_fresh())  # waits on the failing first read
        await asyncio.sleep(0)
        await states.refresh()  # as the refresh loop would, meanwhile
        await waiting  # no 503: a view is there
        assert states.get(MODEL).state == "loaded"
        states.stop()

    asyncio.run(scenario())

def test_a_model_added_back_starts_from_not_deployed_and_one_removed_stops_costing_status_reads():
    fake = FakeServe()
    fake.replicas["model-" + SIBLING] = {"RUNNING": 1}
    both = [ModelDeploymentArgs(id=MODEL), ModelDeploymentArgs(id=SIBLING)]
    states = ModelStates("llm", both, serve_status=fake.status, read_all=fake.read_all, write=fake.write)

    async def scenario():
        await states.refresh()
        assert states.get(SIBLING).state == "loaded"
        states.set_models(both[:1])  # the sibling leaves the settings (its application is deleted)
        states.set_models(both)  # and comes back, a new deployment with no replica yet
        assert states.get(SIBLING).state == "loading"  # not the "loaded" it left with
        states.set_models(both[:1])
        fake.replicas["model-" + SIBLING] = {}
        await states.refresh()  # the removed one is not refreshed: its last state stands
        states._status_read_at = time.monotonic()
        # Only the models served now decide whether Serve's status is read again every second.
        assert not states._status_may_have_changed(await states._read_all())
        states._states[SIBLING] = dataclasses.replace(states._states[SIBLING], state="loading")
        assert not states._status_may_have_changed(await states._read_all())

    asyncio.run(scenario())

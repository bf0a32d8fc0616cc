"""The model deployments' autoscaling policy: Serve's queue-length policy while a model is wanted
loaded, zero replicas while it is cold (``serve_app.hot_load.state``).

Serve applies its own delay logic to whatever a custom policy returns, with the deployment's
``upscale_delay_s``/``downscale_delay_s``. Those would make an unload wait ``downscale_delay_s``
(ten minutes in a region) per step, so the rendered Serve config sets them to 0 and this policy
applies the region's delays itself, to autoscaling decisions only: a load goes straight to the
floor and an unload straight to zero once the replicas' in-flight requests are done.

Why wait for them: Serve starts a replica at once for a deployment that has zero replicas and
requests in flight (a fast path that runs before any custom policy). Dropping to zero while a
request still runs would stop the replica and start a new one for that request, minutes of GPU
for nothing. Routers send nothing new to an unloading model, so the wait is bounded by the longest
running request plus the metrics' look-back window (``_draining``), and by ``drain_timeout_s`` in
any case. Serve 2.60 counts requests where the routers' handles send them, and a handle records a
sample every ``look_back_period_s`` x 0.2 and pushes its samples every 10 s: the controller learns
of a request up to ~16 s after it ran. So the last replica also stays until that lag has passed
since the unload was asked (``_reports_pending``); a request that ended just before the unload
would otherwise arrive after the replica stopped, and the fast path would start it again (seen in
CI: the replica stopped one second after the unload and was back fifteen seconds later).

Its settings (the policy's kwargs in the Serve config) are hashed into the model application's code
version by Serve 2.60 (``_private/deploy_utils.py:173-177``): changing one restarts that model's
replicas, new ones first (docs/operations.md, "What a change restarts").

Calls a router sent on a replica's direct line (``router.handle_transport: direct``,
``wire/line.py``) pass no handle, so no handle counts them: each replica reports its own
(``record_autoscaling_stats``, ``LINE_CALLS_METRIC``) and the policy adds them to Serve's count
(``_with_line_calls``), for scaling and for an unload's wait alike.

Serve runs the policy in its controller, once per control-loop pass (every
``RAY_SERVE_CONTROL_LOOP_INTERVAL_S``: 1 s as serve_app.app.IDLE_ENV sets it). The wanted state is
read from the GCS key-value store at most once a second. The policy class is pickled by value when
the config is deployed; what it imports is imported in the controller, so it stays small.
"""

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from ray.serve._private import constants as serve_constants
from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

from serve_app.hot_load.state import WantedRecord, read_wanted

# Serve's logger by the name module_logger gives, without telemetry's imports in the controller.
logger = logging.getLogger(f"ray.serve.{__name__}")
WANTED_REFRESH_S = 1.0  # the config names this class as serve_app.regions.layout.POLICY_PATH
FAILED_READ_LOG_S = 60.0  # a wanted state that cannot be read is logged this often
# A model replica's calls in flight that came on its direct line (ModelServer.record_autoscaling_stats).
LINE_CALLS_METRIC = "line_calls"


class HotLoadPolicy:
    def __init__(
        self,
        min_replicas: int,
        initial_state: str,
        upscale_delay_s: float,
        downscale_delay_s: float,
        drain_timeout_s: float = 120,
        initial_replicas: int | None = None,
        read: Callable[[str, str], WantedRecord | None] = read_wanted,
    ):
        self.min_replicas = max(1, min_replicas)  # loaded means at least one replica
        # Where a load starts (and a deploy of a loaded model): Serve's own initial_replicas
        # would also reset the target on every change of the deployment's config.
        self.initial_replicas = max(self.min_replicas, initial_replicas or 0)
        self.initial_state = initial_state
        self.upscale_delay_s = upscale_delay_s
        self.downscale_delay_s = downscale_delay_s
        self.drain_timeout_s = drain_timeout_s
        self._read = read
        # An attribute, not the module's constant at each call: the class runs as a copy pickled
        # by value, whose globals a test cannot patch.
        self.wanted_refresh_s = WANTED_REFRESH_S
        self._wanted: WantedRecord | None = None  # nothing read yet (see _wanted_record)
        self._read_at = float("-inf")
        self._said_at = float("-inf")  # when a failed read was last logged
        self._busy_at = float("-inf")  # when requests were last in flight (``_draining``)
        self._failed_at = float("-inf")  # when a failure of the policy itself was last logged
        # A wanted state nobody set through the API is the config's, as of this policy's build (a
        # config turned from loaded to cold unloads as one asked now would: draining first; since
        # 1970 it skipped both waits and Serve's fast path started the replica again).
        self._built_at = time.time()

    def __call__(self, ctx) -> tuple[int, dict[str, Any]]:
        """Serve 2.60 updates every application in one loop with no guard of its own: a policy
        that raised stalled every later application's autoscaling and deploys, every pass. A
        failure holds this deployment's target (logged once a minute)."""
        try:
            return self._decide(ctx)
        except Exception:
            now = time.monotonic()
            if now - self._failed_at >= FAILED_READ_LOG_S:
                self._failed_at = now
                logger.exception("hot-load policy of %s/%s failed; holding the current target",
                                 getattr(ctx, "app_name", "?"), getattr(ctx, "deployment_name", "?"))
            return ctx.target_num_replicas, ctx.policy_state or {}

    def _decide(self, ctx) -> tuple[int, dict[str, Any]]:
        _with_line_calls(ctx)
        wanted = self._wanted_record(ctx)
        if wanted is None:  # no read has answered since Serve built this policy: change nothing
            return ctx.target_num_replicas, {}
        now = ctx.current_time or time.time()
        if ctx.total_num_requests > 0:
            self._busy_at = now
        if wanted.state == "cold":
            unloading = ctx.current_num_replicas > 0 and now - wanted.since < self.drain_timeout_s
            if unloading and (self._draining(ctx, now) or self._reports_pending(ctx, now, wanted)):
                return ctx.target_num_replicas, {}  # unloading: let in-flight requests finish
            return 0, {}
        if ctx.current_num_replicas == 0:  # loading (or every replica died): straight up
            return max(self.initial_replicas, ctx.target_num_replicas), {}
        desired, _ = replica_queue_length_autoscaling_policy(ctx)
        return self._after_delay(max(self.min_replicas, math.ceil(desired)), ctx)

    def _draining(self, ctx, now: float) -> bool:
        """Requests in flight, or within the metrics' look-back window. Once the last replica is
        gone Serve counts what the routers' handles report over that window instead, and a request
        that ended in it would read as one in flight: Serve's cold-start fast path would start a
        replica of the model just unloaded (seen in CI: a B200 loading 35 GB for nothing)."""
        return ctx.total_num_requests > 0 or now - self._busy_at < ctx.config.look_back_period_s

    def _reports_pending(self, ctx, now: float, wanted: WantedRecord) -> bool:
        """Handles' samples of a request that ran before the unload may still be on their way:
        one record interval plus one push interval after it (and a second for the push's RPC)."""
        record_s = ctx.config.look_back_period_s * serve_constants.RAY_SERVE_AUTOSCALING_METRIC_RECORD_INTERVAL_FACTOR
        lag_s = record_s + serve_constants.RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S + 1.0
        return now - wanted.since < lag_s

    def _wanted_record(self, ctx) -> WantedRecord | None:
        """The wanted state, read at most every ``wanted_refresh_s``; a failed read keeps the last
        one. None until a read has answered: Serve builds a new policy on every change of the
        deployment's config and on a controller restart, and the config's ``initial_state`` is not
        the model's state (an admin may have loaded a model the region file says cold: taking it
        for the state on a failed first read scaled a serving model to zero)."""
        now = time.monotonic()
        if now - self._read_at >= self.wanted_refresh_s:
            self._read_at = now
            try:
                record = self._read(ctx.app_name, ctx.deployment_name)
            except Exception as err:  # a GCS hiccup: keep the last known state rather than flap
                if now - self._said_at >= FAILED_READ_LOG_S:  # a failure that lasts is said, once a minute
                    self._said_at = now
                    logger.warning(
                        "hot-load policy of %s/%s: the wanted state cannot be read (%s: %s); %s",
                        ctx.app_name, ctx.deployment_name, type(err).__name__, err,
                        "holding the current target" if self._wanted is None else "keeping the last state read",
                    )
                return self._wanted
            self._wanted = record or WantedRecord(self.initial_state, self._built_at)
        return self._wanted

    def _after_delay(self, desired: int, ctx) -> tuple[int, dict[str, Any]]:
        """Move to ``desired`` only once it has pointed the same way for the configured delay."""
        target = ctx.target_num_replicas
        if desired == target:
            return target, {}
        direction = "up" if desired > target else "down"
        now = ctx.current_time or time.time()
        state = ctx.policy_state or {}
        since = state.get("since") if state.get("direction") == direction else None
        since = now if since is None else since
        delay = self.upscale_delay_s if direction == "up" else self.downscale_delay_s
        if now - since >= delay:
            return desired, {}
        return target, {"direction": direction, "since": since}


def _with_line_calls(ctx) -> None:
    """Add the replicas' direct-line calls (each replica's mean over the look-back window, as
    Serve aggregates any replica metric) to ``ctx.total_num_requests``, which counts what the
    handles sent. ``total_num_requests`` is a cached property of Serve's context: the sum is
    cached in its place, so Serve's own policy, called with this context, reads it too."""
    per_replica = (ctx.aggregated_metrics or {}).get(LINE_CALLS_METRIC) or {}
    line_calls = sum(per_replica.values())
    if line_calls > 0:
        ctx.total_num_requests = ctx.total_num_requests + line_calls

"""A GPU worker pod's ``preStop``: drain its Ray node before Kubernetes stops the pod.

A node drain (``kubectl drain``, a managed cluster's upgrade) or any other deletion of a worker
pod gave its containers Kubernetes' default 30 s before SIGKILL, against requests that may last
``REQUEST_TIMEOUT_S`` (600 s): every stream on the node's model replicas was cut (a replica that
vanishes with its node sends no trailer, so nothing resumes them), and every client connection that
came in through the node's HAProxy, whichever replica served it.

``serve-app drain-node`` (terraform/modules/region: the GPU workers' ``preStop``, under a
termination grace period of ``TERMINATION_GRACE_S``) asks Ray's GCS to drain this node with a
deadline (what the autoscaler does before it removes a node). Serve then migrates the node's
replicas: it starts each one's replacement on another node and stops the old one once the
replacement runs, or at the latest its ``graceful_shutdown_timeout_s`` before the deadline, so
the requests it holds finish either way; its proxy stops taking connections, finishes those it
holds, and goes. The command returns once no Serve actor is left on the node (or at the
deadline), and Kubernetes then stops a node that serves nothing.

With no Serve controller in the cluster it returns at once. The state API failing while it waits
(the dashboard restarting) is reported once and waited out, for a minute at most: failing that
long, the head is gone (the whole cluster is being deleted: a rollout's old one, a region torn
down), nothing will move the replicas, and it stops waiting. A failure (Ray refusing the drain,
no Ray node here) is reported and exits non-zero: Kubernetes records a ``FailedPreStopHook``
event and stops the pod as it would have without the hook. (A node Ray has drained and found idle
stops its raylet, and the container may stop with it while the hook still runs: the same event,
after a drain that worked.)
"""

import os
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from serve_app.config.model import REQUEST_TIMEOUT_S
from serve_app.runtime.ray_env import CLUSTER_DELETION_DELAY_S

# The drain's deadline: a replica's graceful stop (REQUEST_TIMEOUT_S, its
# graceful_shutdown_timeout_s), from the latest moment Serve starts it, plus HAProxy's 30 s of
# keeping a stopping replica reachable.
DRAIN_DEADLINE_S = REQUEST_TIMEOUT_S + 30
# The pod's terminationGracePeriodSeconds: the drain and the processes' own stop after it (the
# same as the delay before a rollout deletes the old cluster: a test holds them equal).
TERMINATION_GRACE_S = CLUSTER_DELETION_DELAY_S
SERVE_NAMESPACE = "serve"  # Ray Serve's actors' namespace: replicas, proxies, HAProxy's manager
SERVE_CONTROLLER = "SERVE_CONTROLLER_ACTOR"  # Ray Serve's name for its controller actor
POLL_S = 5.0
# The state API failing this long on end: the cluster's head is gone (the whole cluster is being
# deleted: a rollout's old one, a region torn down), and nothing will move the node's replicas.
UNREADABLE_FOR_S = 60.0
# Ray's reason for a drain the node cannot refuse (an idle-termination drain is refused while the
# node runs anything).
DRAIN_REASON = "DRAIN_NODE_REASON_PREEMPTION"


def serve_actors(actors: Iterable[Mapping[str, Any]]) -> list[str]:
    """The names of Serve's actors among ``actors`` (the state API's records of a node's live ones)."""
    return sorted(str(a.get("class_name")) for a in actors if a.get("ray_namespace") == SERVE_NAMESPACE)


def drain(
    request_drain: Callable[[float], None],
    actors_here: Callable[[], list[Mapping[str, Any]]],
    *,
    deadline_s: float = DRAIN_DEADLINE_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    say: Callable[[str], None] = print,
) -> bool:
    """Ask for the drain, then wait until no Serve actor is left on the node: True when none is
    left, False at the deadline with some still there."""
    end = clock() + deadline_s
    request_drain(deadline_s)
    said = None
    unreadable_since = None
    while True:
        try:
            left = serve_actors(actors_here())
            unreadable_since = None
        except Exception as err:  # the dashboard restarting, say: the drain goes on all the same
            if unreadable_since is None:
                say(f"cannot list this node's actors ({err}); waiting while that lasts under {UNREADABLE_FOR_S:.0f} s")
                unreadable_since = clock()
            elif clock() - unreadable_since >= UNREADABLE_FOR_S:
                say(f"this node's actors could not be listed for {UNREADABLE_FOR_S:.0f} s: the cluster's head is gone")
                return False
            left = ["(unknown)"]
        if not left:
            say("drained: no Serve actor left on this node")
            return True
        if left != said:
            say(f"waiting for {len(left)} Serve actor(s) to leave this node: {', '.join(left)}")
            said = left
        if clock() >= end:
            say(f"deadline of {deadline_s:.0f} s reached with {len(left)} Serve actor(s) still here")
            return False
        sleep(min(POLL_S, max(0.0, end - clock())))


def drain_this_node(deadline_s: float = DRAIN_DEADLINE_S, address: str = "auto",
                    say: Callable[[str], None] = print) -> bool:
    """``drain`` on the Ray node this process runs beside (a pod's ``preStop``; ``address``: its
    cluster's, ``auto`` the one this node belongs to), through Ray's GCS (the drain, as
    ``ray drain-node`` asks it) and its state API (the node's live actors)."""
    from serve_app.devtools.serve_cli import AUTH_MODE_ENV, token_available

    # A driver joins a cluster in token mode only when told to (as the serve CLI: serve_cli.py),
    # and Ray reads the mode as it is imported.
    if AUTH_MODE_ENV not in os.environ and token_available(os.environ, Path.home()):
        os.environ[AUTH_MODE_ENV] = "token"
    import ray
    from ray.core.generated import autoscaler_pb2
    from ray.util.state import list_actors

    ray.init(address=address, log_to_driver=False, logging_level="WARNING")
    try:
        context = ray.get_runtime_context()
        node_id = context.get_node_id()
        gcs = ray._raylet.GcsClient(address=context.gcs_address)
        try:
            ray.get_actor(SERVE_CONTROLLER, namespace=SERVE_NAMESPACE)
        except ValueError:
            say("no Serve controller in this cluster: nothing would move this node's replicas; not draining")
            return True

        def request_drain(seconds: float) -> None:
            deadline_ms = time.time_ns() // 1_000_000 + int(seconds * 1000)
            accepted, why = gcs.drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value(DRAIN_REASON),
                                           "the pod is terminating (its preStop hook)", deadline_ms)
            if not accepted:
                raise RuntimeError(f"Ray refused to drain node {node_id}: {why}")
            say(f"node {node_id}: drain requested, deadline in {seconds:.0f} s")

        def actors_here() -> list[Mapping[str, Any]]:
            found = list_actors(filters=[("node_id", "=", node_id), ("state", "=", "ALIVE")], limit=10_000,
                                raise_on_missing_output=False)
            return [{"class_name": a.class_name, "ray_namespace": a.ray_namespace} for a in found]

        return drain(request_drain, actors_here, deadline_s=deadline_s, say=say)
    finally:
        ray.shutdown()

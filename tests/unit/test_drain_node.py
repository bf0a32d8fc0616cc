"""``serve-app drain-node``, a GPU worker pod's preStop (serve_app/runtime/drain_node.py): the
drain is asked for with its deadline, and the hook returns once Serve's actors have left the node,
or at the deadline; the pod's grace period covers it (terraform/modules/region, held here)."""

from typer.testing import CliRunner

from serve_app import cli
from serve_app.runtime import drain_node
from serve_app.runtime.drain_node import DRAIN_DEADLINE_S, TERMINATION_GRACE_S, drain
from tests.unit.test_terraform_network import MOD, WORKER_GROUP

REPLICA = {"class_name": "ServeReplica:llm-qwen:QwenModel", "ray_namespace": "serve"}
PROXY = {"class_name": "HAProxyManager", "ray_namespace": "serve"}
OURS = {"class_name": "RateLimiter", "ray_namespace": "serve_app"}


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def run(listings, deadline_s=DRAIN_DEADLINE_S):
    """``drain`` over a node whose live actors are each of ``listings`` in turn (the last one for
    ever after); what it asked, said and returned."""
    clock, asked, said, seen = Clock(), [], [], iter(listings)
    last = {"now": None}

    def actors_here():
        item = next(seen, last["now"])
        last["now"] = item
        if isinstance(item, Exception):
            raise item
        return item

    drained = drain(asked.append, actors_here, deadline_s=deadline_s, clock=clock, sleep=clock.sleep, say=said.append)
    return drained, asked, said, clock.now


def test_the_drain_is_asked_with_its_deadline_and_the_hook_waits_until_serves_actors_are_gone():
    drained, asked, said, took = run([[REPLICA, PROXY, OURS], [REPLICA, PROXY], [PROXY], [OURS]])
    assert drained and asked == [DRAIN_DEADLINE_S]
    assert took == 15.0  # three waits: the replica's migration, then its proxy's drain
    assert "HAProxyManager, ServeReplica:llm-qwen:QwenModel" in said[0] and said[-1].startswith("drained")


def test_a_node_that_serves_nothing_returns_at_once():
    drained, _, _, took = run([[OURS]])
    assert drained and took == 0.0


def test_at_the_deadline_the_hook_returns_and_says_what_is_left():
    drained, _, said, took = run([[REPLICA]], deadline_s=12)
    assert not drained and took == 12.0  # never past the deadline: the grace period is counted from it
    assert "still here" in said[-1]


def test_the_state_api_failing_meanwhile_keeps_the_hook_waiting_until_it_answers_again():
    drained, _, said, took = run([[REPLICA], ConnectionError("dashboard restarting"), ConnectionError("again"), []])
    assert drained and took == 15.0
    assert sum("cannot list" in line for line in said) == 1


def test_a_head_that_is_gone_ends_the_wait_after_a_minute_not_at_the_deadline():
    """The whole cluster being deleted (a rollout's old one): the head goes with the workers, nothing
    will move the replicas, and waiting to the deadline held the old cluster's GPUs 10 minutes more."""
    drained, _, said, took = run([[REPLICA], ConnectionError("GCS unreachable")])
    assert not drained and took == 65.0  # 5 s, then a minute of failures
    assert said[-1].endswith("the cluster's head is gone")


def test_the_command_fails_the_hook_when_ray_refuses_and_when_the_deadline_passes(monkeypatch):
    def refused(deadline_s, address):
        raise RuntimeError("Ray refused to drain node ab12: not alive")

    monkeypatch.setattr(drain_node, "drain_this_node", refused)
    result = CliRunner().invoke(cli.app, ["drain-node"])
    assert result.exit_code == 1 and "could not drain this node: Ray refused" in result.output
    monkeypatch.setattr(drain_node, "drain_this_node", lambda deadline_s, address: False)
    assert CliRunner().invoke(cli.app, ["drain-node", "--deadline-s", "5"]).exit_code == 1
    monkeypatch.setattr(drain_node, "drain_this_node", lambda deadline_s, address: (deadline_s, address) == (5, "auto"))
    assert CliRunner().invoke(cli.app, ["drain-node", "--deadline-s", "5"]).exit_code == 0


def test_the_gpu_worker_pods_run_the_drain_within_their_grace_period():
    spec = WORKER_GROUP["template"]["spec"]
    assert MOD(spec["terminationGracePeriodSeconds"]) == TERMINATION_GRACE_S > DRAIN_DEADLINE_S  # then their own stop
    (container,) = spec["containers"]
    command = MOD(container["lifecycle"]["preStop"]["exec"]["command"])
    assert command[:2] == ["serve-app", "drain-node"]
    assert float(command[command.index("--deadline-s") + 1]) == DRAIN_DEADLINE_S

"""The redeploy fault scenario's parts that need no cluster: the three changes it deploys are the
three kinds it reports on (Serve's own code says what each restarts, ``serve_emulation.py``),
each touches its region only, and "settled" means what it says."""

import asyncio

import pytest
from ray import serve

from serve_app.devtools.local_regions import two_region_config
from serve_app.faults import redeploy
from serve_emulation import RECONFIGURE, RESTART, SAME, what_a_redeploy_does
from serve_app.regions import layout
from tests.conftest import load_serve_config
from tests.unit.serve_status import status_of

LOCAL_ROUTER, LOCAL_MODEL = ("llm", "Router"), ("llm-qwen-3.6-35b-a3b", "model-qwen-3.6-35b-a3b")
PEER_ROUTER, PEER_MODEL = ("peer", "Router"), ("peer-qwen-3.6-35b-a3b", "model-qwen-3.6-35b-a3b")
LOCAL_EMBED = ("llm-qwen-3-embedding-0.6b", "model-qwen-3-embedding-0.6b")  # not changed by the scenario


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """What the test session deploys: two regions on one host."""
    return two_region_config(load_serve_config("local.yaml"), 8123, tmp_path_factory.mktemp("auth"))


@pytest.mark.parametrize("change, local_model", [
    (redeploy.nudge_router_setting, SAME),
    (redeploy.change_engine_flag, RESTART),
    (redeploy.new_weights("/models/tiny-qwen3-next-seed1"), RESTART),
])
def test_each_change_restarts_what_it_stands_for_in_its_region_only(deployed, change, local_model):
    changed = redeploy.with_region(deployed, "llm", change)
    assert [a["name"] for a in changed["applications"]] == [a["name"] for a in deployed["applications"]]
    assert layout.problems(changed) == []
    assert what_a_redeploy_does(deployed, changed) == {
        LOCAL_ROUTER: RECONFIGURE, LOCAL_MODEL: local_model, LOCAL_EMBED: SAME, PEER_ROUTER: SAME, PEER_MODEL: SAME,
    }


def test_the_changes_build_on_each_other_and_the_original_comes_back(deployed):
    config = deployed
    for change in (redeploy.nudge_router_setting, redeploy.change_engine_flag, redeploy.new_weights("/w")):
        config = redeploy.with_region(config, "llm", change)
    model = layout.parse_region(config, "llm").models[0]
    assert model.engine.extra_args == {**layout.parse_region(deployed, "llm").models[0].engine.extra_args, "max-logprobs": 21}
    assert model.engine.source == "/w"
    assert what_a_redeploy_does(config, deployed)[LOCAL_MODEL] == RESTART  # the restore


def test_the_model_changes_together_are_each_of_them_in_one_config(deployed):
    together = redeploy.with_region(deployed, "llm", redeploy.all_of(redeploy.change_engine_flag, redeploy.new_weights("/w")))
    one_after_the_other = deployed
    for change in (redeploy.change_engine_flag, redeploy.new_weights("/w")):
        one_after_the_other = redeploy.with_region(one_after_the_other, "llm", change)
    assert together == one_after_the_other != deployed


def _status(app_status="RUNNING", replicas=None, deployed=100.0, entry=None):
    deployments = {"d": replicas or {"RUNNING": 1}}
    if entry is not None:  # a model application's ingress entry, which never runs a replica
        deployments["ModelEntry"] = entry
    app = (app_status, deployed, deployments)
    return status_of({"llm": app, "llm-qwen-3.6-35b-a3b": app})


@pytest.mark.parametrize("status, settled", [
    (_status(), True),
    (_status(app_status="DEPLOYING"), False),
    (_status(replicas={"RUNNING": 1, "STOPPING": 1}), False),  # the old replica still draining
    (_status(replicas={"RUNNING": 1, "STARTING": 1}), False),  # the replacement not up yet
    (_status(replicas={"RUNNING": 1, "STOPPING": 0}), True),
    (_status(deployed=50.0), False),  # not yet the change that was sent
    (_status(entry={}), True),  # the entry's no replicas, as Serve 2.60 reports them
    (_status(entry={"RUNNING": 0, "STOPPING": 0}), True),
    (_status(entry={"STARTING": 1}), False),
])
def test_settled_means_the_change_is_in_and_no_replica_is_coming_or_going(monkeypatch, status, settled):
    monkeypatch.setattr(serve, "status", lambda: status)
    assert redeploy._settled(["llm", "llm-qwen-3.6-35b-a3b"], deployed_at=99.0) is settled


def test_a_restart_has_settled_only_once_none_of_the_old_replicas_is_left(monkeypatch):
    monkeypatch.setattr(serve, "status", lambda: _status())
    monkeypatch.setattr(redeploy, "MIN_SETTLE_S", 0)
    monkeypatch.setattr(redeploy, "SETTLE_POLL_S", 0)
    seen = iter([[10, 11], [11], [12]])
    monkeypatch.setattr(redeploy, "_pids", lambda app: {"model": next(seen), "routers": []})
    assert asyncio.run(redeploy.wait_settled("llm", 99.0, replaced=[10, 11], timeout_s=5)) is not None
    assert next(seen, None) is None  # it waited until [12]

"""``serve deploy`` while clients stream, the fault suite's redeploy scenario
(serve_app/faults/redeploy.py) against the session's two regions: a router setting (32 clients),
an engine flag and new weights in one deploy (8 clients here; the full suite deploys each alone,
with 32: a new engine starts meanwhile), then the original config again. Nothing may drop a
stream; only a model change may replace the model's replica, and then only after its replacement
serves (docs/operations.md, "What a change restarts"). ``disruptive``: it runs after every other test and
leaves the original config deployed and settled."""

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from serve_app.devtools.serve_cli import serve_deploy
from serve_app.faults import redeploy
from serve_app.faults.cli import SIZES

pytestmark = [pytest.mark.integration, pytest.mark.disruptive]
QUICK = SIZES["quick"]
STREAMS, MODEL_STREAMS = QUICK["redeploy"], QUICK["redeploy_model"]


@pytest.fixture(scope="module")
def redeployed(serve_app, base_url, dev_key):
    result = asyncio.run(
        redeploy.redeploy(
            base_url, dev_key, config_path=serve_app["deployed_path"], app=serve_app["app_name"],
            dashboard=serve_app["dashboard"], streams=STREAMS, model_streams=MODEL_STREAMS,
            model_changes_together=QUICK["redeploy_model_changes_together"],
        )
    )
    print(result)  # the figures docs/reliability.md reports
    return {change["change"]: change for change in result["changes"]} | {"restored": result["restored"]}


def _every_stream_finished(change: dict, clients: int) -> None:
    assert change["deploy_exit"] == 0, change["deploy_error"]
    assert change["settled_after_s"] is not None, change  # it settled within the scenario's bound
    assert change["streams"] >= clients and change["streams_started_during"] > 0, change
    assert change["streams_by_outcome"] == {"200 done": change["streams"]}, change
    assert change["streams_failed"] == 0 and change["503s"] == 0, change
    assert change["streams_resumed"] == 0, change  # drained, not cut and resumed elsewhere


def test_a_router_setting_reconfigures_the_routers_and_leaves_the_model_replica_running(redeployed):
    change = redeployed["router setting"]
    _every_stream_finished(change, STREAMS)  # 32 clients streaming
    assert change["model_pids_after"] == change["model_pids_before"]  # the engine was never touched
    assert change["router_pids_after"] == change["router_pids_before"]  # reconfigured in place


def test_a_model_change_replaces_its_replica_only_after_the_new_one_serves(redeployed):
    # The engine flag and the new weights, in one deploy (CI's quick size).
    assert [name for name, change in redeployed.items() if change.get("restarts_model")] == ["engine flag and weights"]
    change = redeployed["engine flag and weights"]
    _every_stream_finished(change, MODEL_STREAMS)  # the old replica drained: its streams ran to their end
    assert change["model_pids_before"] and change["model_pids_after"]
    assert not set(change["model_pids_after"]) & set(change["model_pids_before"])  # a new engine
    assert change["router_pids_after"] == change["router_pids_before"]  # routers reconfigured, not restarted


def test_the_original_config_is_back_and_settled(redeployed):
    assert redeployed["restored"]["deploy_exit"] == 0
    assert redeployed["restored"]["settled_after_s"] is not None


def test_our_commands_deploy_from_a_shell_that_never_set_ray_auth_mode(serve_app, monkeypatch):
    """The session's Ray runs with token auth (``ray.init`` turns it on for a cluster it starts);
    the ``serve`` CLI from a shell without ``RAY_AUTH_MODE`` is refused, and ``serve_cli`` (what
    ``bench-setting``, this scenario and the failover benchmark deploy with) is let in. The config
    is the one running: nothing changes."""
    if os.environ.get("RAY_AUTH_MODE") != "token":  # ray.init sets it here when it turned auth on
        pytest.skip("the session's cluster runs without token auth (RAY_AUTH_MODE set otherwise)")
    monkeypatch.delenv("RAY_AUTH_MODE")
    path, dashboard = serve_app["deployed_path"], serve_app["dashboard"]
    shell = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}
    bare = subprocess.run([str(Path(sys.executable).with_name("serve")), "deploy", str(path), "--address", dashboard],
                          capture_output=True, text=True, env=shell)
    assert bare.returncode != 0 and "Authentication required" in bare.stdout + bare.stderr, bare  # the 401
    ours = serve_deploy(yaml.safe_load(path.read_text()), dashboard)
    assert ours.returncode == 0, ours.stderr[-2000:]

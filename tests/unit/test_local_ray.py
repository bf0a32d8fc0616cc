"""serve_app/runtime/local_ray.py: the dashboard a local node starts runs the modules the service
uses, through the one Ray function that spawns it; the node starts with LOCAL_RAY_ENV."""

import os
import re

import pytest
from ray._private import ray_constants, services

from serve_app.runtime import local_ray


class _Spawned(Exception):
    """Stops Ray's start_api_server at the spawn, with the command it would have run."""


@pytest.fixture
def spawns(monkeypatch):
    """Ray's ``start_ray_process`` replaced by a recorder that raises at the spawn."""
    calls = []

    def record(command, process_type, *args, **kwargs):
        calls.append((list(command), process_type))
        raise _Spawned()

    monkeypatch.setattr(services, "start_ray_process", record)
    return calls


def test_the_default_the_operators_list_and_all():
    assert local_ray.dashboard_modules({}) == local_ray.MODULES
    assert local_ray.dashboard_modules({local_ray.MODULES_ENV: " "}) == local_ray.MODULES
    assert local_ray.dashboard_modules({local_ray.MODULES_ENV: "All"}) is None
    assert local_ray.dashboard_modules({local_ray.MODULES_ENV: "ServeHead, JobHead,"}) == ("ServeHead", "JobHead")


@pytest.mark.parametrize("value", ["servehead", "ServeHead,NoSuchHead", "all,JobHead", ","])
def test_a_list_ray_does_not_have_is_refused_before_the_node_starts(value):
    """Ray's dashboard exits on a name it does not have (and `serve run` goes on without one);
    an empty list would read as every module. Refused here, naming what there is."""
    with pytest.raises(ValueError) as refused:
        local_ray.dashboard_modules({local_ray.MODULES_ENV: value})
    assert "ServeHead" in str(refused.value) and "JobHead" in str(refused.value)


def test_local_ray_refuses_it_with_a_message_not_a_trace(monkeypatch):
    monkeypatch.setenv(local_ray.MODULES_ENV, "NoSuchHead")
    with pytest.raises(SystemExit) as stopped:
        local_ray.main(["run", "configs/local.yaml"])
    assert "NoSuchHead" in str(stopped.value.code)


def test_every_module_named_is_one_this_ray_has():
    """The dashboard head asserts it loaded exactly what it was asked for: a name Ray does not
    have would stop the dashboard, and `serve deploy` with it."""
    names = local_ray.available_modules()
    assert set(local_ray.MODULES) <= names
    assert len(names) > len(local_ray.MODULES)  # there is something to leave out


def test_rays_dashboard_start_runs_with_the_flag(spawns, tmp_path):
    """Through Ray's own start_api_server (what ``ray.init`` and ``serve run`` call): the command
    it spawns is the dashboard's, now with ``--modules-to-load``."""
    assert local_ray.trim_dashboard({}) == local_ray.MODULES
    with pytest.raises(_Spawned):
        services.start_api_server(
            include_dashboard=True, raise_on_failure=True, host="127.0.0.1", gcs_address="127.0.0.1:1",
            cluster_id_hex="00", node_ip_address="127.0.0.1", temp_dir=str(tmp_path), logdir=str(tmp_path),
            session_dir=str(tmp_path),
        )
    ((command, process_type),) = spawns
    assert process_type == ray_constants.PROCESS_TYPE_DASHBOARD
    assert command[1].endswith("dashboard/dashboard.py")
    assert command[-1] == "--modules-to-load=ServeHead,StateHead,ReportHead"
    assert "--disable-frontend" not in command  # the web server still serves the REST APIs


def test_only_the_dashboard_changes_and_a_flag_given_stays(spawns):
    local_ray.trim_dashboard({})
    for command, process_type in (
        (["python", "log_monitor.py"], ray_constants.PROCESS_TYPE_LOG_MONITOR),
        (["python", "dashboard.py", "--modules-to-load=UsageStatsHead"], ray_constants.PROCESS_TYPE_DASHBOARD),
    ):
        with pytest.raises(_Spawned):
            services.start_ray_process(command, process_type)
    assert [command for command, _ in spawns] == [
        ["python", "log_monitor.py"],
        ["python", "dashboard.py", "--modules-to-load=UsageStatsHead"],
    ]


def test_a_second_call_replaces_the_first_and_all_puts_rays_own_back(spawns):
    rays = services.start_ray_process
    local_ray.trim_dashboard({})
    local_ray.trim_dashboard({local_ray.MODULES_ENV: "ServeHead"})
    with pytest.raises(_Spawned):
        services.start_ray_process(["python", "dashboard.py"], ray_constants.PROCESS_TYPE_DASHBOARD)
    assert spawns[-1][0] == ["python", "dashboard.py", "--modules-to-load=ServeHead"]  # not wrapped twice

    assert local_ray.trim_dashboard({local_ray.MODULES_ENV: "all"}) is None
    assert services.start_ray_process is rays


def test_without_rays_function_the_dashboard_is_left_whole(monkeypatch, caplog):
    monkeypatch.delattr(services, "start_ray_process")
    assert local_ray.trim_dashboard({}) is None
    assert "every module" in caplog.text


def test_make_run_starts_serve_through_it_and_names_the_ray_environment_nowhere_else():
    from serve_app.app import LOCAL_RAY_ENV
    from tests.conftest import REPO

    makefile = (REPO / "Makefile").read_text()
    assert "-m serve_app.runtime.local_ray run $(SERVE_CONFIG)" in makefile
    exported = set(re.findall(r"^run: export (\w+)", makefile, re.M))
    assert exported == {"SERVE_APP_DEV_API_KEY"}, "LOCAL_RAY_ENV is the one source: local_ray sets it"
    assert not exported & LOCAL_RAY_ENV.keys()


def test_the_node_starts_with_the_local_environment_and_what_is_set_already_wins(monkeypatch):
    from ray.serve.scripts import cli

    from serve_app.app import IDLE_ENV, LOCAL_RAY_ENV

    environ = {name: value for name, value in os.environ.items() if name not in LOCAL_RAY_ENV}
    environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] = "0.5"  # an operator's experiment
    monkeypatch.setattr(os, "environ", environ)
    monkeypatch.setattr(local_ray, "trim_dashboard", lambda: None)
    seen = {}
    monkeypatch.setattr(cli, "main", lambda args, prog_name: seen.update(args=args, env=dict(os.environ)))

    local_ray.main(["run", "configs/local.yaml"])

    assert seen["args"] == ["run", "configs/local.yaml"]
    assert seen["env"]["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.5"
    assert {name: seen["env"][name] for name in IDLE_ENV if name != "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"} == {
        name: value for name, value in IDLE_ENV.items() if name != "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"}
    assert seen["env"]["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert seen["env"]["RAY_SERVE_HAPROXY_NBTHREAD"] == LOCAL_RAY_ENV["RAY_SERVE_HAPROXY_NBTHREAD"]


def test_the_environment_is_set_before_any_of_serves_modules_is_imported():
    """Serve reads some of it when its modules are imported (``ray.serve._private.constants``):
    setting it must not import them first, as ``local_ray run <import path>`` builds the app in
    this very process."""
    import subprocess
    import sys

    probe = ("import sys; from serve_app.runtime import local_ray; local_ray.set_ray_environment({}); "
             "print(sorted(m for m in sys.modules if m.startswith('ray.serve')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

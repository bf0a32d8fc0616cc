"""One gloo device per process (serve_app/engine/gloo.py): every group of a process on one event loop,
collectives between real peers still right, and torch's own calls with options left as they were."""

import os
import socket
import subprocess
import sys
import textwrap
import tomllib
from datetime import timedelta
from importlib.metadata import entry_points

import pytest
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from serve_app.engine import gloo
from tests.conftest import REPO

# Two ranks, the world group and three more of both ranks, then one group of each rank alone: what
# vLLM's coordinators do, smaller. Each rank prints its gloo loop threads and what its collectives
# gave back.
_RANK = textwrap.dedent(
    """
    import datetime, os, sys, torch, torch.distributed as dist
    from serve_app.engine.gloo import share_one_gloo_device
    if sys.argv[1] == "shared":
        share_one_gloo_device()
    rank = int(sys.argv[2])
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    groups = [dist.new_group([0, 1], backend="gloo") for _ in range(3)]
    groups += [dist.new_group([r], backend="gloo") for r in (0, 1)]
    sums, members = [], []
    for group in groups:
        if group == dist.GroupMember.NON_GROUP_MEMBER:
            continue
        t = torch.full((2,), float(rank + 1))
        dist.all_reduce(t, group=group)
        sums.append(t[0].item())
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, rank, group=group)
        members.append(gathered)
    task = f"/proc/{os.getpid()}/task"
    loops = sum(open(f"{task}/{t}/comm").read().strip() == "gloo_tcp_loop" for t in os.listdir(task))
    print(loops, sums, members)
    dist.destroy_process_group()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    return {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "PYTHONPATH": str(REPO)}


def _run_all(commands: list[list[str]]) -> list[str]:
    """Start them together (ranks of one group), wait for each; none is left running."""
    env = _env()
    procs = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) for command in commands]
    try:
        outputs = [proc.communicate(timeout=120)[0].strip() for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert [proc.returncode for proc in procs] == [0] * len(procs), outputs
    return outputs


def _two_ranks(mode: str) -> list[str]:
    return _run_all([[sys.executable, "-c", _RANK, mode, str(rank)] for rank in (0, 1)])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_every_group_of_a_process_shares_one_loop_and_collectives_stay_right():
    # Each rank: the world, three groups of both ranks, and its own one-rank group.
    right = ["[3.0, 3.0, 3.0, 1.0] [[0, 1], [0, 1], [0, 1], [0]]", "[3.0, 3.0, 3.0, 2.0] [[0, 1], [0, 1], [0, 1], [1]]"]
    assert _two_ranks("shared") == [f"1 {r}" for r in right]
    assert _two_ranks("torch") == [f"5 {r}" for r in right]  # torch alone: a loop per group


# The process makes a gloo group (the shared devices), then forks; the child joins a new two-rank
# group with a peer started afresh. A device's loop thread does not survive fork: a child that
# reused its parent's device would time out connecting.
_FORKED = textwrap.dedent(
    """
    import datetime, os, sys, torch, torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from serve_app.engine.gloo import share_one_gloo_device
    share_one_gloo_device()
    timeout = datetime.timedelta(seconds=20)
    port = int(os.environ["MASTER_PORT"])
    if sys.argv[1] == "peer":
        group = c10d.ProcessGroupGloo(dist.TCPStore("127.0.0.1", port, 2, False, timeout), 1, 2, timeout=timeout)
        t = torch.ones(1)
        group.allreduce([t]).wait()
        # As the child does: no teardown of the group. Torch's gloo pair may throw on a thread
        # in its destructor when the other side has already gone (std::terminate, SIGABRT: seen
        # once in a unit run on 2026-12-06), which is not what this test is about.
        os._exit(0 if t.item() == 2 else 3)
    c10d.ProcessGroupGloo(dist.HashStore(), 0, 1, timeout=timeout)  # the parent's: fills the shared devices
    child = os.fork()
    if child == 0:
        try:
            group = c10d.ProcessGroupGloo(dist.TCPStore("127.0.0.1", port, 2, True, timeout), 0, 2, timeout=timeout)
            t = torch.ones(1)
            group.allreduce([t]).wait()
            os._exit(0 if t.item() == 2 else 3)
        except BaseException:
            os._exit(4)
    print(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
    """
)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks")
def test_a_forked_child_builds_devices_of_its_own():
    assert _run_all([[sys.executable, "-c", _FORKED, "parent"], [sys.executable, "-c", _FORKED, "peer"]])[0] == "0"


# The plugin loaded over torch's class, groups made and dropped (the shared devices then held by
# the plugin alone), three times as in a test session; then a subprocess with a preexec_fn, which
# runs the at-fork hooks in the child before its exec, and a forked child that exits normally.
# Releasing a device in a child ran its destructor on a loop thread fork did not copy: SIGSEGV
# (Ray's GCS never started), at once or at the child's shutdown.
_FORK_AFTER_DROPPED_GROUPS = textwrap.dedent(
    """
    import datetime, gc, os, subprocess, sys
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from serve_app.engine import gloo
    torch_class = c10d.ProcessGroupGloo
    for _ in range(3):
        c10d.ProcessGroupGloo = torch_class
        gloo.share_one_gloo_device()
        groups = [c10d.ProcessGroupGloo(dist.HashStore(), 0, 1, timeout=datetime.timedelta(seconds=5)) for _ in "ab"]
        del groups
    gc.collect()
    child = os.fork()
    if child == 0:
        sys.exit(0)  # the interpreter's own shutdown, in the child
    started = subprocess.run(["true"], preexec_fn=lambda: None).returncode
    print(started, os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
    """
)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks")
def test_a_child_forked_after_groups_were_dropped_releases_none_of_the_parents_devices():
    assert _run_all([[sys.executable, "-c", _FORK_AFTER_DROPPED_GROUPS]]) == ["0 0"]


# torch hands back a group's backend later as a new wrapper of its own class, and checks it with
# isinstance against the module's name before it sets a group's timeout.
_HANDED_BACK = textwrap.dedent(
    """
    import datetime, gc, torch, torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from serve_app.engine.gloo import share_one_gloo_device
    share_one_gloo_device()
    dist.init_process_group("gloo", rank=0, world_size=1)
    group = dist.new_group([0], backend="gloo")
    gc.collect()
    backend = group._get_backend(torch.device("cpu"))
    c10d._set_pg_timeout(datetime.timedelta(seconds=77), group)
    print(isinstance(backend, c10d.ProcessGroupGloo), group._get_backend(torch.device("cpu")).options._timeout)
    """
)


def test_a_backend_torch_hands_back_is_still_a_gloo_group_whose_timeout_can_be_set():
    assert _run_all([[sys.executable, "-c", _HANDED_BACK]]) == ["True 0:01:17"]


@pytest.fixture
def sharing(monkeypatch):
    """torch's own class, and the plugin loaded over it for this test only (restored after). Any
    test that built vLLM's engine arguments in this process has loaded the plugin already."""
    torch_class = c10d.ProcessGroupGloo
    while getattr(torch_class, gloo._MARK, False):
        torch_class = torch_class.__mro__[1]
    monkeypatch.setattr(c10d, "ProcessGroupGloo", torch_class)
    gloo.share_one_gloo_device()
    return torch_class


def test_the_groups_are_still_torchs_gloo_groups(sharing):
    patched = c10d.ProcessGroupGloo
    assert patched is not sharing and issubclass(patched, sharing)
    assert patched.__name__ == "ProcessGroupGloo" and patched.__module__ == sharing.__module__
    group = patched(dist.HashStore(), 0, 1, timeout=timedelta(seconds=5))
    assert isinstance(group, dist.ProcessGroupGloo) and group.size() == 1


def test_loading_the_plugin_twice_wraps_once(sharing):
    once = c10d.ProcessGroupGloo
    gloo.share_one_gloo_device()  # vLLM may load its plugins twice in one process
    assert c10d.ProcessGroupGloo is once and once.__mro__[1] is sharing


def test_later_groups_get_the_first_groups_devices_and_their_own_timeout(sharing):
    first = c10d.ProcessGroupGloo(dist.HashStore(), 0, 1, timeout=timedelta(seconds=5))
    later = c10d.ProcessGroupGloo(dist.HashStore(), 0, 1, timeout=timedelta(seconds=7))
    assert later.options._devices == first.options._devices and len(first.options._devices) == 1
    assert later.options._threads == first.options._threads
    assert later.options._timeout == timedelta(seconds=7)


def test_a_caller_that_brings_its_own_options_keeps_them(sharing):
    c10d.ProcessGroupGloo(dist.HashStore(), 0, 1, timeout=timedelta(seconds=5))  # the shared devices
    options = sharing._Options()
    options._devices = [sharing.create_default_device()]
    options._timeout = timedelta(seconds=3)
    own = c10d.ProcessGroupGloo(dist.HashStore(), 0, 1, options)
    assert own.options._devices == options._devices and own.options._timeout == timedelta(seconds=3)


@pytest.mark.parametrize(
    ("args", "kwargs", "timeout"),
    [
        ((), {"timeout": timedelta(seconds=9)}, timedelta(seconds=9)),
        ((timedelta(seconds=9),), {}, timedelta(seconds=9)),
        ((), {}, None),  # torch's default timeout: left to torch
        ((), {"timeout": 9}, None),
        ((timedelta(seconds=9),), {"timeout": timedelta(seconds=9)}, None),
    ],
)
def test_only_a_call_that_gives_a_timeout_alone_shares(args, kwargs, timeout):
    assert gloo._timeout_only(args, kwargs) == timeout


def test_without_torchs_options_the_plugin_changes_nothing(monkeypatch):
    class OldGloo:  # a torch whose gloo class takes no options
        pass

    monkeypatch.setattr(c10d, "ProcessGroupGloo", OldGloo)
    logged: list[str] = []
    monkeypatch.setattr(gloo.logger, "warning", lambda message, *args: logged.append(message % args))
    gloo.share_one_gloo_device()
    assert c10d.ProcessGroupGloo is OldGloo and len(logged) == 1 and "own device" in logged[0]


def test_vllm_finds_the_plugin_in_its_general_plugins_group():
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    assert declared["serve_app_gloo"] == "serve_app.engine.gloo:share_one_gloo_device"
    installed = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert installed.get("serve_app_gloo") == declared["serve_app_gloo"]

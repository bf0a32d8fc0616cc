"""A throwaway PostgreSQL server for the test session: Debian's ``postgresql`` package (installed
by the set-up), a fresh cluster in a temp dir, on a free loopback port; stopped with its own
``pg_ctl stop`` when the session ends. No mocks: the registry tests talk to a real server."""

import glob
import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

USER = "postgres"  # initdb refuses to run as root; Debian's package creates this user


def _binary(name: str) -> str:
    # Debian keeps the server binaries off PATH, per major version.
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}")) or [shutil.which(name)]
    if not found or not found[-1]:
        raise RuntimeError(f"{name} not found: install Debian's postgresql package (scripts/install.py --postgres)")
    return found[-1]


def _as_server_user(args: list[str]) -> list[str]:
    return ["runuser", "-u", USER, "--", *args] if os.geteuid() == 0 else args


def new_database(server_dsn: str, name: str | None = None) -> str:
    """Create an empty database on the server ``server_dsn`` names; return its DSN."""
    import psycopg

    name = name or f"t_{secrets.token_hex(6)}"
    with psycopg.connect(server_dsn, autocommit=True) as db:
        db.execute(f"CREATE DATABASE {name}")
    return server_dsn.rsplit("/", 1)[0] + f"/{name}"


@contextmanager
def postgres_server(free_port: Callable[[], int], attempts: int = 3):
    """Yield a DSN of a new, empty database on 127.0.0.1, on a port ``free_port`` picks. The port
    is picked after ``initdb`` (seconds), just before the server binds it, and picked again if
    another process took it meanwhile (a Ray cluster starting beside the tests binds many)."""
    root = Path(tempfile.mkdtemp(prefix="serve-app-pg-"))
    data, sockets = root / "data", root / "sockets"
    sockets.mkdir()
    if os.geteuid() == 0:
        shutil.chown(root, USER)
        shutil.chown(sockets, USER)
    log = root / "server.log"
    subprocess.run(
        _as_server_user([_binary("initdb"), "-D", str(data), "-U", "serve_app", "--auth=trust", "-E", "UTF8"]),
        check=True, capture_output=True,
    )
    for attempt in range(attempts):
        port = free_port()
        options = f"-c listen_addresses=127.0.0.1 -p {port} -k {sockets} -c fsync=off"
        started = subprocess.run(
            _as_server_user([_binary("pg_ctl"), "-D", str(data), "-l", str(log), "-o", options, "-w", "start"]),
            capture_output=True, text=True,
        )
        if started.returncode == 0:
            break
        said = log.read_text(errors="replace") if log.exists() else ""
        if attempt + 1 == attempts or "could not bind" not in said:
            raise RuntimeError(f"PostgreSQL did not start on port {port}: {started.stderr[-400:]}{said[-800:]}")
    try:
        yield f"postgresql://serve_app@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(_as_server_user([_binary("pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"]), check=False)
        shutil.rmtree(root, ignore_errors=True)

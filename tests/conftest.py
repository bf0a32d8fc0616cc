import secrets
import socket
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def load_serve_config(name: str) -> dict:
    return yaml.safe_load((REPO / "configs" / name).read_text())


def app_args(config: dict) -> dict:
    (application,) = config["applications"]
    return application["args"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def postgres_dsn():
    """A real PostgreSQL server for the session (Debian's package; ``tests/postgres_server.py``)."""
    from tests.postgres_server import postgres_server

    with postgres_server(free_port()) as dsn:
        yield dsn


@pytest.fixture
def fresh_database(postgres_dsn) -> str:
    """The DSN of a new, empty database on the session's server: one per test, no leftovers."""
    import psycopg

    name = f"t_{secrets.token_hex(6)}"
    with psycopg.connect(postgres_dsn, autocommit=True) as db:
        db.execute(f"CREATE DATABASE {name}")
    return postgres_dsn.rsplit("/", 1)[0] + f"/{name}"

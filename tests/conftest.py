import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from serve_app.devtools.local_services import free_port  # noqa: E402, F401  (tests import it from here)


def load_serve_config(name: str) -> dict:
    return yaml.safe_load((REPO / "configs" / name).read_text())


def app_args(config: dict) -> dict:
    """The settings (``AppArgs``, as written) of a Serve config's one region: its router
    application's args and user_config (serve_app/regions/layout.py)."""
    from serve_app.regions.layout import region_args

    return region_args(config)




@pytest.fixture(scope="session")
def postgres_dsn():
    """A real PostgreSQL server for the session (Debian's package; ``tests/postgres_server.py``)."""
    from tests.postgres_server import postgres_server

    with postgres_server(free_port) as dsn:
        yield dsn


@pytest.fixture
def fresh_database(postgres_dsn) -> str:
    """The DSN of a new, empty database on the session's server: one per test, no leftovers."""
    from tests.postgres_server import new_database

    return new_database(postgres_dsn)

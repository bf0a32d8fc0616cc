"""The session's PostgreSQL server (tests/postgres_server.py) starts even when the port it picked
is taken before the server binds it: a Ray cluster starting beside the tests binds many ports."""

import socket

import psycopg

from serve_app.devtools.local_services import free_port
from tests.postgres_server import postgres_server


def test_a_port_taken_before_the_server_binds_it_is_picked_again():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        taken_port = taken.getsockname()[1]
        picks = [taken_port]
        with postgres_server(lambda: picks.pop(0) if picks else free_port()) as dsn:
            assert not picks and f":{taken_port}/" not in dsn
            with psycopg.connect(dsn) as db:
                assert db.execute("SELECT 1").fetchone() == (1,)

"""The loopback ports tools and tests pick for the processes they start."""

from serve_app.devtools import local_services


def test_a_free_port_is_never_one_ray_takes_by_default(monkeypatch):
    """The OS once picked 52365, the dashboard agent's default: Ray refused to start the test
    session's node (a port given to two components). Such a pick is thrown back."""
    picks = iter([52365, 8265, 41234])

    class Socket:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            self.port = next(picks)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(local_services.socket, "socket", Socket)
    assert local_services.free_port() == 41234


def test_a_free_port_is_free():
    port = local_services.free_port()
    assert port not in local_services.RAY_DEFAULT_PORTS
    with local_services.socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # nothing holds it

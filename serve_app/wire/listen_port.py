"""Which port the replica's stream listener binds: one from a configured range, or any.

A Kubernetes NetworkPolicy can only name ports, so a listener on an ephemeral port (what the
kernel picks from 32768-60999) cannot be fenced without fencing every other ephemeral port with
it. ``SERVE_APP_STREAM_PORTS`` (``first-last``, inclusive; terraform/modules/region sets it on
the Ray pods, from the same variable its NetworkPolicy reads) makes the listener take the first
free port of that range; unset, the kernel picks one, as before (``make run``, the tests).

A port is taken when it is bound *and listening*: on Linux, two sockets with SO_REUSEADDR may
both bind one port while neither listens, and the second ``listen()`` then fails. Listening here,
before the socket is handed to asyncio, makes "bound" mean "ours" for the next replica that
scans the range on the same pod.
"""

import errno
import os
import socket
from dataclasses import dataclass

STREAM_PORTS_ENV = "SERVE_APP_STREAM_PORTS"
# Matches asyncio.start_server's default; asyncio re-listens with its own backlog anyway.
BACKLOG = 100


@dataclass(frozen=True)
class PortRange:
    first: int
    last: int

    def __post_init__(self) -> None:
        if not 1 <= self.first <= self.last <= 65535:
            raise ValueError(f"port range {self.first}-{self.last}: need 1 <= first <= last <= 65535")

    @classmethod
    def parse(cls, text: str) -> "PortRange":
        """``"20000-20099"`` (or one port, ``"20000"``); ValueError naming the text otherwise."""
        first, dash, last = text.strip().partition("-")
        try:
            if dash and not last:
                raise ValueError("no last port after '-'")
            return cls(int(first), int(last or first))
        except ValueError as err:
            raise ValueError(f"{STREAM_PORTS_ENV}={text!r} is not a port range like 20000-20099: {err}") from None

    def __iter__(self):
        return iter(range(self.first, self.last + 1))

    def __len__(self) -> int:
        return self.last - self.first + 1

    def __str__(self) -> str:
        return f"{self.first}-{self.last}"


def stream_port_range(environ=os.environ) -> PortRange | None:
    """The configured range, or None (any port) when ``SERVE_APP_STREAM_PORTS`` is unset or empty."""
    text = environ.get(STREAM_PORTS_ENV, "").strip()
    return PortRange.parse(text) if text else None


def bind_in_range(host: str, ports: PortRange | None) -> socket.socket:
    """A TCP socket bound to ``host`` on the first free port of ``ports`` (any port when None), and
    already listening. OSError(EADDRINUSE) naming the range when every port in it is taken; any
    other bind error (a host that is not this machine's) is raised as it is."""
    family = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]
    for port in ports if ports is not None else (0,):
        sock = socket.socket(family, socket.SOCK_STREAM)
        # As asyncio.start_server does: a port left in TIME_WAIT by a replica that just stopped is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(BACKLOG)
        except OSError as err:
            sock.close()
            if err.errno == errno.EADDRINUSE and ports is not None:
                continue
            raise
        return sock
    raise OSError(
        errno.EADDRINUSE,
        f"no free port for the stream listener on {host}: all {len(ports)} ports of "
        f"{STREAM_PORTS_ENV}={ports} are in use (widen the range, and the NetworkPolicy with it)",
    )


def stream_listen_socket(host: str) -> socket.socket:
    """The stream listener's socket on ``host``, in ``SERVE_APP_STREAM_PORTS`` when it is set."""
    return bind_in_range(host, stream_port_range())

"""The stream listener's port: the first free one of ``SERVE_APP_STREAM_PORTS``, or any
(serve_app/wire/listen_port.py), on real loopback sockets."""

import asyncio
import errno
import socket

import pytest

from serve_app.wire.listen_port import STREAM_PORTS_ENV, PortRange, bind_in_range, stream_listen_socket, stream_port_range


def _listening(port: int = 0) -> socket.socket:
    """A socket of someone else's, listening on ``port`` of 127.0.0.1 (no SO_REUSEADDR)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def _two_free_ports() -> int:
    """A port p such that p and p + 1 are both free on 127.0.0.1 right now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port < 65535:
            try:
                with socket.socket() as a, socket.socket() as b:
                    a.bind(("127.0.0.1", port))
                    b.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    pytest.fail("no two consecutive free ports on 127.0.0.1")


@pytest.mark.parametrize(
    "text, expected",
    [("20000-20099", PortRange(20000, 20099)), (" 20000 ", PortRange(20000, 20000)), ("1-65535", PortRange(1, 65535))],
)
def test_a_range_is_first_dash_last_inclusive(text, expected):
    assert PortRange.parse(text) == expected
    assert len(PortRange.parse(text)) == expected.last - expected.first + 1


@pytest.mark.parametrize("text", ["20099-20000", "0-10", "20000-70000", "abc", "20000-", "-20000", "20000-20010-20020"])
def test_a_malformed_or_backwards_range_is_refused_naming_the_variable(text):
    with pytest.raises(ValueError, match=STREAM_PORTS_ENV):
        PortRange.parse(text)


def test_unset_or_empty_means_any_port():
    assert stream_port_range({}) is None
    assert stream_port_range({STREAM_PORTS_ENV: "  "}) is None
    assert stream_port_range({STREAM_PORTS_ENV: "20000-20099"}) == PortRange(20000, 20099)


def test_without_a_range_the_kernel_picks_a_port_and_it_listens():
    with bind_in_range("127.0.0.1", None) as sock:
        port = sock.getsockname()[1]
        assert port > 0
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_the_first_free_port_of_the_range_is_taken_skipping_one_in_use():
    first = _two_free_ports()
    with _listening(first), bind_in_range("127.0.0.1", PortRange(first, first + 1)) as sock:
        assert sock.getsockname()[1] == first + 1
        socket.create_connection(("127.0.0.1", first + 1), timeout=5).close()


def test_a_port_this_module_bound_is_taken_for_the_next_caller():
    """Bound and listening before it is returned: a second replica on the same pod moves on."""
    first = _two_free_ports()
    ports = PortRange(first, first + 1)
    with bind_in_range("127.0.0.1", ports) as one, bind_in_range("127.0.0.1", ports) as two:
        assert {one.getsockname()[1], two.getsockname()[1]} == {first, first + 1}


def test_a_full_range_is_an_address_in_use_error_naming_the_range():
    with _listening() as taken:
        port = taken.getsockname()[1]
        with pytest.raises(OSError) as raised:
            bind_in_range("127.0.0.1", PortRange(port, port))
    assert raised.value.errno == errno.EADDRINUSE
    assert f"{STREAM_PORTS_ENV}={port}-{port}" in str(raised.value)


def test_a_host_that_is_not_this_machines_is_not_mistaken_for_a_full_range():
    with pytest.raises(OSError) as raised:
        bind_in_range("203.0.113.1", PortRange(20000, 20001))  # RFC 5737 documentation range: not this host
    assert raised.value.errno == errno.EADDRNOTAVAIL


def test_asyncio_serves_on_the_socket_as_the_stream_listener_will(monkeypatch):
    """What StreamServer.start does with it: ``asyncio.start_server(accept, sock=...)``."""
    first = _two_free_ports()
    monkeypatch.setenv(STREAM_PORTS_ENV, f"{first}-{first + 1}")

    async def main() -> bytes:
        async def accept(reader, writer):
            writer.write(await reader.readline())
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(accept, sock=stream_listen_socket("127.0.0.1"))
        port = server.sockets[0].getsockname()[1]
        assert first <= port <= first + 1
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"ticket\n")
        echoed = await reader.readline()
        writer.close()
        server.close()
        await server.wait_closed()
        return echoed

    assert asyncio.run(main()) == b"ticket\n"


def test_the_replicas_listener_takes_its_port_in_the_configured_range(monkeypatch):
    """What a region's NetworkPolicy relies on: the model replica's byte socket listens in
    ``SERVE_APP_STREAM_PORTS``, from the moment the replica starts."""
    from fake_engine import FakeEngine
    from router_app import model_server

    first = _two_free_ports()
    monkeypatch.setenv(STREAM_PORTS_ENV, f"{first}-{first + 1}")
    monkeypatch.setenv("SERVE_APP_STREAM_HOST", "127.0.0.1")

    async def scenario():
        server = await model_server(FakeEngine())
        try:
            return server._listener.port
        finally:
            server.__del__()

    assert first <= asyncio.run(scenario()) <= first + 1

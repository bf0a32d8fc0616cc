"""TLS on the byte socket (serve_app/wire/tls.py), a region option: real certificates from a
throwaway CA, a real listener and a real connect. A router verifies the replica by the region's
CA and name; a plaintext or unverified peer gets no stream; a router without the CA is a 503 the
pipeline can fail over on."""

import asyncio
import ssl

import pytest

from serve_app.devtools.stream_certificates import issue
from serve_app.errors import APIError
from serve_app.router.call import ReplicaCall
from serve_app.wire import socket as wire_socket
from serve_app.wire import tls
from serve_app.wire.messages import Call, StreamOpen
from serve_app.wire.socket import Listener
from test_byte_stream import FakeHandle, FakeHandleCall


@pytest.fixture
def region(tmp_path):
    return issue(tmp_path)


def _listener_env(files: dict[str, str]) -> dict[str, str]:
    return {tls.CERT_ENV: files["cert"], tls.KEY_ENV: files["key"]}


def test_a_tls_listener_streams_to_a_router_that_verifies_it_and_hears_its_hang_up(region, monkeypatch):
    monkeypatch.setenv(tls.CA_ENV, region["ca"])

    async def scenario():
        server = Listener("127.0.0.1", tls.server_context(_listener_env(region)))
        await server.start()
        ticket, future = server.expect()
        reader, writer = await wire_socket.connect(server.address, ticket, tls=server.tls)
        connection = await server.accept(ticket, future)
        assert connection.write(b"data: a\n\n")
        received = await asyncio.wait_for(reader.readexactly(9), 5)
        writer.close()  # the router's hang-up
        await asyncio.wait_for(connection.hung_up(), 5)
        cipher = writer.get_extra_info("ssl_object").version()
        server.close()
        return received, cipher

    received, version = asyncio.run(scenario())
    assert received == b"data: a\n\n" and version == "TLSv1.3"


def test_a_plaintext_connection_to_a_tls_listener_gets_no_stream(region):
    async def scenario():
        server = Listener("127.0.0.1", tls.server_context(_listener_env(region)))
        await server.start()
        ticket, future = server.expect()
        reader, writer = await asyncio.open_connection(*server.address)
        writer.write(ticket.encode() + b"\n")  # the right ticket, in the clear: not a handshake
        await asyncio.wait_for(reader.read(), 5)  # the listener ends it
        with pytest.raises(TimeoutError):
            await server.accept(ticket, future, timeout_s=0.2)
        server.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("who", ["another CA", "another name"])
def test_a_router_refuses_a_listener_it_cannot_verify(region, tmp_path, monkeypatch, who):
    """A listener signed by a CA the router does not trust, or certified for another name, is
    not the region's replica: the connect fails (an OSError, a 503 the pipeline may fail over)."""
    other = issue(tmp_path, "other", tls.STREAM_TLS_NAME if who == "another CA" else "elsewhere.internal")
    if who == "another name":
        monkeypatch.setenv(tls.CA_ENV, other["ca"])
    else:
        monkeypatch.setenv(tls.CA_ENV, region["ca"])

    async def scenario():
        server = Listener("127.0.0.1", tls.server_context(_listener_env(other)))
        await server.start()
        ticket, future = server.expect()
        with pytest.raises(ssl.SSLCertVerificationError):
            await wire_socket.connect(server.address, ticket, tls=True)
        assert not future.done()
        server.close()

    asyncio.run(scenario())


def test_a_router_without_the_regions_ca_answers_503_replica_unavailable(region, monkeypatch):
    monkeypatch.delenv(tls.CA_ENV, raising=False)

    async def scenario():
        server = Listener("127.0.0.1", tls.server_context(_listener_env(region)))
        await server.start()
        ticket, _ = server.expect()
        stream = FakeHandleCall(StreamOpen(server.address, ticket, tls=True), asyncio.Event())
        call = ReplicaCall(FakeHandle(stream).chat, Call({}, "r"), "m", "local")
        with pytest.raises(APIError) as raised:
            await call.first()
        server.close()
        return stream, raised.value

    stream, error = asyncio.run(scenario())
    assert error.status == 503 and error.code == "replica_unavailable"
    assert stream.cancelled


def test_the_listener_is_plaintext_unless_a_certificate_and_its_key_are_both_set(region):
    assert tls.server_context({}) is None
    assert tls.server_context({tls.CERT_ENV: " ", tls.KEY_ENV: ""}) is None
    with pytest.raises(ValueError, match=tls.KEY_ENV):
        tls.server_context({tls.CERT_ENV: region["cert"]})
    context = tls.server_context(_listener_env(region))
    assert context.minimum_version == ssl.TLSVersion.TLSv1_3
    assert Listener("127.0.0.1").tls is False and Listener("127.0.0.1", context).tls is True


def test_the_wire_benchmark_streams_every_byte_both_ways_and_writes_its_figures(tmp_path):
    """``serve-app bench-wire-tls``, small: both sides measured (it raises if a byte is missing),
    TLS 1.3 against plaintext, the JSON written where the table says."""
    import json

    from typer.testing import CliRunner

    from serve_app.cli import app

    result = CliRunner().invoke(app, ["bench-wire-tls", "--streams", "3", "--events", "5", "--rounds", "2",
                                      "--out-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    (written,) = tmp_path.rglob("stream_tls.json")
    figures = json.loads(written.read_text())["result"]
    assert set(figures["sides"]) == {"plaintext", "tls"} and figures["rounds"] == 2
    assert figures["streams"] == 3 and figures["events"] == 5
    assert all(side["cpu_us_per_event"] > 0 for side in figures["sides"].values())
    assert "| tls |" in result.output and str(written) in result.output

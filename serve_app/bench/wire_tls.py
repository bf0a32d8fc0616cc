"""``serve-app bench-wire-tls``: what TLS on the byte socket costs, plaintext and TLS interleaved.

The replica's listener and the router's connect (``serve_app/wire/``), as the request path uses
them, in one process and one event loop: each stream is a ticket, a connect, ``events`` SSE
events of ``event_bytes`` written one write per event as the replica's pump writes them, read by
the router 64 KiB at a time, then the replica's close. Rounds alternate plaintext and TLS (a
throwaway CA and certificate, TLS 1.3, verified by name as a router does). Reported per side: the
connect's time (connect → the listener matched the ticket: the handshake on every stream's first
token), the process CPU per stream and per event (both ends: in a region they run on different
pods, so each pays about half), and the ratios. No engine, no HTTP: this is the socket's own cost,
to hold against the byte path's budget (docs/threat-model.md quotes the figures).
"""

import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from serve_app.bench.stats import percentile
from serve_app.devtools.stream_certificates import issue
from serve_app.wire import socket as wire_socket
from serve_app.wire import tls
from serve_app.wire.socket import READ_BYTES, Listener

SIDES = ("plaintext", "tls")


async def _one_stream(listener: Listener, events: int, event: bytes) -> tuple[float, int]:
    """One stream end to end; (connect ms, bytes read)."""
    ticket, connected = listener.expect()
    started = time.perf_counter()
    reader, writer = await wire_socket.connect(listener.address, ticket, tls=listener.tls)
    connection = await listener.accept(ticket, connected)
    connect_ms = (time.perf_counter() - started) * 1000

    async def replica() -> None:
        for _ in range(events):
            connection.write(event)
            if connection.must_drain():
                await connection.drain()
            await asyncio.sleep(0)  # the engine's next output is another turn of the loop
        connection.close()

    async def router() -> int:
        received = 0
        while data := await reader.read(READ_BYTES):
            received += len(data)
        writer.close()
        return received

    _, received = await asyncio.gather(replica(), router())
    return connect_ms, received


async def _round(listener: Listener, streams: int, events: int, event: bytes) -> dict[str, Any]:
    cpu, wall = time.process_time(), time.perf_counter()
    results = await asyncio.gather(*(_one_stream(listener, events, event) for _ in range(streams)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    received = sum(n for _, n in results)
    if received != streams * events * len(event):
        raise RuntimeError(f"{received} bytes arrived of {streams * events * len(event)}")
    return {"cpu_s": cpu, "wall_s": wall, "connect_ms": [ms for ms, _ in results]}


async def measure(streams: int, events: int, event_bytes: int, rounds: int, certificates: dict[str, str]) -> dict[str, Any]:
    """``rounds`` rounds per side, interleaved; the figures per side and TLS's ratios."""
    env = {tls.CERT_ENV: certificates["cert"], tls.KEY_ENV: certificates["key"]}
    listeners = {"plaintext": Listener("127.0.0.1"), "tls": Listener("127.0.0.1", tls.server_context(env))}
    for listener in listeners.values():
        await listener.start()
    event = b"data: " + b"x" * max(0, event_bytes - 8) + b"\n\n"
    tls.client_context()  # built once per process, as a router does: not a per-stream cost
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    try:
        await _round(listeners["tls"], streams, 1, event)  # warm-up, uncounted
        for _ in range(rounds):
            for side in SIDES:
                runs[side].append(await _round(listeners[side], streams, events, event))
    finally:
        for listener in listeners.values():
            listener.close()
    return _summary(runs, streams, events, len(event))


def _summary(runs: dict[str, list[dict[str, Any]]], streams: int, events: int, event_len: int) -> dict[str, Any]:
    sides = {}
    for side, rounds in runs.items():
        cpu = statistics.median(r["cpu_s"] for r in rounds)
        connects = [ms for r in rounds for ms in r["connect_ms"]]
        sides[side] = {
            "cpu_s_per_round": round(cpu, 4),
            "cpu_us_per_stream": round(cpu / streams * 1e6, 1),
            "cpu_us_per_event": round(cpu / (streams * events) * 1e6, 2),
            "connect_ms_p50": round(percentile(connects, 50), 3),
            "connect_ms_p95": round(percentile(connects, 95), 3),
            "mb_per_s": round(streams * events * event_len / statistics.median(r["wall_s"] for r in rounds) / 1e6, 1),
        }
    plain, ciphered = sides["plaintext"], sides["tls"]
    return {
        "streams": streams, "events": events, "event_bytes": event_len, "rounds": len(runs["tls"]),
        "sides": sides,
        "tls_cpu_ratio": round(ciphered["cpu_s_per_round"] / plain["cpu_s_per_round"], 2),
        "tls_extra_cpu_us_per_stream": round(ciphered["cpu_us_per_stream"] - plain["cpu_us_per_stream"], 1),
        "tls_extra_connect_ms_p50": round(ciphered["connect_ms_p50"] - plain["connect_ms_p50"], 3),
    }


def run(streams: int, events: int, event_bytes: int, rounds: int) -> dict[str, Any]:
    """``measure`` with a throwaway CA, which the router's end of this process trusts meanwhile."""
    with tempfile.TemporaryDirectory() as directory:
        certificates = issue(Path(directory))
        before = os.environ.get(tls.CA_ENV)
        os.environ[tls.CA_ENV] = certificates["ca"]
        try:
            return asyncio.run(measure(streams, events, event_bytes, rounds, certificates))
        finally:
            if before is None:
                del os.environ[tls.CA_ENV]
            else:
                os.environ[tls.CA_ENV] = before

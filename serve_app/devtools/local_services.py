"""Processes on this host that tools and tests start and then wait for: a free loopback port for
them, and the wait for their ``/health`` (the benchmark's bare vLLM, the GPU smoke test's region,
the test session's Serve)."""

import socket
import time
from collections.abc import Callable


# Ports Ray and Serve take by default on a node they start (GCS, dashboard, the dashboard agent's
# HTTP server, Serve's HTTP and gRPC proxies, Ray Client): the dashboard agent's lies in Linux's
# ephemeral range, and a port the OS picked there once collided with it (Ray refused to start).
RAY_DEFAULT_PORTS = frozenset({6379, 8265, 52365, 8000, 9000, 10001})


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it), never one of Ray's defaults."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in RAY_DEFAULT_PORTS:
            return port


def wait_healthy(
    url: str, timeout_s: float, failed: Callable[[], str | None] = lambda: None, poll_s: float = 2
) -> float:
    """Seconds until ``url/health`` answers 200. RuntimeError on timeout, naming the last answer,
    or as soon as ``failed`` says why (the process being waited for has exited)."""
    import httpx

    started, last = time.monotonic(), "no answer"
    while True:
        if (why := failed()) is not None:
            raise RuntimeError(why)
        try:
            response = httpx.get(f"{url}/health", timeout=10)
            if response.status_code == 200:
                return time.monotonic() - started
            last = f"{response.status_code} {response.text[:120]}"
        except httpx.HTTPError as err:
            last = f"{type(err).__name__}: {err}"
        if time.monotonic() - started >= timeout_s:
            raise RuntimeError(f"{url}/health not 200 after {timeout_s:.0f} s: {last}")
        time.sleep(poll_s)

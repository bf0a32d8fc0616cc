"""A real OTLP receiver for the tracing tests: Arize Phoenix, started headless on 127.0.0.1.

Phoenix lives in ``.venv-tools`` (``[tool.serve_app] tools-venv`` in pyproject.toml; its pins
clash with the app's). It accepts OTLP over http/protobuf (``http://127.0.0.1:<port>/v1/traces``)
and gRPC (``http://127.0.0.1:<grpc_port>``), keeps spans in SQLite under a tmp working dir, and
answers ``GET /v1/projects/default/spans/otlpv1?trace_id=<32 hex>`` with the spans of a trace.
Its telemetry pixels and external resources are switched off; nothing leaves the machine.
It takes about 20 s to start on a 2-core machine: the fixture starts it without waiting, and the
first ``wait_ready`` / ``spans_for_trace`` waits, so it can come up while Ray and vLLM do.

Use: ``from tests.integration.otlp_receiver import otlp_receiver  # noqa: F401`` in a conftest
(a session fixture), or ``PhoenixReceiver`` directly. Phoenix keeps span attributes and events, the
parent span id and the status, but not the OTel span kind or resource attributes.
"""

import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
TOOLS_PYTHON = REPO / ".venv-tools" / "bin" / "python"
READY_TIMEOUT_S = 180
PROJECT = "default"  # spans without an openinference.project.name resource attribute land here


def _value(any_value: dict[str, Any] | None) -> Any:
    """An OTLP JSON AnyValue → the Python value."""
    if not any_value:
        return None
    for key in ("string_value", "bool_value", "int_value", "double_value"):
        if any_value.get(key) is not None:
            return any_value[key]
    if any_value.get("array_value") is not None:
        return [_value(v) for v in any_value["array_value"].get("values") or []]
    if any_value.get("kvlist_value") is not None:
        return {kv["key"]: _value(kv.get("value")) for kv in any_value["kvlist_value"].get("values") or []}
    return None


def _attributes(key_values: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Flat attributes. Phoenix stores attributes nested and flattens lists on the way out
    (``gen_ai.response.finish_reasons.0``); those come back together as a list."""
    flat = {kv["key"]: _value(kv.get("value")) for kv in key_values or []}
    lists: dict[str, dict[int, Any]] = {}
    for key in list(flat):
        base, _, index = key.rpartition(".")
        if base and index.isdigit():
            lists.setdefault(base, {})[int(index)] = flat.pop(key)
    for base, items in lists.items():
        flat[base] = [items[i] for i in sorted(items)]
    return flat


def normalize_span(span: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": span["name"],
        "trace_id": span["trace_id"],
        "span_id": span["span_id"],
        "parent_span_id": span.get("parent_span_id"),
        "start_ns": int(span["start_time_unix_nano"]),
        "end_ns": int(span["end_time_unix_nano"]),
        "duration_ms": (int(span["end_time_unix_nano"]) - int(span["start_time_unix_nano"])) / 1e6,
        "attributes": _attributes(span.get("attributes")),
        "events": [
            {"name": e.get("name"), "time_ns": e.get("time_unix_nano"), "attributes": _attributes(e.get("attributes"))}
            for e in span.get("events") or []
        ],
        "status_code": (span.get("status") or {}).get("code"),
    }


class PhoenixReceiver:
    """One Phoenix server process on free local ports; ``stop`` ends it by its PID."""

    def __init__(self, working_dir: Path):
        self.working_dir = Path(working_dir)
        self.http_port, self.grpc_port = free_port(), free_port()
        self.base_url = f"http://127.0.0.1:{self.http_port}"
        self.endpoint_http = f"{self.base_url}/v1/traces"
        self.endpoint_grpc = f"http://127.0.0.1:{self.grpc_port}"
        self.log_path = self.working_dir / "phoenix.log"
        self.process: subprocess.Popen | None = None
        self.started_at = 0.0
        self.ready_after_s: float | None = None

    def start(self) -> "PhoenixReceiver":
        if not TOOLS_PYTHON.exists():
            raise RuntimeError(f"{TOOLS_PYTHON} is missing: run `python3.11 scripts/install.py --only tools`")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PHOENIX_"))}
        env.update(
            PHOENIX_WORKING_DIR=str(self.working_dir),
            PHOENIX_HOST="127.0.0.1",
            PHOENIX_PORT=str(self.http_port),
            PHOENIX_GRPC_PORT=str(self.grpc_port),
            PHOENIX_TELEMETRY_ENABLED="false",
            PHOENIX_ALLOW_EXTERNAL_RESOURCES="false",
            PYTHONWARNINGS="ignore",
        )
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child writes to it until stop()
        self.started_at = time.monotonic()
        self.process = subprocess.Popen(
            [str(TOOLS_PYTHON), "-m", "phoenix.server.main", "serve"],
            env=env,
            cwd=self.working_dir,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        return self

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> float:
        """Block until both the HTTP API and the gRPC port answer; seconds since start."""
        if self.ready_after_s is not None:
            return self.ready_after_s
        assert self.process is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        http_ok = grpc_ok = False
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"Phoenix exited with {self.process.returncode}:\n{self.log_tail()}")
            if not http_ok:
                try:
                    http_ok = httpx.get(f"{self.base_url}/healthz", timeout=2).status_code == 200
                except httpx.HTTPError:
                    pass
            if http_ok and not grpc_ok:
                try:
                    socket.create_connection(("127.0.0.1", self.grpc_port), timeout=1).close()
                    grpc_ok = True
                except OSError:
                    pass
            if http_ok and grpc_ok:
                self.ready_after_s = time.monotonic() - self.started_at
                return self.ready_after_s
            time.sleep(0.25)
        raise TimeoutError(f"Phoenix not ready after {timeout_s}s:\n{self.log_tail()}")

    def spans_for_trace(self, trace_id: str, *, min_spans: int = 1, timeout_s: float = 30) -> list[dict[str, Any]]:
        """The trace's spans (normalized, see ``normalize_span``), polling until at least
        ``min_spans`` arrived (exporters batch: a few seconds is normal). [] on timeout."""
        self.wait_ready()
        deadline = time.monotonic() + timeout_s
        spans: list[dict[str, Any]] = []
        while True:
            response = httpx.get(
                f"{self.base_url}/v1/projects/{PROJECT}/spans/otlpv1",
                params={"trace_id": trace_id.lower(), "limit": 1000},
                timeout=10,
            )
            if response.status_code == 200:
                spans = [normalize_span(s) for s in response.json().get("data") or []]
            elif response.status_code != 404:  # 404: the project exists only after a first span
                response.raise_for_status()
            if len(spans) >= min_spans or time.monotonic() >= deadline:
                return spans
            time.sleep(0.5)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()  # this PID only
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


@pytest.fixture(scope="session")
def otlp_receiver(tmp_path_factory):
    """A running Phoenix: ``endpoint_http``, ``endpoint_grpc``, ``spans_for_trace(trace_id, *,
    min_spans=1, timeout_s=30)``, ``wait_ready()``, ``receiver`` (the ``PhoenixReceiver``)."""
    receiver = PhoenixReceiver(tmp_path_factory.mktemp("phoenix")).start()
    try:
        yield {
            "endpoint_http": receiver.endpoint_http,
            "endpoint_grpc": receiver.endpoint_grpc,
            "spans_for_trace": receiver.spans_for_trace,
            "wait_ready": receiver.wait_ready,
            "receiver": receiver,
        }
    finally:
        receiver.stop()

"""The real router — its ingress routes, its pipeline, its services — with fakes only for what a
cluster gives it: the model replicas are the real ``ModelServer`` in-process on a fake engine
(``fake_engine.py``) over a real loopback socket, Serve's view of the deployments is a fake status,
and peer regions are whatever ``httpx`` transport a test passes. Auth, rate limits, budgets, the
ledger and the response store are real, on files in a tmp dir. No Ray.

``RouterApp.client`` is a ``TestClient`` on the real ``ingress.app``: Serve's class-based routes
find their replica through ``serve.get_replica_context()``, which is pointed at this router's
``Services`` for the loop the client runs on.
"""

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from fastapi.testclient import TestClient
from ray import serve

from auth_support import MODEL, OTHER_MODEL, authenticator
from fake_engine import FakeEngine
from serve_app.auth.authenticator import Authenticator
from serve_app.config import AppArgs, ModelDeploymentArgs, Peer, ResponsesArgs
from serve_app.engine.deployment import ModelServer
from serve_app.hot_load.state import WantedRecord
from serve_app.hot_load.tracker import ModelStates
from serve_app.regions.layout import model_app_name
from serve_app.router import ingress
from serve_app.router.failover import Forwarder
from serve_app.router.in_flight import InFlight
from serve_app.router.response_store import ResponseStore
from serve_app.router.responses import ResponsesAPI
from serve_app.router.services import ModelFacts, Services
from serve_app.usage.meter import Meter
from serve_app.usage.store import UsageStore


class InProcessCall:
    """One handle call, driven like Serve drives a replica's generator: in a task of its own,
    whoever reads its items; ``cancel`` cancels that task (Serve's cancellation)."""

    _END = object()

    def __init__(self, items):
        self.cancelled = False
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.ensure_future(self._drive(items))

    async def _drive(self, items):
        try:
            async for item in items:
                await self._queue.put(item)
        finally:
            await self._queue.put(self._END)

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self._queue.get()
        if item is self._END:
            self._queue.put_nowait(self._END)  # a second read after the end ends too
            raise StopAsyncIteration
        return item

    def cancel(self):
        self.cancelled = True
        self._task.cancel()


class InProcessHandle:
    """A model deployment's handle (``options(stream=True)``) on in-process ``ModelServer``s: a
    call goes to the first whose engine is alive (as Serve routes once a dead replica's health
    check failed), else to the first."""

    def __init__(self, server, *more):
        self.servers = (server, *more)
        self.calls: list[InProcessCall] = []
        self.methods_made = 0  # attribute reads: Serve builds a new handle for each
        self.options_made: list[dict] = []  # each ``options(...)`` call's arguments

    def options(self, **options):
        self.options_made.append(options)
        return self

    @property
    def server(self):
        return self.servers[0]

    def __getattr__(self, method):
        handle = self
        self.methods_made += 1

        class Method:
            def remote(self, call):
                server = next((s for s in handle.servers if not s.engine.dead), handle.servers[0])
                handle.calls.append(made := InProcessCall(getattr(server, method)(call)))
                return made

        return Method()


async def model_server(engine: FakeEngine, model: str = MODEL):
    """The real replica class, constructed as Serve would, on ``engine``."""
    cls = ModelServer.func_or_class
    server = object.__new__(cls)
    await cls.__init__(server, ModelDeploymentArgs(id=model), "/weights", make_engine=lambda args, path: engine)
    return server


class FakeServe:
    """Serve's status of the model deployments (replicas by state) and the hot-load KV."""

    def __init__(self, models, running: int = 1):
        self.replicas = {f"model-{model}": {"RUNNING": running} for model in models}
        self.statuses: dict[str, str] = {}
        self.kv: dict = {}

    def status(self):
        """As ``serve.status()`` says it: each model's deployment in its own application."""
        applications = {
            model_app_name("llm", name.removeprefix("model-")): SimpleNamespace(deployments={
                name: SimpleNamespace(replica_states=counts, status=self.statuses.get(name, "HEALTHY"), message="")
            })
            for name, counts in self.replicas.items()
        }
        return SimpleNamespace(applications=applications)

    def read(self, app, deployment):
        return self.kv.get((app, deployment))

    async def read_all(self, locations):
        """``state.read_wanted_all`` on this fake's store: those never set left out."""
        return {location: self.kv[location] for location in locations if location in self.kv}

    def write(self, app, deployment, state, by):
        self.kv[(app, deployment)] = record = WantedRecord(state, time.time(), by)
        return record

    def stop(self, model: str) -> None:
        """No replica runs: the model is loading (the router answers 503 and may fail over)."""
        self.replicas[f"model-{model}"] = {}


@dataclass
class RouterApp:
    client: TestClient
    services: Services
    engine: FakeEngine
    serve: FakeServe
    handles: dict[str, InProcessHandle] = field(default_factory=dict)

    @property
    def auth(self) -> Authenticator:
        return self.services.auth

    @property
    def meter(self) -> Meter:
        return self.services.meter

    def run(self, coroutine_function, *args) -> Any:
        """Run ``coroutine_function(*args)`` on the router's event loop."""
        return self.client.portal.call(coroutine_function, *args)

    def recorded(self) -> list[dict[str, Any]]:
        """This region's ledger rows (regions share one registry, and its ledger), once every
        request has settled and the writer has flushed."""
        from serve_app.router.context import wait_settled

        self.run(wait_settled)
        self.run(self.meter.ledger.flush)
        with self.meter.store.database.connect() as db:
            query = "SELECT * FROM usage_records WHERE region = ? ORDER BY started_at_ms"
            rows = db.execute(query, (self.meter.region,))
            return [dict(row) for row in rows.fetchall()]


def to_router(peer: RouterApp):
    """An ``httpx.MockTransport`` handler that sends a request to ``peer`` (another region's
    router, on its own event loop), as a peer region's URL would. The peer's whole response comes
    back at once (Starlette's TestClient reads it to the end)."""
    import anyio
    import httpx

    async def send(request: httpx.Request) -> httpx.Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        answer = await anyio.to_thread.run_sync(
            lambda: peer.client.post(request.url.path, content=request.content, headers=headers)
        )
        return httpx.Response(answer.status_code, headers=answer.headers.multi_items(),
                              stream=httpx.ByteStream(answer.content))

    return send


_SERVICES_BY_LOOP: dict[int, Services] = {}


def _replica_context():
    """``serve.get_replica_context()`` for the routes' class-based view: this loop's router."""
    services = _SERVICES_BY_LOOP[id(asyncio.get_running_loop())]
    return SimpleNamespace(servable_object=SimpleNamespace(services=services))


def build_router_app(tmp_path: Path, monkeypatch, *, auth: Authenticator | None = None,
                     engine: FakeEngine | None = None, region: str = "local", peers: tuple[Peer, ...] = (),
                     transport=None, models: tuple[str, ...] = (MODEL, OTHER_MODEL),
                     replicas: tuple[FakeEngine, ...] = (), model_settings: dict[str, dict] | None = None,
                     uvloop: bool = False, **auth_overrides) -> RouterApp:
    """The real router and model replicas in this process, on one event loop: asyncio's, or
    ``uvloop`` (the loop every Ray actor runs in a region)."""
    auth = auth or authenticator(tmp_path, region=region, **auth_overrides)
    engine = engine or FakeEngine()
    monkeypatch.setattr(serve, "get_replica_context", _replica_context)
    monkeypatch.setenv("SERVE_APP_STREAM_HOST", "127.0.0.1")
    client = TestClient(ingress.app, backend_options={"use_uvloop": uvloop})
    client.__enter__()  # one event loop for the test's whole life: the replica's listener lives on it
    fake_serve = FakeServe(models, running=1 + len(replicas))  # each engine is a replica Serve lists
    args = [ModelDeploymentArgs(id=model, **(model_settings or {}).get(model, {})) for model in models]
    servers = [client.portal.call(model_server, one) for one in (engine, *replicas)]
    handles = {model: InProcessHandle(*servers) for model in models}
    services = Services(
        region=region,
        replica="router-1",
        auth=auth,
        meter=Meter(UsageStore(auth.keys.database), tmp_path / "spool", region=region, writer_id="router-1",
                    cache_ttl_s=0),
        states=ModelStates("llm", args, serve_status=fake_serve.status, read_all=fake_serve.read_all,
                           write=fake_serve.write),
        in_flight=InFlight(args),
        responses=ResponsesAPI(ResponseStore(auth.keys.database, ResponsesArgs())),
        forwarder=Forwarder(region, list(peers), transport=transport, unreachable_hold_s=0),
        handles=handles,
        models={model.id: ModelFacts.of(model) for model in args},
        args=AppArgs(region=region, auth=auth.args, models=args, failover={"peers": list(peers)}),
    )
    loop = client.portal.call(asyncio.get_running_loop)
    _SERVICES_BY_LOOP[id(loop)] = services
    return RouterApp(client, services, engine, fake_serve, handles)


def close_router_app(app: RouterApp) -> None:
    from serve_app.router.context import wait_settled

    async def stop() -> None:
        await wait_settled()
        for server in next(iter(app.handles.values())).servers:
            server.__del__()
        await app.services.aclose()

    try:
        app.run(stop)
    finally:
        app.client.__exit__(None, None, None)


# --- for tests that only have an Authenticator at hand -----------------------------------------
_OPEN: list[RouterApp] = []
_PATCHES = []


def router_client(auth: Authenticator, **options) -> TestClient:
    """The real router serving with ``auth`` (its files beside ``auth``'s key store), on a fake
    engine; closed when the test ends (``tests/unit/conftest.py``)."""
    import pytest

    patch = pytest.MonkeyPatch()
    _PATCHES.append(patch)
    where = Path(auth.args.key_store_path).parent / f"router-{len(_OPEN)}"
    app = build_router_app(where, patch, auth=auth, region=auth.region, **options)
    _OPEN.append(app)
    return app.client


def close_open_routers() -> None:
    while _OPEN:
        close_router_app(_OPEN.pop())
    while _PATCHES:
        _PATCHES.pop().undo()


# --- one request's context, for tests of the relay and the call alone --------------------------
class RecordingMeter:
    """The usage meter's ``record``, kept in a list: what the request would be billed."""

    def __init__(self):
        self.records: list[tuple[Any, ...]] = []
        self.stored_bytes: list[int] = []  # each record's, in order

    def record(self, record_id, caller, request, generated, *, origin, stored_bytes=0, **_):
        self.records.append((record_id, caller, request, generated, origin))
        self.stored_bytes.append(stored_bytes)


def bare_context(surface=None, *, model: str = "m"):
    """A ``Context`` for ``surface`` (chat by default), admitted, whose services are a recording
    meter and this router's in-flight count: what the relay and ``settle`` need."""
    from serve_app import surfaces
    from serve_app.router.context import Context

    services = SimpleNamespace(
        region="local", replica="router-1", meter=RecordingMeter(), stall_timeout_s=30.0, hand_off=False,
        in_flight=InFlight([SimpleNamespace(id=model, max_ongoing_requests=4, max_queued_requests=4)]),
    )
    ctx = Context.begin(surface or surfaces.CHAT, SimpleNamespace(headers={}), services)
    ctx.model = ctx.record.model = model
    ctx.caller, ctx.admitted = SimpleNamespace(key_id="k1", owner="alice"), True
    return ctx

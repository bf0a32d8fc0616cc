"""A model replica's limits are its deployment's as Serve holds them now (``engine/slots.py``,
``ModelServer._option``): the model application's args carry only what the engine is built from,
so a replica that read its limits there admitted the args' default (32) where a region's deployment
says 96, and a deploy that changed ``max_ongoing_requests`` or ``graceful_shutdown_timeout_s`` in
place never reached it."""

import asyncio
from types import SimpleNamespace

import pytest
import yaml
from ray import serve

from fake_engine import FakeEngine
from router_app import InProcessHandle
from serve_app.app import parse_model_args
from serve_app.engine.deployment import ModelServer
from serve_app.engine.slots import Slots
from serve_app.router.call import ReplicaCall
from serve_app.wire.messages import Call, Refused
from tests.conftest import REPO

MODEL = "qwen-3.6-35b-a3b"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "count"}], "max_tokens": 30, "stream": True}


pytestmark = pytest.mark.usefixtures("stream_loopback")


@pytest.fixture
def deployment(monkeypatch) -> SimpleNamespace:
    """The deployment config Serve hands this replica's context; a test edits it as a deploy would."""
    config = SimpleNamespace(max_ongoing_requests=2, graceful_shutdown_timeout_s=600.0)
    context = SimpleNamespace(replica_id=SimpleNamespace(unique_id="replica-1"), _deployment_config=config)
    monkeypatch.setattr(serve, "get_replica_context", lambda: context)
    return config


def _region_model_app(region: str) -> dict:
    config = yaml.safe_load((REPO / "configs" / f"{region}.yaml").read_text())
    return next(app for app in config["applications"] if app["name"] == f"llm-{MODEL}")


async def _replica(args, engine: FakeEngine):
    cls = ModelServer.func_or_class
    server = object.__new__(cls)
    await cls.__init__(server, args, "/weights", make_engine=lambda a, p: engine)
    return server


def test_a_region_replica_admits_what_its_deployment_says_not_the_args_default(deployment):
    app = _region_model_app("fra-01")
    (options,) = app["deployments"]
    deployment.max_ongoing_requests = options["max_ongoing_requests"]
    args = parse_model_args(app["args"])
    assert args.max_ongoing_requests != options["max_ongoing_requests"]  # the args never carry it

    async def scenario():
        server = await _replica(args, FakeEngine())
        capacity, line = server._capacity(), server._advertised()
        server.__del__()
        return capacity, line.capacity

    assert asyncio.run(scenario()) == (96, 96)


def test_a_deploy_that_raises_max_ongoing_requests_in_place_admits_the_waiting_call(deployment):
    engine = FakeEngine(tokens=100, latency_s=0.01)

    async def stream(server, name: str) -> None:
        call = ReplicaCall(InProcessHandle(server).chat, Call({**BODY, "max_tokens": 100}, name), MODEL, "local")
        await call.first()
        call.present(None, keep=False, stall_s=0)
        while await call.reader.read(65536):
            pass
        await call.trailer()

    async def scenario():
        server = await _replica(parse_model_args({"model": {"id": MODEL}}), engine)
        streams = [asyncio.ensure_future(stream(server, f"r{i}")) for i in range(3)]
        await asyncio.sleep(0.2)
        at_two = engine.count, server.in_flight, server._take("chat", Call(dict(BODY), "line"))
        deployment.max_ongoing_requests = 3  # Serve reconfigures the replica: a new context
        streams.append(asyncio.ensure_future(stream(server, "r3")))  # its arrival lets the waiting one in
        await asyncio.sleep(0.2)
        at_three = engine.count, server.in_flight, server._advertised().capacity
        await asyncio.gather(*streams)
        server.__del__()
        return at_two, at_three, engine.count

    (count, in_flight, refused), at_three, served = asyncio.run(scenario())
    assert (count, in_flight) == (2, 3) and isinstance(refused, Refused) and refused.reason == "full"
    assert at_three == (3, 4, 3) and served == 4


def test_a_stopping_replica_waits_for_its_lines_calls_as_long_as_its_deployment_says(deployment):
    engine = FakeEngine(tokens=1000, latency_s=0.01)
    deployment.graceful_shutdown_timeout_s = 0.2  # the args' default is 600 s

    async def scenario():
        server = await _replica(parse_model_args({"model": {"id": MODEL}}), engine)
        call = ReplicaCall(InProcessHandle(server).chat, Call({**BODY, "max_tokens": 1000}, "long"), MODEL, "local")
        await call.first()
        stopping = server.__del__()
        await asyncio.wait_for(stopping, 5)  # Serve kills the replica at this; the lines' calls go with it
        return server.in_flight, engine.stopped

    in_flight, stopped = asyncio.run(scenario())
    assert in_flight == 1 and stopped


def test_slots_take_turns_first_come_first_served_and_follow_the_limit_as_calls_come_and_go():
    limit = [1]
    order = []

    async def hold(slots: Slots, name: str, release: asyncio.Event):
        async with slots:
            order.append(name)
            await release.wait()

    async def scenario():
        slots = Slots(lambda: limit[0])
        done = {name: asyncio.Event() for name in "abcde"}
        tasks = {name: asyncio.ensure_future(hold(slots, name, done[name])) for name in "abc"}
        await asyncio.sleep(0.01)
        first = list(order)  # a holds the one slot; b, then c, wait
        tasks["b"].cancel()  # b gives up its turn
        await asyncio.sleep(0.01)
        limit[0] = 3  # raised: d's arrival lets c in with it
        tasks["d"] = asyncio.ensure_future(hold(slots, "d", done["d"]))
        await asyncio.sleep(0.01)
        raised = sorted(order)  # c was let in first; d, arriving with room, ran at once
        limit[0] = 1  # lowered: nothing new until fewer than 1 hold a slot
        tasks["e"] = asyncio.ensure_future(hold(slots, "e", done["e"]))
        done["a"].set()
        done["c"].set()
        await asyncio.sleep(0.01)
        lowered = sorted(order)
        done["d"].set()
        await asyncio.sleep(0.01)
        done["e"].set()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        return first, raised, lowered, sorted(order), slots.taken

    first, raised, lowered, last, taken = asyncio.run(scenario())
    assert first == ["a"] and raised == ["a", "c", "d"] and lowered == raised
    assert last == ["a", "c", "d", "e"] and taken == 0


def test_a_call_cancelled_as_it_was_given_a_slot_hands_it_on():
    async def scenario():
        slots = Slots(lambda: 1)
        await slots.__aenter__()
        waiting = asyncio.ensure_future(slots.__aenter__())
        behind = asyncio.ensure_future(slots.__aenter__())
        await asyncio.sleep(0)
        await slots.__aexit__(None, None, None)  # the slot goes to ``waiting``...
        waiting.cancel()  # ...cancelled before it ran: the slot passes to ``behind``
        await asyncio.gather(waiting, return_exceptions=True)
        await asyncio.wait_for(behind, 1)
        return slots.taken

    assert asyncio.run(scenario()) == 1

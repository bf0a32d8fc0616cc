"""The pipeline's one exit, tried as a client would break it: leaving a non-stream request while
the engine generates, leaving a stream before its first byte. The real router on a fake engine
(``router_app.py``), driven below the HTTP client so the client's departure is exact."""

import asyncio
import json

from starlette.requests import Request

from auth_support import MODEL, bearer
from fake_engine import FakeEngine
from serve_app import surfaces
from serve_app.router import pipeline


def _request(body: dict, key: str, path: str) -> Request:
    raw = json.dumps(body).encode()
    headers = [(name.lower().encode(), value.encode()) for name, value in bearer(key).items()]
    headers += [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    sent = False

    async def receive():
        nonlocal sent
        if sent:
            await asyncio.Event().wait()  # then nothing more: the client is silent, not gone
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    return Request({"type": "http", "method": "POST", "path": path, "headers": headers, "query_string": b""}, receive)


def leave_once(app, surface, body: dict, key: str, engine_is_at_work) -> None:
    """Send ``body`` to ``surface`` and leave, as a client that disconnects, once
    ``engine_is_at_work()`` says so."""

    async def leave():
        served = asyncio.ensure_future(pipeline.run(app.services, _request(body, key, surface.route), surface))
        while not engine_is_at_work():
            await asyncio.sleep(0.01)
        served.cancel()  # what Serve does to the request's task when its client disconnects
        try:
            await served
        except asyncio.CancelledError:
            pass

    app.run(leave)


def test_a_non_stream_request_whose_client_leaves_stops_the_engine_and_is_billed_what_it_generated(router_app):
    engine = FakeEngine(tokens=1000, latency_s=0.01)
    app = router_app(engine=engine)
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    body = {"model": MODEL, "max_tokens": 1000, "messages": [{"role": "user", "content": "hi"}]}
    leave_once(app, surfaces.CHAT, body, key, lambda: engine.generated >= 5)
    (row,) = app.recorded()
    assert row["status"] == 499
    assert 5 <= row["completion_tokens"] < 1000 and row["completion_tokens"] == engine.generated
    assert engine.closed_early == 1  # aborted, not run to max_tokens
    assert app.services.in_flight.load(MODEL, 1)["in_flight"] == 0

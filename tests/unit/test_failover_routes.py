"""Failover between two real routers (``router_app.py``): what a peer that does not serve the
forwarded model answers, and what the client then gets."""

import httpx

from auth_support import MODEL, OTHER_MODEL, bearer, federated_regions
from fake_engine import FakeEngine
from router_app import to_router
from serve_app.config import Peer


def test_a_model_no_peer_serves_is_the_origins_503_with_retry_after_not_the_peers_404(tmp_path, router_app):
    """fra-01's qwen-3.5-27b is served by no peer: while it starts (a cluster rollout, a load),
    a failed-over request met the peer's 404 ``model_not_found``, relayed as its verdict, which a
    client takes for "this model does not exist" and never retries."""
    regions = federated_regions(tmp_path / "keys", "fra-01", "yul-02")
    peer = router_app(auth=regions["yul-02"], region="yul-02", engine=FakeEngine(), models=(MODEL,))
    home = router_app(auth=regions["fra-01"], region="fra-01", engine=FakeEngine(),
                      peers=(Peer(region="yul-02", endpoint="https://yul.test"),),
                      transport=httpx.MockTransport(to_router(peer)))
    key, _ = home.auth.keys.create_key(owner="alice", tier="standard")
    home.serve.stop(OTHER_MODEL)  # loading here; the peer does not serve it at all
    home.run(home.services.states.refresh)
    body = {"model": OTHER_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    answer = home.client.post("/v1/chat/completions", json=body, headers=bearer(key))
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "model_loading"
    assert int(answer.headers["retry-after"]) > 0 and "x-pg-failover-from" not in answer.headers
    assert peer.recorded() == [] and [row["status"] for row in home.recorded()] == [503]
    direct = peer.client.post("/v1/chat/completions", json=body, headers=bearer(key))
    assert direct.status_code == 404  # a client of the peer's own: the model does not exist there


def _failed_over_to(peer, tmp_path, router_app):
    """fra-01, its model loading, fails a chat request over to ``peer`` (an httpx handler as the
    peer region's URL answers): the router and what the client got."""
    regions = federated_regions(tmp_path / "keys", "fra-01", "yul-02")
    home = router_app(auth=regions["fra-01"], region="fra-01", engine=FakeEngine(),
                      peers=(Peer(region="yul-02", endpoint="https://yul.test"),),
                      transport=httpx.MockTransport(peer))
    key, _ = home.auth.keys.create_key(owner="alice", tier="standard")
    home.serve.stop(MODEL)
    home.run(home.services.states.refresh)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return home, home.client.post("/v1/chat/completions", json=body, headers=bearer(key))


def test_a_peer_answer_whose_body_broke_off_is_a_502_with_this_regions_trace_id_and_timing(tmp_path, router_app):
    """The 502 is made here (the peer's head came, its body did not): like every JSON answer of
    ours it names its trace, so the failover span can be found from what the client has."""
    from serve_app.telemetry.request import TRACE_ID_HEADER
    from serve_app.telemetry.timing import parse_server_timing

    async def broken(_: httpx.Request) -> httpx.Response:
        async def chunks():
            yield b'{"id": '
            raise httpx.ReadError("peer reset the connection")
        return httpx.Response(200, headers={"content-type": "application/json"}, content=chunks())

    _, answer = _failed_over_to(broken, tmp_path, router_app)
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "peer_stream_failed"
    assert len(answer.headers[TRACE_ID_HEADER]) == 32 and answer.headers["x-pg-failover-from"] == "fra-01"
    assert parse_server_timing(answer.headers["server-timing"])["total"] > 0


def test_a_peer_that_had_the_request_and_sent_no_head_records_it_this_region_does_not(tmp_path, router_app):
    """The peer's line broke (or stayed silent) after the request was sent: the client gets this
    region's 503, the peer may be running it and records what its engine did. This region wrote
    its 503 too, so the key's reports counted two requests for one."""
    async def silent(_: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("no head within the read timeout")

    home, answer = _failed_over_to(silent, tmp_path, router_app)
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "model_loading"
    assert home.recorded() == []


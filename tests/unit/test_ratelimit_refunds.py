"""A key's tokens/min pay for what this region serves: a request the gateway admitted and then
did not serve gives its admission's tokens back (``Authenticator.refund``); a shorter answer does
not (found by a metering review: an SDK retrying a short overload locked its key out for a minute)."""

import asyncio

import httpx

from auth_support import MODEL, bearer, federated_regions
from fake_engine import FakeEngine
from router_app import to_router
from serve_app.auth.config import Tier
from serve_app.auth.lease import LeasedRateLimiter
from serve_app.auth.ratelimit import LocalRateLimiter, RateLimiter
from serve_app.config import Peer

BODY = {"model": MODEL, "max_tokens": 900, "messages": [{"role": "user", "content": "hi"}]}
TIERS = {"small": Tier(requests_per_minute=3, tokens_per_minute=1_000),
         "standard": Tier(requests_per_minute=600, tokens_per_minute=1_000_000),
         "dev": Tier(requests_per_minute=600, tokens_per_minute=1_000_000)}


def _tokens_left(app, key: str) -> int:
    return int(app.auth.limiter.limiter.peek(key.split("_")[1], 3, 1_000, 0).tokens.remaining)


def test_a_503_of_the_gateways_own_gives_the_tokens_back_and_still_counts_the_request(router_app):
    app = router_app(engine=FakeEngine(tokens=3), tiers=TIERS)
    key, _ = app.auth.keys.create_key(owner="alice", tier="small")  # 3 requests, 1,000 tokens a minute
    app.serve.stop(MODEL)  # not served here (loading), and no peer: the region answers 503
    app.run(app.services.states.refresh)
    for _ in range(2):  # the openai SDK retries a 503
        refused = app.client.post("/v1/chat/completions", json=BODY, headers=bearer(key))
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_loading"
        assert _tokens_left(app, key) >= 990  # its ~905 tokens given back
    app.serve.replicas[f"model-{MODEL}"] = {"RUNNING": 1}
    app.run(app.services.states.refresh)
    served = app.client.post("/v1/chat/completions", json=BODY, headers=bearer(key))
    assert served.status_code == 200  # before: 429, the minute spent on two 503s
    again = app.client.post("/v1/chat/completions", json={**BODY, "max_tokens": 1}, headers=bearer(key))
    assert again.status_code == 429  # the two 503s were requests all the same: 3 a minute


def test_a_shorter_answer_gives_nothing_back(router_app):
    app = router_app(engine=FakeEngine(tokens=3), tiers=TIERS)
    key, _ = app.auth.keys.create_key(owner="alice", tier="small")
    assert app.client.post("/v1/chat/completions", json=BODY, headers=bearer(key)).status_code == 200
    assert _tokens_left(app, key) < 100  # charged its 900-token limit, though 3 were generated


def test_a_request_the_engine_refused_before_generating_gives_the_tokens_back(router_app):
    """A 400 from the engine (a prompt over the context, a parameter vLLM refuses) generated
    nothing: like a refusal of the router's own, it costs a request and no tokens (docs/auth.md).
    Before, its whole price stayed charged: one such 400 locked a small key out for a minute."""
    app = router_app(engine=FakeEngine(refuse=400), tiers=TIERS)
    key, _ = app.auth.keys.create_key(owner="alice", tier="small")
    refused = app.client.post("/v1/chat/completions", json=BODY, headers=bearer(key))
    assert refused.status_code == 400
    assert _tokens_left(app, key) >= 990  # its ~905 tokens given back
    (row,) = app.recorded()
    assert (row["status"], row["prompt_tokens"], row["completion_tokens"]) == (400, 0, 0)


def test_a_prompt_the_engine_found_over_the_context_keeps_its_prompt_charged(router_app):
    """The replica rendered and tokenized the whole prompt (megabytes, up to the tier's body size)
    before it refused it: at a request each, a key tokenized on the replica every tenant shares
    for nothing. Its prompt's estimate stays charged; its completion's limit goes back."""
    app = router_app(engine=FakeEngine(refuse=(400, "context_length_exceeded")), tiers=TIERS)
    key, _ = app.auth.keys.create_key(owner="alice", tier="small")  # 1,000 tokens a minute
    body = {**BODY, "max_tokens": 100, "messages": [{"role": "user", "content": "x" * 2_400}]}  # ~600 tokens
    refused = app.client.post("/v1/chat/completions", json=body, headers=bearer(key))
    assert (refused.status_code, refused.json()["error"]["code"]) == (400, "context_length_exceeded")
    left = _tokens_left(app, key)
    assert 1_000 - 700 < left < 1_000 - 550  # the prompt's ~600 kept, the 100 of its limit back
    (row,) = app.recorded()
    assert (row["status"], row["prompt_tokens"], row["completion_tokens"]) == (400, 0, 0)  # no bill


def test_embeddings_the_replica_found_over_the_request_cap_keep_their_charge(router_app):
    """The request cap (300,000 tokens) is checked on the rendered inputs: the replica tokenized
    them all before it refused (2,048 strings of digits, ~75,000 tokens by size, are over
    300,000). It kept nothing charged: at a request each, a tenant's tokenizing on the replica
    every tenant shares was free. As for a prompt over the context, the estimate stays charged."""
    embed = "qwen-3-embedding-0.6b"
    app = router_app(engine=FakeEngine(refuse=(400, "max_tokens_per_request")), tiers=TIERS, models=(MODEL, embed))
    key, _ = app.auth.keys.create_key(owner="alice", tier="small")  # 1,000 tokens a minute
    body = {"model": embed, "input": ["1234567890" * 24] * 10}  # ~600 tokens by size
    refused = app.client.post("/v1/embeddings", json=body, headers=bearer(key))
    assert (refused.status_code, refused.json()["error"]["code"]) == (400, "max_tokens_per_request")
    assert 1_000 - 700 < _tokens_left(app, key) < 1_000 - 500  # before: all 1,000 left
    (row,) = app.recorded()
    assert (row["status"], row["prompt_tokens"], row["completion_tokens"]) == (400, 0, 0)  # no bill


def test_a_request_a_peer_region_served_gives_the_origins_tokens_back(tmp_path, router_app):
    regions = federated_regions(tmp_path / "keys", "yul-02", "yvr-01")
    peer = router_app(auth=regions["yvr-01"], region="yvr-01", engine=FakeEngine(tokens=3))
    home = router_app(auth=regions["yul-02"], region="yul-02", engine=FakeEngine(tokens=3),
                      peers=(Peer(region="yvr-01", endpoint="https://yvr.test"),),
                      transport=httpx.MockTransport(to_router(peer)))
    key, _ = home.auth.keys.create_key(owner="alice", tier="tiny")  # 2 requests, 1,000 tokens a minute
    home.serve.stop(MODEL)
    home.run(home.services.states.refresh)
    served = home.client.post("/v1/chat/completions", json=BODY, headers=bearer(key))
    assert served.status_code == 200 and served.headers["x-pg-region"] == "yvr-01"
    home.serve.replicas[f"model-{MODEL}"] = {"RUNNING": 1}
    home.run(home.services.states.refresh)
    assert home.client.post("/v1/chat/completions", json=BODY, headers=bearer(key)).status_code == 200
    assert [r["failover_origin"] for r in peer.recorded()] == ["yul-02"]  # the peer billed the first


def test_a_stream_a_peer_took_gives_the_origins_tokens_and_budget_hold_back_before_it_ends(tmp_path, router_app):
    """The peer charges its own limits and holds its own budget from the moment it takes the
    request: this region's admission goes back then, not at the last byte (a long stream held
    its price here that long: the key's requests here were refused as over budget)."""
    regions = federated_regions(tmp_path / "keys", "yul-02", "yvr-01")
    peer = router_app(auth=regions["yvr-01"], region="yvr-01", engine=FakeEngine(tokens=40, latency_s=0.02))
    home = router_app(auth=regions["yul-02"], region="yul-02", engine=FakeEngine(tokens=3),
                      peers=(Peer(region="yvr-01", endpoint="https://yvr.test"),),
                      transport=httpx.MockTransport(to_router(peer)))
    key, record = home.auth.keys.create_key(owner="alice", tier="tiny")  # 1,000 tokens a minute
    home.services.meter.store.set_budget(record.key_id, tokens_per_day=100_000, tokens_per_month=None)
    home.serve.stop(MODEL)
    home.run(home.services.states.refresh)
    with home.client.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True},
                            headers=bearer(key)) as streaming:
        lines = iter(streaming.iter_lines())
        first = next(line for line in lines if line.startswith("data: "))  # the stream is under way
        during = _tokens_left(home, key), home.services.meter.budgets.held_tokens(record.key_id)
        rest = [line for line in lines if line.startswith("data: ")]
    assert streaming.headers["x-pg-region"] == "yvr-01" and '"content"' in first and rest[-1] == "data: [DONE]"
    assert during == (_tokens_left(home, key), 0) and during[0] >= 990  # its ~905 tokens back at once
    assert home.recorded() == [] and len(peer.recorded()) == 1


def test_tokens_given_back_fill_the_live_lease_to_one_slice_the_rest_goes_to_the_region_never_past_capacity():
    region = RateLimiter()
    leased = LeasedRateLimiter(LocalRateLimiter(region))

    def left_in_region() -> int:
        return region.peek("k", 600, 100_000, 0).tokens.remaining

    async def scenario():
        assert (await leased.acquire("k", 600, 100_000, 40_000)).allowed  # the actor's, with a slice of 5,000
        assert (leased._leases["k"].tokens, left_in_region()) == (5_000, 55_000)
        await leased.charge("k", 600, 100_000, -40_000)  # the lease is full: back to the region
        assert (leased._leases["k"].tokens, left_in_region()) == (5_000, 95_000)
        assert (await leased.acquire("k", 600, 100_000, 3_000)).allowed  # from the lease, no actor call
        await leased.charge("k", 600, 100_000, -3_000)
        assert (leased._leases["k"].tokens, left_in_region()) == (5_000, 95_000)  # the lease is whole again
        leased._leases.clear()  # the lease is gone (expired)
        await leased.charge("k", 600, 100_000, -10**9)
        assert left_in_region() == 100_000  # a full bucket, no more

    asyncio.run(scenario())


def test_a_stream_that_sent_tokens_before_its_engine_failed_gives_nothing_back(router_app):
    app = router_app(engine=FakeEngine(tokens=10, fail_after=2), tiers=TIERS)
    key, _ = app.auth.keys.create_key(owner="alice", tier="small")
    with app.client.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}, headers=bearer(key)) as s:
        text = "".join(s.iter_text())
    assert '"content":' in text and '"error"' in text  # tokens, then the failure
    assert _tokens_left(app, key) < 100  # the client had its tokens: the admission stands


def test_a_non_stream_answer_the_engine_worked_on_then_failed_gives_nothing_back(router_app):
    """A replica took it (its head came): the engine may have generated, though a failed answer
    reports no count. Only refusals before any replica took the request give tokens back."""
    app = router_app(engine=FakeEngine(tokens=600, fail_after=500), tiers=TIERS)
    key, _ = app.auth.keys.create_key(owner="alice", tier="small")
    failed = app.client.post("/v1/chat/completions", json=BODY, headers=bearer(key))
    assert failed.status_code >= 500 and app.engine.generated >= 500
    assert _tokens_left(app, key) < 100


def test_an_answer_the_engine_worked_on_then_failed_over_to_peers_that_refused_gives_nothing_back(
        tmp_path, router_app):
    """Failing over drops the local call; that a replica had taken the request (its head came)
    is kept: every peer answering 503 leaves the local 503, and the engine's work stands."""
    regions = federated_regions(tmp_path / "keys", "yul-02", "yvr-01")
    peer = router_app(auth=regions["yvr-01"], region="yvr-01", engine=FakeEngine(tokens=3))
    peer.serve.stop(MODEL)  # loading there too: 503
    peer.run(peer.services.states.refresh)
    home = router_app(auth=regions["yul-02"], region="yul-02", engine=FakeEngine(tokens=600, fail_after=500, dies=True),
                      peers=(Peer(region="yvr-01", endpoint="https://yvr.test"),),
                      transport=httpx.MockTransport(to_router(peer)))
    key, _ = home.auth.keys.create_key(owner="alice", tier="tiny")  # 2 requests, 1,000 tokens a minute
    failed = home.client.post("/v1/chat/completions", json=BODY, headers=bearer(key))
    assert failed.status_code == 503 and home.engine.generated >= 500
    assert "x-pg-failover-from" not in failed.headers  # no peer took it: this region's own 503
    assert _tokens_left(home, key) < 100  # before: the whole ~905 given back


def test_a_stream_whose_replicas_engine_was_already_dead_gives_back_when_no_peer_takes_it(tmp_path, router_app):
    """A stream's head was that replica's 503 engine_unavailable (no engine request started): not
    a replica that took the request, so the price goes back when the peers refuse too (the review
    of the fix above; a non-stream request's head is the replica's Accepted, before its engine is
    asked, and keeps its price as a failed non-stream answer does)."""
    regions = federated_regions(tmp_path / "keys", "yul-02", "yvr-01")
    peer = router_app(auth=regions["yvr-01"], region="yvr-01", engine=FakeEngine(tokens=3))
    peer.serve.stop(MODEL)
    peer.run(peer.services.states.refresh)
    dead = FakeEngine(tokens=3)
    dead.dead = True  # its engine core died before this request came
    home = router_app(auth=regions["yul-02"], region="yul-02", engine=dead,
                      peers=(Peer(region="yvr-01", endpoint="https://yvr.test"),),
                      transport=httpx.MockTransport(to_router(peer)))
    key, _ = home.auth.keys.create_key(owner="alice", tier="tiny")  # 2 requests, 1,000 tokens a minute
    failed = home.client.post("/v1/chat/completions", json={**BODY, "stream": True}, headers=bearer(key))
    assert failed.status_code == 503 and failed.json()["error"]["code"] == "engine_unavailable"
    assert dead.generated == 0 and _tokens_left(home, key) >= 990  # its ~905 tokens given back

"""A stream that survives its engine (``router/resume.py``): on the real router with two replicas
(the real ``ModelServer`` on fake engines, ``router_app.py``), the first engine dies mid-stream and
the second continues from exactly its last token."""

import json
import time

import httpx
import pytest

from auth_support import MODEL, bearer, federated_regions
import fake_vllm
from fake_engine import FakeEngine
from router_app import to_router
from serve_app.config import Peer
from serve_app.usage.records import utc_day

ASK = [{"role": "user", "content": "count"}]


@pytest.fixture(autouse=True, scope="module")
def vllm_imported():
    """A continuation's replay makes vLLM's output objects: its modules are imported here, once,
    not on the clock of a resume's window (seconds on a busy host)."""
    fake_vllm.import_vllm()


def _stream(app, key, **body):
    response = app.client.post(
        "/v1/chat/completions", headers=bearer(key),
        json={"model": MODEL, "messages": ASK, "max_tokens": 12, "stream": True, **body},
    )
    events = [e for e in response.text.split("\n\n") if e]
    return response, events


def _text(events):
    text = []
    for event in events:
        if event.startswith("data: {") and '"choices":[{' in event:
            text.append(json.loads(event[6:])["choices"][0]["delta"].get("content") or "")
    return "".join(text)


@pytest.fixture
def two_replicas(router_app):
    dying = FakeEngine(tokens=12, fail_after=5, dies=True)  # its engine core dies after 5 tokens
    healthy = FakeEngine(tokens=12)
    app = router_app(engine=dying, replicas=(healthy,))
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    return app, key, dying, healthy


def test_an_engine_that_dies_mid_stream_is_resumed_on_another_replica_as_one_stream(two_replicas):
    app, key, dying, healthy = two_replicas
    response, events = _stream(app, key)
    assert response.status_code == 200
    # Every token once, in order, across the seam; no error event; one [DONE].
    assert _text(events) == "".join(f"t{i} " for i in range(1, 13))
    assert not any('"error"' in e for e in events) and events.count("data: [DONE]") == 1 == (events[-1] == "data: [DONE]")
    ids = {json.loads(e[6:])["id"] for e in events if e.startswith("data: {")}
    assert len(ids) == 1  # one stream id, both engine requests named by the router's request id
    assert sum('"role":"assistant"' in e for e in events) == 1  # the continuation's opening was dropped
    metadata = json.loads(next(e for e in events if e.startswith("event: pg_metadata")).split("data: ", 1)[1])
    assert metadata["pg_metadata"]["resumes"] == 1
    # The second engine continued from the first's last token: its prompt held the 5 generated.
    (surface, resumed), = [(s, c) for s, c in healthy.calls]
    assert resumed.resume.token_ids == (1, 2, 3, 4, 5) and resumed.body["max_completion_tokens"] == 7
    assert resumed.resume.received == {"opening": 1, "content": len("t1 t2 t3 t4 t5 ")}  # what the client had
    # One usage record: the customer's prompt, all 12 tokens, the resume apart.
    (row,) = app.recorded()
    assert (row["status"], row["prompt_tokens"], row["completion_tokens"]) == (200, 5, 12)
    assert (row["resumes"], row["resume_prompt_tokens"]) == (1, 5 + 5)


def test_a_stream_whose_engine_dies_before_its_first_token_is_run_again_elsewhere(router_app):
    """Nothing generated yet (still prefilling): the continuation is the whole answer, which the
    client has not seen a token of (the opening it got is not sent twice)."""
    healthy = FakeEngine(tokens=12)
    app = router_app(engine=FakeEngine(tokens=12, fail_after=0, dies=True), replicas=(healthy,))
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    response, events = _stream(app, key)
    assert response.status_code == 200 and _text(events) == "".join(f"t{i} " for i in range(1, 13))
    assert sum('"role":"assistant"' in e for e in events) == 1 and not any('"error"' in e for e in events)
    (_, resumed), = healthy.calls
    assert resumed.resume.token_ids == () and resumed.body["max_completion_tokens"] == 12


def test_the_usage_the_client_asked_for_counts_the_whole_answer(two_replicas):
    app, key, _, _ = two_replicas
    _, events = _stream(app, key, stream_options={"include_usage": True})
    usage = [json.loads(e[6:])["usage"] for e in events if e.startswith("data: {") and '"choices":[]' in e]
    assert usage == [{"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}]


def test_the_usage_keeps_the_first_calls_cached_prompt_tokens(router_app):
    """The continuation prefills the prompt and the tail (its own cache hits, engine work recorded
    apart): the client's usage and the ledger both say what the first call's prefill found cached."""
    healthy = FakeEngine(tokens=12, cached_tokens=9)  # the prompt and the tail: more than the prompt
    app = router_app(engine=FakeEngine(tokens=12, fail_after=5, dies=True, cached_tokens=3), replicas=(healthy,))
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    _, events = _stream(app, key, stream_options={"include_usage": True})
    usage = [json.loads(e[6:])["usage"] for e in events if e.startswith("data: {") and '"choices":[]' in e]
    assert usage == [{"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17,
                      "prompt_tokens_details": {"cached_tokens": 3}}]
    (_, resumed), = healthy.calls
    assert resumed.resume.cached_tokens == 3
    (row,) = app.recorded()
    assert row["cached_tokens"] == 3
    metadata = json.loads(next(e for e in events if e.startswith("event: pg_metadata")).split("data: ", 1)[1])
    assert metadata["pg_metadata"]["cached_tokens"] == 3


def test_a_stream_run_again_from_its_prompt_reports_the_continuations_cached_tokens(router_app):
    """The first engine died before its first output: it counted no prompt, so the continuation,
    which ran the prompt alone, is the one whose cache hits the usage, the ledger and the timing say."""
    healthy = FakeEngine(tokens=12, cached_tokens=4)
    app = router_app(engine=FakeEngine(tokens=12, fail_after=0, dies=True, cached_tokens=2), replicas=(healthy,))
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    _, events = _stream(app, key, stream_options={"include_usage": True})
    usage = [json.loads(e[6:])["usage"] for e in events if e.startswith("data: {") and '"choices":[]' in e]
    assert usage[0]["prompt_tokens_details"] == {"cached_tokens": 4}
    (_, resumed), = healthy.calls
    assert resumed.resume.cached_tokens is None
    (row,) = app.recorded()
    assert (row["prompt_tokens"], row["cached_tokens"]) == (5, 4)
    metadata = json.loads(next(e for e in events if e.startswith("event: pg_metadata")).split("data: ", 1)[1])
    assert metadata["pg_metadata"]["cached_tokens"] == 4


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("unfaithful", [
    {"n": 2}, {"logprobs": True}, {"tools": TOOLS, "tool_choice": "required"},
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
    {"response_format": {"type": "json_object"}},
    {"presence_penalty": 0.5}, {"frequency_penalty": -1}, {"seed": 0}, {"return_token_ids": True},
])
def test_a_stream_that_cannot_be_resumed_faithfully_ends_with_the_engine_failure_event(two_replicas, unfaithful):
    app, key, _, healthy = two_replicas
    response, events = _stream(app, key, **unfaithful)
    assert response.status_code == 200
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] == "engine_unavailable" and events[-1] == "data: [DONE]"
    assert healthy.calls == []  # not retried elsewhere
    (row,) = app.recorded()
    assert (row["status"], row["resumes"]) == (503, 0) and row["completion_tokens"] >= 5  # billed what was generated


@pytest.mark.parametrize("body", [{"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}, {"enable_thinking": True}],
                         ids=["tools", "tool_choice_auto", "thinking"])
def test_a_stream_with_tools_or_reasoning_resumes_too(two_replicas, body):
    """The continuation replays the tokens through its serving layer (``engine/replay.py``): its
    tool and reasoning parsers stand where the first stream's stood (``test_seam.py`` cuts a
    seam inside reasoning and inside a tool call's arguments)."""
    app, key, _, healthy = two_replicas
    response, events = _stream(app, key, **body)
    assert response.status_code == 200 and _text(events) == "".join(f"t{i} " for i in range(1, 13))
    assert not any('"error"' in e for e in events)
    (_, resumed), = healthy.calls
    assert resumed.resume.token_ids == (1, 2, 3, 4, 5)


def _messages(app, key):
    response = app.client.post("/v1/messages", headers=bearer(key), json={
        "model": MODEL, "max_tokens": 12, "stream": True, "messages": ASK,
    })
    events = [(e.split("\n", 1)[0][len("event: "):], json.loads(e.split("data: ", 1)[1]))
              for e in response.text.split("\n\n") if e.startswith("event: ")]
    return response, events


def _assert_one_whole_message(response, events):
    """Every token once across the seam, in one message: one start, one block, one stop, no error."""
    assert response.status_code == 200
    names = [name for name, _ in events]
    assert names.count("message_start") == names.count("content_block_start") == names.count("message_stop") == 1
    assert "error" not in names and names[-1] == "message_stop"
    text = "".join(e["delta"].get("text", "") for name, e in events if name == "content_block_delta")
    assert text == "".join(f"t{i} " for i in range(1, 13))


def test_a_messages_stream_resumes_on_another_replica_as_one_message(two_replicas):
    app, key, _, healthy = two_replicas
    _assert_one_whole_message(*_messages(app, key))
    (_, resumed), = healthy.calls
    assert resumed.resume.received == {"opening": 1, "block0.start": 1, "block0.delta": len("t1 t2 t3 t4 t5 ")}
    (row,) = app.recorded()
    assert (row["status"], row["completion_tokens"], row["resumes"]) == (200, 12, 1)


def _responses(app, key):
    response = app.client.post("/v1/responses", headers=bearer(key), json={
        "model": MODEL, "input": "count", "max_output_tokens": 12, "stream": True,
    })
    events = [(e.split("\n", 1)[0][len("event: "):], json.loads(e.split("data: ", 1)[1]))
              for e in response.text.split("\n\n") if e.startswith("event: ")]
    return response, events


def _assert_one_whole_response(app, key, response, events):
    """Every token once, in one response: one opening, one item under one id (the first stream's),
    the events numbered 0, 1, 2… across the seam, one terminal event, the stored response whole."""
    assert response.status_code == 200
    names = [name for name, _ in events]
    assert names.count("response.created") == names.count("response.output_item.added") == 1
    assert names[-1] == "response.completed" and "error" not in names
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    text = "".join(e["delta"] for name, e in events if name == "response.output_text.delta")
    assert text == "".join(f"t{i} " for i in range(1, 13))
    item_ids = {e.get("item_id") or e["item"]["id"] for _, e in events if "item_id" in e or "item" in e}
    final = events[-1][1]["response"]
    assert len(item_ids) == 1 and [item["id"] for item in final["output"]] == list(item_ids)
    assert final["usage"]["output_tokens"] == 12 and final["pg_metadata"]["resumes"] == 1
    # As the opening told it: the client's limit (the continuation was asked for what was left).
    assert final["max_output_tokens"] == 12 and final["created_at"] == events[0][1]["response"]["created_at"]
    stored = app.client.get(f"/v1/responses/{final['id']}", headers=bearer(key)).json()
    assert stored["output"][0]["id"] in item_ids and stored["output"][0]["content"][0]["text"] == text
    assert stored["max_output_tokens"] == 12


def test_a_responses_stream_resumes_on_another_replica_as_one_response(two_replicas):
    app, key, _, healthy = two_replicas
    _assert_one_whole_response(app, key, *_responses(app, key))
    (_, resumed), = healthy.calls
    assert resumed.resume.token_ids == (1, 2, 3, 4, 5) and resumed.body["max_output_tokens"] == 7
    assert set(resumed.resume.ids) == {"item0"} and resumed.resume.received["response.output_text.delta:0:0"] == 15
    (row,) = app.recorded()
    assert (row["status"], row["completion_tokens"], row["resumes"]) == (200, 12, 1)


@pytest.fixture
def observed(monkeypatch):
    """Each request's record as the metrics see it when it closes (``ray_serve_app_resumes_total``)."""
    from serve_app.telemetry import request

    records = []
    monkeypatch.setattr(request, "observe", lambda record, split: records.append(record))
    return records


@pytest.mark.parametrize(("body", "counted"), [({}, (1, 0)), ({"logprobs": True}, (0, 1))], ids=["resumed", "gave_up"])
def test_the_resume_metric_counts_each_broken_stream_resumed_or_not(two_replicas, observed, body, counted):
    app, key, _, _ = two_replicas
    _stream(app, key, **body)  # its engine dies after 5 tokens: resumed, or (logprobs) not resumable
    app.recorded()  # settled
    assert [(r.resumes, r.resumes_given_up) for r in observed] == [counted]


def test_a_continuation_keeps_a_limit_the_router_set_lowerable_by_the_replica(two_replicas):
    """A request without max_tokens got the router's limit from a size estimate: its continuation
    (prompt plus the tokens before the seam) may be lowered to the context left, not refused."""
    app, key, _, healthy = two_replicas
    response = app.client.post("/v1/chat/completions", headers=bearer(key),
                               json={"model": MODEL, "messages": ASK, "stream": True})
    assert response.status_code == 200
    (_, resumed), = healthy.calls
    assert resumed.resume is not None and resumed.limit_set_by_router


def test_with_no_other_replica_the_stream_ends_with_the_engine_failure_event_after_the_window(router_app):
    app = router_app(engine=FakeEngine(tokens=12, fail_after=5, dies=True))
    app.services.resume_window_s = 0.5  # the only replica answers engine_unavailable meanwhile
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    _, events = _stream(app, key)
    assert json.loads(events[-2][6:])["error"]["code"] == "engine_unavailable"
    assert _text(events) == "".join(f"t{i} " for i in range(1, 6))


# --- in a peer region -----------------------------------------------------------------------------
@pytest.fixture
def two_regions(tmp_path, router_app):
    """yul-02's only engine dies after 5 tokens; yvr-01 (its peer) is healthy."""
    regions = federated_regions(tmp_path / "keys", "yul-02", "yvr-01")
    healthy = FakeEngine(tokens=12)
    peer = router_app(auth=regions["yvr-01"], region="yvr-01", engine=healthy)
    dying = FakeEngine(tokens=12, fail_after=5, dies=True, cached_tokens=3)
    home = router_app(auth=regions["yul-02"], region="yul-02", engine=dying,
                      peers=(Peer(region="yvr-01", endpoint="https://yvr.test"),),
                      transport=httpx.MockTransport(to_router(peer)))
    key, _ = home.auth.keys.create_key(owner="alice", tier="standard")
    return home, peer, key, healthy


def test_when_the_failed_replica_is_the_regions_only_one_the_peer_resumes_at_once(two_regions):
    """Its replacement is an engine start away: the continuation is not sent back to the dead
    replica for resume_here_s, it goes to the peer region at once."""
    home, _, key, healthy = two_regions
    home.services.resume_here_s = 300  # would hold the stream this long if the region were tried
    response, events = _stream(home, key)
    assert response.status_code == 200 and _text(events) == "".join(f"t{i} " for i in range(1, 13))
    dying = home.engine
    assert len(dying.calls) == 1 and len(healthy.calls) == 1  # never retried here


def test_with_no_other_replica_here_a_peer_region_resumes_the_stream_recorded_once_each_region_its_part(
        two_regions):
    home, peer, key, healthy = two_regions
    response, events = _stream(home, key, stream_options={"include_usage": True})
    assert response.status_code == 200
    assert _text(events) == "".join(f"t{i} " for i in range(1, 13))
    assert not any('"error"' in e for e in events) and events[-1] == "data: [DONE]"
    assert events.count("data: [DONE]") == 1 and sum("event: pg_metadata" in e for e in events) == 1
    assert len({json.loads(e[6:])["id"] for e in events if e.startswith("data: {")}) == 1
    # The closing is this region's, with the resume in it; the usage counts the whole answer.
    closing = json.loads(next(e for e in events if e.startswith("event: pg_metadata")).split("data: ", 1)[1])
    assert closing["pg_metadata"]["region"] == "yul-02"
    assert (closing["pg_metadata"]["resumes"], closing["pg_metadata"]["resumed_in"]) == (1, "yvr-01")
    assert closing["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17,
                                "prompt_tokens_details": {"cached_tokens": 3}}  # the first call's cache hit
    assert sum('"choices":[]' in e for e in events) == 1  # the usage chunk the client asked for, once
    # The peer's replica continued from the first engine's last token, with what was left.
    ((_, resumed),) = healthy.calls
    assert resumed.resume.token_ids == (1, 2, 3, 4, 5) and resumed.body["max_completion_tokens"] == 7
    assert resumed.request_id == home_request_id(home) and resumed.resume.cached_tokens == 3
    # The request's record here, with what this region's engine did; the peer's row continues it
    # with what its engine did (its prefill, the prompt and the 5 tokens, is engine work).
    (row,), (there,) = home.recorded(), peer.recorded()
    assert (row["status"], row["prompt_tokens"], row["completion_tokens"], row["cached_tokens"]) == (200, 5, 5, 3)
    assert (row["resumes"], row["resume_prompt_tokens"], row["resumed_in"], row["continues"]) == (1, 0, "yvr-01", None)
    assert (there["status"], there["prompt_tokens"], there["completion_tokens"], there["cached_tokens"]) == (
        200, 0, 7, 0)
    assert (there["continues"], there["failover_origin"], there["resume_prompt_tokens"]) == (row["id"], "yul-02", 10)
    assert there["id"] != row["id"] and (there["started_at_ms"], there["day"]) == (row["started_at_ms"], row["day"])
    # One request of the key's, and every token the client got.
    (total,) = _totals(home, row["key_id"], row["day"])
    assert (total["requests"], total["prompt_tokens"], total["completion_tokens"]) == (1, 5, 12)


def test_a_peer_resume_sends_no_usage_chunk_to_a_client_that_did_not_ask_for_usage(two_regions):
    """The peer is asked for its usage (it is billed here): its ``choices: []`` chunk would break a
    client's ``chunk.choices[0]``."""
    home, peer, key, healthy = two_regions
    response, events = _stream(home, key)
    assert _text(events) == "".join(f"t{i} " for i in range(1, 13))
    assert not any('"choices":[]' in e for e in events), events
    (row,), (there,) = home.recorded(), peer.recorded()
    assert (row["status"], row["prompt_tokens"], row["completion_tokens"], there["completion_tokens"]) == (200, 5, 5, 7)


def test_a_peer_continuation_keeps_a_limit_the_router_set_lowerable_by_the_replica(two_regions):
    """As a continuation here: the peer gets what is left as an explicit limit, which its replica
    may still lower to the context left instead of refusing it."""
    home, peer, key, healthy = two_regions
    response = home.client.post("/v1/chat/completions", headers=bearer(key),
                                json={"model": MODEL, "messages": ASK, "stream": True})
    assert response.status_code == 200
    ((_, resumed),) = healthy.calls
    assert resumed.resume is not None and resumed.limit_set_by_router


def _totals(app, key_id, day):
    """The key's usage report for ``day``: every region's rows, as the rollup counts them."""
    app.recorded()
    return app.meter.store.totals(key_id=key_id, since=day, until=day, group_by=("day",))


def test_a_peer_records_its_engines_count_when_the_sender_hangs_up_before_the_ending(two_regions):
    """The sender's router hangs up (its client left) while the peer's engine generates: the
    sender only knows the events it relayed (a client that stopped reading has vLLM merge many
    steps into one), the peer's row has what its engine generated, to the token."""
    from serve_app import surfaces
    from serve_app.router import pipeline
    from test_pipeline import _request

    home, peer, home_key, healthy = two_regions
    healthy.tokens, healthy.latency_s = 1000, 0.01
    caller = home.auth.authenticate(f"Bearer {home_key}", scope="inference")
    bound = home.auth.forwarding_token(caller, "yvr-01")
    started_ms = time.time_ns() // 1_000_000 - 120_000  # the sender admitted it 2 min ago: the row's start
    body = {"model": MODEL, "messages": ASK, "max_tokens": 995, "stream": True, "polargrid_resume": {
        "token_ids": [1, 2, 3, 4, 5], "received": {"opening": 1, "content": 15}, "request_id": "a" * 32,
        "cached_tokens": 3, "record_continuation": True, "started_at_ms": started_ms}}

    async def hang_up():
        request = _request(body, bound, "/v1/chat/completions", extra_headers={"x-pg-forwarded-from": "yul-02"})
        response = await pipeline.run(peer.services, request, surfaces.CHAT)
        assert response.headers["x-pg-continuation-recorded"] == "1"
        events = response.body_iterator
        while healthy.generated < 10:
            await events.__anext__()
        await events.aclose()  # what Starlette does when the client (the sender's router) disconnects

    peer.run(hang_up)
    (row,) = peer.recorded()
    assert row["status"] == 499 and 10 <= row["completion_tokens"] < 990
    assert row["completion_tokens"] == healthy.generated and healthy.closed_early == 1  # aborted, and exact
    assert (row["continues"], row["failover_origin"], row["prompt_tokens"], row["cached_tokens"]) == (
        "a" * 32, "yul-02", 0, 0)
    assert (row["started_at_ms"], row["day"]) == (started_ms, utc_day(started_ms / 1000))
    assert row["resume_prompt_tokens"] == 10  # its prefill: the prompt and the 5 tokens
    assert home.recorded() == []  # the sender's own record is the sender's to write


def test_a_client_leaving_a_stream_a_peer_continues_leaves_each_region_its_part(two_regions):
    """This region's client leaves during the peer's part: its record is 499 with this region's
    engine's tokens, the peer's row what the peer's engine generated."""
    from serve_app import surfaces
    from serve_app.router import pipeline
    from test_pipeline import _request

    home, peer, key, healthy = two_regions
    body = {"model": MODEL, "messages": ASK, "max_tokens": 12, "stream": True}

    async def leave():
        response = await pipeline.run(home.services, _request(body, key, "/v1/chat/completions"), surfaces.CHAT)
        events, seen = response.body_iterator, b""
        while b"t7 " not in seen:  # a token of the peer's
            seen += await events.__anext__()
        await events.aclose()  # what Starlette does when the client disconnects

    home.run(leave)
    (row,), (there,) = home.recorded(), peer.recorded()
    assert (row["status"], row["prompt_tokens"], row["completion_tokens"], row["resumed_in"]) == (499, 5, 5, "yvr-01")
    assert (there["completion_tokens"], there["continues"]) == (healthy.generated, row["id"]) and healthy.generated == 7


def test_a_keys_tokens_per_minute_are_charged_the_whole_answer_a_peer_continued(two_regions):
    """The record here leaves the peer's part out; the key's rate limit here still counts it: the
    price charged at admission plus the charge at the end is the answer's 17 tokens."""
    home, peer, key, healthy = two_regions
    admitted, charged = [], []
    admit, charge = home.auth.admit, home.auth.charge

    async def admitting(principal, tokens, *args, **kwargs):
        admitted.append(tokens)
        return await admit(principal, tokens, *args, **kwargs)

    def charging(principal, tokens):
        charged.append(tokens)
        charge(principal, tokens)

    home.auth.admit, home.auth.charge = admitting, charging
    _stream(home, key)
    (row,) = home.recorded()
    assert row["prompt_tokens"] + row["completion_tokens"] == 10 and sum(admitted) + sum(charged) == 5 + 12


@pytest.mark.parametrize(("sent_s", "kept"), [(-60, True), (None, False), (86_400, False), (-86_400, False)],
                         ids=["a minute before", "none", "a day ahead", "a day before"])
def test_a_continuation_row_is_dated_by_the_senders_start_only_when_it_is_plausible(two_regions, sent_s, kept):
    """A sender dates the row as its record (the request's day); a start no stream could have
    (a day off this region's clock) is this region's own: no tokens dated into a closed month, or
    into a future day every budget until then would count."""
    home, peer, home_key, healthy = two_regions
    caller = home.auth.authenticate(f"Bearer {home_key}", scope="inference")
    bound = home.auth.forwarding_token(caller, "yvr-01")
    now_ms = time.time_ns() // 1_000_000
    sent = None if sent_s is None else now_ms + sent_s * 1000
    resume = {"token_ids": [1, 2], "received": {"opening": 1, "content": 6}, "request_id": "b" * 32,
              "record_continuation": True, **({} if sent is None else {"started_at_ms": sent})}
    response = peer.client.post("/v1/chat/completions", headers={**bearer(bound), "x-pg-forwarded-from": "yul-02"},
                                json={"model": MODEL, "messages": ASK, "max_tokens": 4, "stream": True,
                                      "polargrid_resume": resume})
    assert response.status_code == 200 and response.headers["x-pg-continuation-recorded"] == "1"
    (row,) = peer.recorded()
    if kept:
        assert row["started_at_ms"] == sent
    else:
        assert now_ms <= row["started_at_ms"] <= time.time_ns() // 1_000_000
    assert row["ended_at_ms"] >= row["started_at_ms"] and row["continues"] == "b" * 32


def test_a_peer_one_release_behind_records_nothing_and_the_sender_bills_it_all(two_regions, monkeypatch):
    """A peer that does not record its part (it ignores ``record_continuation``, sends no header):
    the sender's record is the whole answer, as before the two-row record."""
    home, peer, key, healthy = two_regions
    forward = home.services.forwarder

    def as_an_older_peer(body):
        newer = ("record_continuation", "started_at_ms")
        resume = {k: v for k, v in body["polargrid_resume"].items() if k not in newer}
        return {**body, "polargrid_resume": resume}

    opened = forward.open
    monkeypatch.setattr(forward, "open", lambda route, body, *a, **kw: opened(route, as_an_older_peer(body), *a, **kw))
    response, events = _stream(home, key)
    assert _text(events) == "".join(f"t{i} " for i in range(1, 13))
    (row,) = home.recorded()
    assert (row["status"], row["prompt_tokens"], row["completion_tokens"]) == (200, 5, 12)
    assert row["resume_prompt_tokens"] == 10
    assert peer.recorded() == []


def test_a_peer_that_ran_the_whole_answer_records_the_prompt_no_engine_here_counted(two_regions):
    """The engine here died before its first output: no prompt was counted here, the peer's engine
    prefilled it alone: its row bills the prompt (and its cache hits), the record here none."""
    home, peer, key, healthy = two_regions
    home.engine.fail_after = 0
    response, events = _stream(home, key)
    assert _text(events) == "".join(f"t{i} " for i in range(1, 13))
    (row,), (there,) = home.recorded(), peer.recorded()
    assert (row["prompt_tokens"], row["completion_tokens"]) == (0, 0)
    assert (there["prompt_tokens"], there["completion_tokens"], there["continues"]) == (5, 12, row["id"])
    (total,) = _totals(home, row["key_id"], row["day"])
    assert (total["requests"], total["prompt_tokens"], total["completion_tokens"]) == (1, 5, 12)


def home_request_id(home):
    (row,) = home.recorded()
    return row["id"]


def test_a_peer_continuation_that_breaks_ends_with_the_error_event_and_is_billed(two_regions):
    home, peer, key, healthy = two_regions
    healthy.fail_after, healthy.dies = 3, True  # the peer's engine dies too, 3 tokens in
    _, events = _stream(home, key)
    assert json.loads(events[-2][6:])["error"]["code"] == "engine_unavailable" and events[-1] == "data: [DONE]"
    assert _text(events) == "".join(f"t{i} " for i in range(1, 9))  # 5 here, 3 there, no error there
    (row,), (there,) = home.recorded(), peer.recorded()
    assert (row["status"], row["completion_tokens"]) == (503, 5)
    assert (there["status"], there["completion_tokens"], there["continues"]) == (503, 3, row["id"])  # its engine's


def test_a_messages_stream_resumes_in_a_peer_region_as_one_message_each_region_recording_its_part(two_regions):
    home, peer, key, healthy = two_regions
    response, events = _messages(home, key)
    _assert_one_whole_message(response, events)
    # The terminal event is this region's, with the resume in its timing; the usage is the whole answer.
    metadata = events[-1][1]["pg_metadata"]
    assert (metadata["region"], metadata["resumes"], metadata["resumed_in"]) == ("yul-02", 1, "yvr-01")
    (usage,) = [e["usage"] for name, e in events if name == "message_delta"]
    assert usage["output_tokens"] == 12
    ((_, resumed),) = healthy.calls
    assert resumed.resume.token_ids == (1, 2, 3, 4, 5) and resumed.body["max_tokens"] == 7
    (row,), (there,) = home.recorded(), peer.recorded()
    assert (row["status"], row["completion_tokens"], row["resumes"], row["resumed_in"]) == (200, 5, 1, "yvr-01")
    assert (there["route"], there["completion_tokens"], there["continues"]) == ("/v1/messages", 7, row["id"])


def test_a_responses_stream_resumes_in_a_peer_region_stored_once_each_region_recording_its_part(two_regions):
    home, peer, key, healthy = two_regions
    response, events = _responses(home, key)
    _assert_one_whole_response(home, key, response, events)
    assert events[-1][1]["response"]["pg_metadata"]["resumed_in"] == "yvr-01"
    (row,), (there,) = home.recorded(), peer.recorded()
    assert (row["status"], row["completion_tokens"], row["resumed_in"]) == (200, 5, "yvr-01")
    assert (there["route"], there["completion_tokens"], there["continues"]) == ("/v1/responses", 7, row["id"])


def test_only_a_peer_router_may_hand_over_a_stream(two_regions):
    home, peer, home_key, healthy = two_regions
    key, _ = peer.auth.keys.create_key(owner="alice", tier="standard")
    peer_bound = home.auth.forwarding_token(home.auth.authenticate(f"Bearer {home_key}", scope="inference"), "yvr-01")
    resume = {"token_ids": [1, 2], "received": {"opening": 1, "content": 6}, "request_id": "x" * 32}
    hop = {"x-pg-forwarded-from": "yul-02"}
    for headers in (bearer(key), {**bearer(key), **hop}, bearer(peer_bound)):
        refused = peer.client.post("/v1/chat/completions", headers=headers, json={
            "model": MODEL, "messages": ASK, "max_tokens": 4, "stream": True, "polargrid_resume": resume,
        })
        assert (refused.status_code, refused.json()["error"]["param"]) == (400, "polargrid_resume")
    charged = []
    counted = peer.auth.count_refused

    async def count_refused(caller):
        charged.append(caller.key_id)
        await counted(caller)

    peer.auth.count_refused = count_refused
    for malformed in ({**resume, "token_ids": ["1"]}, {**resume, "cached_tokens": "3"},
                      {**resume, "cached_tokens": -1}):
        refused = peer.client.post("/v1/chat/completions", headers={**bearer(peer_bound), **hop}, json={
            "model": MODEL, "messages": ASK, "max_tokens": 4, "stream": True, "polargrid_resume": malformed,
        })
        assert (refused.status_code, refused.json()["error"]["param"]) == (400, "polargrid_resume")
    assert charged == []  # a peer router's refusals: admitted, and charged, where the request came from
    refused = peer.client.post("/v1/chat/completions", headers=bearer(key), json={"model": MODEL, "messages": 5})
    assert refused.status_code == 400 and len(charged) == 1  # anyone else's: one request of its minute
    assert healthy.calls == []


def test_a_continuation_whose_engine_dies_too_goes_on_from_every_token_so_far(router_app):
    """The second failure's trailer names the tail its engine went on from and what it added (the
    deployment reads the tail the replay kept: ``replay.whole_characters`` may drop a partial
    character's tokens from it)."""
    dying, second, healthy = (FakeEngine(tokens=12, fail_after=5, dies=True),
                              FakeEngine(tokens=12, fail_after=3, dies=True), FakeEngine(tokens=12))
    app = router_app(engine=dying, replicas=(second, healthy))
    app.services.max_resumes = 2
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    response, events = _stream(app, key)
    assert _text(events) == "".join(f"t{i} " for i in range(1, 13))
    (_, last), = healthy.calls
    assert last.resume.token_ids == tuple(range(1, 9)) and last.body["max_completion_tokens"] == 4


def test_a_continuation_carries_its_session_so_that_the_pin_follows_it(two_replicas):
    """The request router pins a session where its call goes: the continuation's call names it too
    (``test_prefix_router``: the pin moves), or the next turn went back to the failed replica."""
    app, key, dying, healthy = two_replicas
    response = app.client.post("/v1/chat/completions", headers={**bearer(key), "x-session-id": "agent-7"},
                                json={"model": MODEL, "messages": ASK, "max_tokens": 12, "stream": True})
    assert response.status_code == 200
    ((_, first),), ((_, resumed),) = dying.calls, healthy.calls
    assert resumed.resume is not None and resumed.session == first.session == "h:agent-7"


def test_min_tokens_goes_on_counting_across_the_seam(two_replicas):
    """vLLM counts min_tokens over its own request's output: the continuation is asked for what is
    left of it, not for all of it again."""
    app, key, dying, healthy = two_replicas
    response, events = _stream(app, key, min_tokens=8)
    assert _text(events) == "".join(f"t{i} " for i in range(1, 13))
    ((_, resumed),) = healthy.calls
    assert resumed.body["min_tokens"] == 3 and resumed.body["max_completion_tokens"] == 7


def test_a_character_cut_at_the_seam_is_generated_again_and_billed_once(router_app):
    """The continuation drops the cut character's tokens from its tail, is given as many more to
    generate, and bills only the tokens the first engine had not: the answer's 12, not 14."""
    # Tokens 4 and 5 are a character's first bytes: the client has no text of them yet.
    dying = FakeEngine(tokens=12, fail_after=5, dies=True, held_back=(4, 5))
    healthy = FakeEngine(tokens=12, cuts_at_seam=2)
    app = router_app(engine=dying, replicas=(healthy,))
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    response, events = _stream(app, key, min_tokens=8)
    assert _text(events) == "".join(f"t{i} " for i in range(1, 13))
    assert healthy.generated == 9  # t4 and t5 again, then t6..t12
    (row,) = app.recorded()
    assert (row["status"], row["prompt_tokens"], row["completion_tokens"]) == (200, 5, 12)



def test_a_continuation_that_breaks_after_a_cut_character_bills_each_token_once(router_app):
    """Unfinished, the request is billed the engines' counts: the first's 5, and of the
    continuation's 4 (t4, t5 again, t6, t7) the 2 the first had not generated."""
    dying = FakeEngine(tokens=12, fail_after=5, dies=True, held_back=(4, 5))
    breaking = FakeEngine(tokens=12, cuts_at_seam=2, fail_after=4, dies=True)
    app = router_app(engine=dying, replicas=(breaking,))
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    response, events = _stream(app, key)
    assert _text(events) == "t1 t2 t3 t4 t5 t6 t7 " and any('"error"' in e for e in events)
    (row,) = app.recorded()
    assert row["completion_tokens"] == 7


def test_a_stream_run_again_from_its_prompt_that_breaks_again_is_billed_its_prompt(router_app):
    """Unfinished, the record takes the engines' counts: the first died before its first output
    (no prompt counted), so the prompt is the continuation's, which ran it; before, 0."""
    breaking = FakeEngine(tokens=12, fail_after=4, dies=True)
    app = router_app(engine=FakeEngine(tokens=12, fail_after=0, dies=True), replicas=(breaking,))
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    _, events = _stream(app, key)
    assert _text(events) == "t1 t2 t3 t4 " and any('"error"' in e for e in events)
    (row,) = app.recorded()
    assert (row["prompt_tokens"], row["completion_tokens"], row["resume_prompt_tokens"]) == (5, 4, 5)


# --- from a review of the seam (2026-12-06) -------------------------------------------------------
@pytest.mark.parametrize("surface, body, expected", [
    ("messages", {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, False),
    ("messages", {"output_config": {"effort": "low"}}, True),
    ("messages", {"output_config": "json"}, True),  # not an object: vLLM's model refuses it, never a crash here
    ("completions", {"prompt": "x", "logprobs": 0}, False),  # the sampled token's logprob: the replay has none
    ("completions", {"prompt": "x", "logprobs": None}, True),
    ("chat", {"response_format": {"type": "text"}}, True),  # no grammar
    ("chat", {"logprobs": False, "top_logprobs": 0}, True),
], ids=["messages-format", "messages-effort", "messages-not-object", "logprobs-0", "logprobs-none", "format-text",
        "logprobs-off"])
def test_what_a_continuation_cannot_give_is_read_from_every_surfaces_own_fields(surface, body, expected):
    from serve_app.router import resume

    assert resume.resumable(surface, {"model": MODEL, "stream": True, **body}) is expected


def test_a_messages_stream_thinking_on_a_budget_resumes_past_max_tokens_less_its_budget(router_app):
    """The budget must stay under max_tokens, which a continuation asks for what is left of: its
    body thinks adaptively (the budget was never enforced here: vllm_engine sets none)."""
    dying = FakeEngine(tokens=1030, fail_after=10, dies=True)
    healthy = FakeEngine(tokens=1030)
    app = router_app(engine=dying, replicas=(healthy,))
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    response = app.client.post("/v1/messages", headers=bearer(key), json={
        "model": MODEL, "max_tokens": 1030, "stream": True, "messages": ASK,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    })
    assert response.status_code == 200 and "overloaded_error" not in response.text
    ((_, resumed),) = healthy.calls
    assert resumed.body["max_tokens"] == 1020 and resumed.body["thinking"] == {"type": "adaptive"}
    (row,) = app.recorded()
    assert (row["status"], row["resumes"], row["completion_tokens"]) == (200, 1, 1030)


def test_a_second_failure_in_a_peers_continuation_ends_with_the_engine_failure_not_a_500(two_regions):
    home, _, key, healthy = two_regions
    home.services.max_resumes = 2
    healthy.fail_after, healthy.dies = 3, True  # the peer's engine dies too: it cannot say what it generated
    _, events = _stream(home, key)
    assert json.loads(events[-2][6:])["error"]["code"] == "engine_unavailable"
    (row,) = home.recorded()
    assert row["status"] == 503


def test_a_peer_that_ran_the_whole_answer_reports_its_cached_prompt_tokens(tmp_path, router_app):
    regions = federated_regions(tmp_path / "keys", "yul-02", "yvr-01")
    peer = router_app(auth=regions["yvr-01"], region="yvr-01", engine=FakeEngine(tokens=12, cached_tokens=4))
    home = router_app(auth=regions["yul-02"], region="yul-02", engine=FakeEngine(tokens=12, fail_after=0, dies=True),
                      peers=(Peer(region="yvr-01", endpoint="https://yvr.test"),),
                      transport=httpx.MockTransport(to_router(peer)))
    key, _ = home.auth.keys.create_key(owner="alice", tier="standard")
    _, events = _stream(home, key, stream_options={"include_usage": True})
    metadata = json.loads(next(e for e in events if e.startswith("event: pg_metadata")).split("data: ", 1)[1])
    (row,), (there,) = home.recorded(), peer.recorded()  # the peer's row bills the prompt it alone ran
    assert metadata["pg_metadata"]["cached_tokens"] == there["cached_tokens"] == 4 and row["cached_tokens"] == 0


def test_a_peer_resumes_a_long_stream_of_a_small_tier_its_token_ids_are_not_priced_as_prompt(tmp_path, router_app):
    """The continuation's body carries every token generated so far: the origin admitted (and
    bills) the request; the peer must not refuse it as a prompt over the tier's minute."""
    class RealIds(FakeEngine):
        """Token ids as a real vocabulary's (~150k: six digits), not 1, 2, 3…"""

        async def _generate(self, prompt, sampling_params, request_id, *, max_tokens, first=1):
            first = first + 150_000 if first < 150_000 else first
            async for out in super()._generate(prompt, sampling_params, request_id, max_tokens=max_tokens, first=first):
                yield out

    regions = federated_regions(tmp_path / "keys", "yul-02", "yvr-01")
    healthy = RealIds(tokens=400)
    peer = router_app(auth=regions["yvr-01"], region="yvr-01", engine=healthy)
    dying = RealIds(tokens=400, fail_after=390, dies=True)
    home = router_app(auth=regions["yul-02"], region="yul-02", engine=dying,
                      peers=(Peer(region="yvr-01", endpoint="https://yvr.test"),),
                      transport=httpx.MockTransport(to_router(peer)))
    key, _ = home.auth.keys.create_key(owner="alice", tier="tiny")  # 1,000 tokens a minute
    response, events = _stream(home, key, max_tokens=400, messages=[{"role": "user", "content": "x" * 2000}])
    assert response.status_code == 200 and not any('"error"' in e for e in events)
    assert len(healthy.calls) == 1  # ~3,100 bytes of ids on top of a ~2,100-byte request
    (row,), (there,) = home.recorded(), peer.recorded()
    assert (row["status"], row["resumes"], row["completion_tokens"], there["completion_tokens"]) == (200, 1, 390, 10)


class _Clocked(FakeEngine):
    """As vLLM's: every stream's chunks stamped with the second its generator started."""

    stamps = iter(range(1_700_000_000, 1_800_000_000, 7))

    async def _events(self, outputs, body, surface="chat"):
        created = next(self.stamps)
        async for event in super()._events(outputs, body, surface):
            yield event.replace('"created":1,', f'"created":{created},')


def _created(response) -> set[int]:
    return {json.loads(e[6:])["created"] for e in response.text.split("\n\n") if e.startswith("data: {")}


@pytest.mark.parametrize("route, extra", [("/v1/chat/completions", {"messages": ASK}),
                                          ("/v1/completions", {"prompt": "x"})], ids=["chat", "completions"])
def test_the_continuations_chunks_say_the_streams_created_as_one_streams_do(router_app, route, extra):
    """A continuation's generator starts later: its chunks would say a later second."""
    app = router_app(engine=_Clocked(tokens=12, fail_after=5, dies=True), replicas=(_Clocked(tokens=12),))
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    response = app.client.post(route, headers=bearer(key), json={"model": MODEL, "max_tokens": 12, "stream": True,
                                                                 **extra})
    assert len(_created(response)) == 1 and app.recorded()[0]["resumes"] == 1


def test_a_peers_continuation_says_the_streams_created_too(tmp_path, router_app):
    regions = federated_regions(tmp_path / "keys", "yul-02", "yvr-01")
    peer = router_app(auth=regions["yvr-01"], region="yvr-01", engine=_Clocked(tokens=12))
    home = router_app(auth=regions["yul-02"], region="yul-02", engine=_Clocked(tokens=12, fail_after=5, dies=True),
                      peers=(Peer(region="yvr-01", endpoint="https://yvr.test"),),
                      transport=httpx.MockTransport(to_router(peer)))
    key, _ = home.auth.keys.create_key(owner="alice", tier="standard")
    response, _ = _stream(home, key)
    assert len(_created(response)) == 1 and home.recorded()[0]["resumed_in"] == "yvr-01"


def test_a_resumed_streams_timing_counts_the_failed_engines_time_as_inference(router_app):
    """A dying engine reports no timing: its time (head to break) was all 'network' before, and
    the continuation's figures stood for the whole answer."""
    dying = FakeEngine(tokens=12, fail_after=5, dies=True, latency_s=0.03)  # 5 tokens: at least 150 ms
    app = router_app(engine=dying, replicas=(FakeEngine(tokens=12),))
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    _, events = _stream(app, key)
    metadata = json.loads(next(e for e in events if e.startswith("event: pg_metadata")).split("data: ", 1)[1])
    timing = metadata["pg_metadata"]
    assert timing["resumes"] == 1 and timing["inference_total_ms"] >= 150
    assert timing["network_ms"] + timing["queue_ms"] + timing["inference_total_ms"] == pytest.approx(
        timing["server_ms"], abs=0.01)

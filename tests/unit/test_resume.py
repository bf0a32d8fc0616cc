"""A stream that survives its engine (``router/resume.py``): on the real router with two replicas
(the real ``ModelServer`` on fake engines, ``router_app.py``), the first engine dies mid-stream and
the second continues from exactly its last token."""

import json

import pytest

from auth_support import MODEL, bearer
from fake_engine import FakeEngine

ASK = [{"role": "user", "content": "count"}]


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
    assert resumed.resume.text == "t1 t2 t3 t4 t5 "
    # One usage record: the customer's prompt, all 12 tokens, the resume apart.
    (row,) = app.recorded()
    assert (row["status"], row["prompt_tokens"], row["completion_tokens"]) == (200, 5, 12)
    assert (row["resumes"], row["resume_prompt_tokens"]) == (1, 5 + 5)


def test_the_usage_the_client_asked_for_counts_the_whole_answer(two_replicas):
    app, key, _, _ = two_replicas
    _, events = _stream(app, key, stream_options={"include_usage": True})
    usage = [json.loads(e[6:])["usage"] for e in events if e.startswith("data: {") and '"choices":[]' in e]
    assert usage == [{"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}]


@pytest.mark.parametrize("unfaithful", [
    {"n": 2}, {"logprobs": True}, {"tools": [{"type": "function", "function": {"name": "f"}}]},
    {"response_format": {"type": "json_object"}}, {"enable_thinking": True},
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


def test_with_no_other_replica_the_stream_ends_with_the_engine_failure_event_after_the_window(router_app):
    app = router_app(engine=FakeEngine(tokens=12, fail_after=5, dies=True))
    app.services.resume_window_s = 0.5  # the only replica answers engine_unavailable meanwhile
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    _, events = _stream(app, key)
    assert json.loads(events[-2][6:])["error"]["code"] == "engine_unavailable"
    assert _text(events) == "".join(f"t{i} " for i in range(1, 6))

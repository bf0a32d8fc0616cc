"""The session a caller names reaches the model deployment's request router (``wire.Call.session``)
by the precedence of serve_app/routing/session.py, through the real router."""

from auth_support import MODEL, bearer
from fake_engine import FakeEngine


def test_the_named_session_reaches_the_call_on_every_surface(router_app):
    app = router_app(engine=FakeEngine())
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    user = [{"role": "user", "content": "hi"}]
    chat = {"model": MODEL, "messages": user, "user": "u1"}
    app.client.post("/v1/chat/completions", json=chat, headers={**bearer(key), "x-session-id": "s1"})
    app.client.post("/v1/chat/completions", json=chat, headers=bearer(key))
    first = app.client.post("/v1/responses", json={"model": MODEL, "input": "hi"}, headers=bearer(key)).json()
    app.client.post("/v1/responses", json={"model": MODEL, "input": "more", "previous_response_id": first["id"]},
                    headers=bearer(key))
    app.client.post("/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": user,
                                          "metadata": {"user_id": "a1"}}, headers=bearer(key))
    assert [call.session for _, call in app.engine.calls] == ["h:s1", "u:u1", None, "r:" + first["id"], "a:a1"]

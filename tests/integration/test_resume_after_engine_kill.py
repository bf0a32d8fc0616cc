"""A stream survives its engine, on the real engine: the engine core under 9 greedy streams (three
each of a chat, a chat thinking with a tool list and a Responses stream) is killed half-way, and
every stream goes on from the peer region's replica (the local region runs one: its replacement
is an engine start away, so the router resumes in the peer at once; serve_app/router/resume.py,
the fault suite's ``resume`` scenario in serve_app/faults/engine_kill.py): 9 of 9 end normally
with their full token count and no error event, the text (and the reasoning) is an uninterrupted
run's of its kind (the seam checked under greedy decoding), and the ledger holds one record per
stream, with its resume, and the peer's row continuing it: the whole answer, one request.
``disruptive``: it kills the local engine (Serve replaces it, as after the engine-kill test).
Messages streams resume in the unit tests (tests/unit/test_resume.py): Anthropic's API has no
``ignore_eos``, and the local model ends every greedy answer in 3 tokens."""

import asyncio
import time

import pytest
import yaml

from serve_app.auth.database import open_database
from serve_app.auth.keys import KeyStore
from serve_app.devtools.local_regions import PEER_APP
from serve_app.devtools.serve_cli import serve_deploy
from serve_app.faults import redeploy
from serve_app.faults.engine_kill import engine_kill_resumed
from serve_app.usage.store import UsageStore

pytestmark = [pytest.mark.integration, pytest.mark.disruptive]
STREAMS, MAX_TOKENS = 9, 200  # three of each kind


def _deploy(config: dict, serve_app: dict) -> None:
    deployed_at = time.time()
    deploy = serve_deploy(config, serve_app["dashboard"])
    assert deploy.returncode == 0, deploy.stderr
    assert asyncio.run(redeploy.wait_settled(PEER_APP, deployed_at - 0.5, replaced=None, timeout_s=300)) is not None


@pytest.fixture
def roomy_peer(serve_app, peer_loaded):
    """The peer region's model runs one request and queues one (easy to overload, for the
    failover tests): room for the 8 continuations, a Serve knob its running replica keeps."""
    original = yaml.safe_load(serve_app["deployed_path"].read_text())

    def roomy(settings: dict) -> None:
        settings["models"][0].update(max_ongoing_requests=16, max_queued_requests=16)

    _deploy(redeploy.with_region(original, PEER_APP, roomy), serve_app)
    yield
    _deploy(original, serve_app)


def test_an_engine_killed_mid_stream_leaves_every_stream_whole_and_billed_once(serve_app, roomy_peer):
    keys = KeyStore(serve_app["auth"].key_store(), cache_ttl_s=0)
    key, record = keys.create_key(owner="it-resume", tier="standard")  # every region: the peer may continue
    result = asyncio.run(engine_kill_resumed(serve_app["base_url"], key, serve_app["app_name"],
                                             streams=STREAMS, max_tokens=MAX_TOKENS))
    print(result)  # the figures docs/reliability.md reports (the seam's pause)
    assert result["killed_the_reference_replica"] and result["replicas"] == 1
    assert result["streams_by_outcome"] == {"200 done": STREAMS}  # no error event, one [DONE] each
    assert result["resumed"] == STREAMS and result["resumed_in"] == {"peer": STREAMS}
    assert result["killed_mid_stream"] == STREAMS  # content on both sides of each seam
    assert result["full_length"] == STREAMS  # as many tokens as an uninterrupted run of its kind
    assert result["same_text_as_uninterrupted"] == STREAMS  # no gap and no repeat at the seam
    kinds = result["by_kind"]
    # Three of each kind. The thinking streams' seam is inside the reasoning, which goes on as
    # reasoning (the continuation's parser replayed to where the first one stood); the Responses
    # streams' events stay numbered 0, 1, 2… across it.
    assert all(kind["streams"] == kind["same_as_uninterrupted"] == STREAMS // 3 for kind in kinds.values())
    assert kinds["chat thinking with tools"]["reference_reasoning_chars"] > 0
    assert result["responses_numbered"] == STREAMS // 3
    # One record per stream (and each reference run's) here, with what this region's engine did,
    # and the peer's row continuing each resumed one with what its engine did: the whole answer.
    usage = UsageStore(open_database(serve_app["auth"].key_store()))
    deadline = time.monotonic() + 15
    while True:
        with usage.database.connect() as db:
            rows = [dict(r) for r in db.execute("SELECT * FROM usage_records WHERE key_id = ?", (record.key_id,))]
        if len(rows) >= 2 * STREAMS + len(kinds) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(rows) == 2 * STREAMS + len(kinds)
    here = {r["id"]: r for r in rows if r["continues"] is None}
    resumed = [r for r in here.values() if r["resumes"]]
    continued = {r["continues"]: r for r in rows if r["continues"] is not None}
    assert len(resumed) == STREAMS and {r["region"] for r in here.values()} == {"local"}
    assert set(continued) == {r["id"] for r in resumed} and {r["region"] for r in continued.values()} == {"peer"}
    assert all(r["status"] == 200 and r["resumed_in"] == "peer" for r in resumed)
    assert all(r["completion_tokens"] + continued[r["id"]]["completion_tokens"] == MAX_TOKENS for r in resumed)
    assert all(continued[r["id"]]["resume_prompt_tokens"] > r["prompt_tokens"] for r in resumed)  # prompt + tail
    (total,) = usage.totals(key_id=record.key_id, since=min(r["day"] for r in rows),
                            until=max(r["day"] for r in rows), group_by=("month",))
    assert total["requests"] == STREAMS + len(kinds)  # a continuation is no request of its own

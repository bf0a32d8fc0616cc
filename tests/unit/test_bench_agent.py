"""``serve-app bench-agent`` (serve_app/bench/agent.py, agent_report.py) against a fake server of
two replicas: a prefix-arm session always lands on its own replica, a default-arm request on a
random one, and a replica reports as cached whatever it served of that session before."""

import asyncio
import json
import random

import httpx
from typer.testing import CliRunner

from serve_app.bench import agent, agent_report
from serve_app.routing.session import SESSION_HEADER, compare_arm, session_key


class FakeAgentServer:
    """``comparing``: the deployment routes each arm by its own policy (compare_with_default);
    off, every session goes by prefix affinity whatever arm the benchmark meant it for."""

    def __init__(self, comparing: bool = True):
        self.comparing = comparing
        self.seen: list[tuple[str, int, dict]] = []  # (session, messages, body) in arrival order
        self.served: dict[tuple[str, str], int] = {}  # (replica, session) → prompt tokens it holds
        self.rng = random.Random(7)

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sid = request.headers.get(SESSION_HEADER, "")
        self.seen.append((sid, len(body["messages"]), body))
        await asyncio.sleep(0)  # let other sessions' requests in, as a busy server would
        arm = compare_arm(session_key({SESSION_HEADER: sid}, {})) if sid and self.comparing else "prefix"
        replica = f"r{hash(sid) % 2}" if arm == "prefix" else self.rng.choice(["r0", "r1"])
        prompt = len(json.dumps(body["messages"]) + json.dumps(body["tools"])) // 4
        cached = self.served.get((replica, sid), 0)
        self.served[(replica, sid)] = prompt
        turn = len(body["messages"]) // 2
        events = [
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"index": 0, "delta": {"content": f"answer {sid} {turn}"}}]},
            {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": 5,
                                      "prompt_tokens_details": {"cached_tokens": cached}}},
        ]
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events)
        routing = {"policy": "prefix_affinity", "reason": "session"} if arm == "prefix" else {"policy": "default", "reason": "default"}
        metadata = {"pg_metadata": {"replica": replica, "routing": routing}}
        text += f"event: pg_metadata\ndata: {json.dumps(metadata)}\n\ndata: [DONE]\n\n"
        return httpx.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"})


async def _no_wait(_seconds: float) -> None:
    await asyncio.sleep(0)


WORKLOAD = agent.AgentWorkload("qwen", sessions=4, turns=3, system_tokens=300, user_tokens=10, max_tokens=5,
                               think_s=0, stagger_s=0)


def run(server: FakeAgentServer, **kwargs):
    return asyncio.run(agent.bench_agent("http://127.0.0.1:9", WORKLOAD, transport=httpx.MockTransport(server),
                                         sleep=_no_wait, quiet_s=0, **kwargs))


def test_each_turn_sends_the_whole_history_with_the_last_answer_and_sessions_interleave():
    server = FakeAgentServer()
    result = run(server, rounds=1)
    by_session: dict[str, list[dict]] = {}
    for sid, _, body in server.seen:
        by_session.setdefault(sid, []).append(body)
    assert len(by_session) == 4 and all(len(bodies) == 3 for bodies in by_session.values())
    for sid, bodies in by_session.items():
        assert [len(b["messages"]) for b in bodies] == [2, 4, 6]
        assert bodies[2]["messages"][:4] == bodies[1]["messages"]  # the history grows, never changes
        assert bodies[1]["messages"][2] == {"role": "assistant", "content": f"answer {sid} 1"}
    # One context for the batch: every session's system prompt and tools are the same.
    assert len({json.dumps([b["messages"][0], b["tools"]]) for bodies in by_session.values() for b in bodies}) == 1
    order = [sid for sid, _, _ in server.seen]
    assert order[:4] != [order[0]] * 4, "sessions ran one after another, not interleaved"
    assert len(result["turns"]) == 12 and all(t["ok"] for t in result["turns"])


def test_the_shared_context_is_about_the_asked_size_and_new_for_every_batch():
    system, tools = agent.shared_context("n1", 2000)
    size = len(system) + len(json.dumps(tools))
    assert 2000 * 4 <= size < 2000 * 4 + 300
    assert agent.shared_context("n2", 2000)[0] != system


def test_with_their_own_context_sessions_share_no_prefix():
    server = FakeAgentServer()
    asyncio.run(agent.bench_agent("http://127.0.0.1:9", agent.AgentWorkload(**{**WORKLOAD.__dict__, "context": "own"}),
                                  transport=httpx.MockTransport(server), sleep=_no_wait, quiet_s=0, rounds=1))
    systems = {sid: body["messages"][0]["content"] for sid, _, body in server.seen}
    assert len(set(systems.values())) == len(systems) == 4  # one context per session, kept over its turns


def test_routing_runs_both_arms_interleaved_and_the_prefix_arm_keeps_its_sessions_warm():
    server = FakeAgentServer()
    result = run(server, rounds=2, compare=True)
    assert [(b["round"], b["arm"]) for b in result["batches"]] == [(0, "prefix"), (0, "default"), (1, "default"), (1, "prefix")]
    for turn in result["turns"]:  # each arm's sessions are ones the deployment gives that arm
        assert compare_arm(session_key({SESSION_HEADER: turn["session"]}, {})) == turn["arm"]
    systems = {b["messages"][0]["content"][:40] for _, _, b in server.seen}
    assert len(systems) == 4  # a fresh context per batch: nothing inherited from another batch
    summary = agent_report.summarize(result)
    ours, default = summary["arms"]["prefix"], summary["arms"]["default"]
    assert ours["same_replica_as_previous_turn"] == 1.0 and ours["cached_of_ideal_turns_2_plus"] == 1.0
    assert ours["routed_by_affinity_turns_2_plus"] == 1.0 and default["routed_by_affinity_turns_2_plus"] == 0.0
    assert (ours["routing_policies"], default["routing_policies"]) == (["prefix_affinity"], ["default"])
    assert agent_report.comparison_problem(summary) is None
    assert default["cache_hit_ratio_turns_2_plus"] < ours["cache_hit_ratio_turns_2_plus"]
    assert sorted(ours["ttft_ms_by_turn"]) == [1, 2, 3] and ours["ttft_ms_by_turn"][1]["cache_hit_ratio"] == 0
    assert ours["aggregate_tokens_per_s"] > 0 and ours["completion_tokens"] == 2 * 4 * 3 * 5
    assert set(summary["prefix_vs_default"]) == {"ttft_p50_turns_2_plus", "aggregate_tokens_per_s"}
    assert "TTFT p50 / p95 by turn" in agent_report.markdown({"summary": summary, "meta": {"workload": WORKLOAD.__dict__}})


def test_a_failed_turn_is_counted_by_reason_and_the_session_goes_on():
    server = FakeAgentServer()
    calls = {"n": 0}

    async def flaky(request):
        calls["n"] += 1
        if calls["n"] == 2:
            return httpx.Response(503, json={"error": {"message": "busy"}})
        return await server(request)

    result = asyncio.run(agent.bench_agent("http://127.0.0.1:9", WORKLOAD, transport=httpx.MockTransport(flaky),
                                           sleep=_no_wait, quiet_s=0, rounds=1))
    summary = agent_report.summarize(result)["arms"]["ours"]
    assert (summary["turns"], summary["errors"], summary["error_reasons"]) == (12, 1, {"HTTP 503": 1})


def test_the_command_writes_its_files_and_refuses_routing_without_session_ids(tmp_path, monkeypatch):
    server = FakeAgentServer()
    real = agent_report.bench_agent

    def with_fake_server(url, workload, **kwargs):
        return real(url, workload, **{**kwargs, "transport": httpx.MockTransport(server), "sleep": _no_wait})

    monkeypatch.setattr(agent_report, "bench_agent", with_fake_server)
    from serve_app.cli import app

    runner = CliRunner()
    common = ["bench-agent", "--sessions", "2", "--turns", "2", "--system-tokens", "100", "--region", "local",
              "--quiet-s", "0", "--out-dir", str(tmp_path)]
    done = runner.invoke(app, common + ["--routing", "--rounds", "1"])
    assert done.exit_code == 0, done.output
    (written,) = tmp_path.glob("local-*/qwen-3.6-35b-a3b/agent_bench.json")
    document = json.loads(written.read_text())
    assert set(document["summary"]["arms"]) == {"prefix", "default"}
    assert (written.parent / "agent_bench.md").exists()
    refused = runner.invoke(app, common + ["--routing", "--no-session-header"])
    assert refused.exit_code == 2 and "x-session-id" in refused.output
    # A deployment without compare_with_default routed both arms by our policy: nothing was compared.
    server.comparing = False
    uncompared = runner.invoke(app, common + ["--routing", "--rounds", "1"])
    assert uncompared.exit_code == 1 and "compare_with_default" in uncompared.output

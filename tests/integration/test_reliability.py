"""The fault suite's short version (``serve-app faults --quick``) against the session's service.

Each test runs one scenario and asserts what docs/reliability.md promises. The engine kill is
``disruptive``: it runs after every other test (conftest.py) and waits until the service answers
again before it ends. The redeploys: test_redeploy.py.
"""

import asyncio
import glob
import os

import httpx
import pytest

from serve_app.app import LOCAL_RAY_ENV
from serve_app.faults import cluster, fuzz, scenarios
from serve_app.faults.cli import SIZES
from serve_app.faults.engine_kill import engine_kill
from serve_app.runtime.cpus import gateway_cpus, host_cpus

pytestmark = pytest.mark.integration
QUICK = SIZES["quick"]
# How much a router's memory may grow across the suite (the bound).
ROUTER_GROWTH_MIB = 50


@pytest.fixture(scope="module")
def router_memory_before(serve_app):
    return {r.pid: r.rss_mib for r in cluster.routers(serve_app["app_name"])}


def _router_log_tail(app: str) -> dict[str, int]:
    """Where each router replica's log ends now (its ERROR lines after this are the test's)."""
    import ray

    logs = os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs", "serve")
    return {path: os.path.getsize(path) for path in glob.glob(os.path.join(logs, f"replica_{app}_Router_*.log"))}


def _errors_since(tails: dict[str, int]) -> list[str]:
    lines = []
    for path, offset in tails.items():
        with open(path, errors="replace") as log:
            log.seek(offset)
            lines += [line for line in log if " ERROR " in line or "Traceback" in line]
    return lines


def test_overload_sheds_at_once_and_health_stays_200_busy(serve_app, base_url, dev_key, router_memory_before):
    result = asyncio.run(scenarios.overload(base_url, dev_key, serve_app["app_name"], streams=QUICK["overload"],
                                            max_tokens=QUICK["overload_tokens"]))
    assert result["hung"] == 0
    assert result["shed_with_retry_after"] == result["shed"]
    admitted = {label: n for label, n in result["by_outcome"].items() if label.startswith("200")}
    assert set(admitted) == {"200 done"}, result["by_outcome"]
    assert set(result["by_outcome"]) <= {"200 done", "503 json overloaded"}, result["by_outcome"]
    # 120 long streams for 32 slots and 2 × 64 queue places. How many Serve sheds depends on how
    # its routers count their queues at that moment (docs/reliability.md); every one it sheds is a
    # 503 with Retry-After, and the abandoned streams are aborted in the engine.
    held = result["held_full"]
    # A held stream either is shed, or waits or streams until the clients leave; one admitted may
    # also run to its end first where the engine is fast (2,000 tokens at ~140 tok/s a stream on a
    # fast host, within the 3 s wait and five single requests that may each wait 5 s for a place).
    assert set(held["by_outcome"]) <= {"503 json overloaded", "200 done"}, held
    assert held["shed_with_retry_after"] == held["shed"]
    assert result["abandoned_unfinished_after"]["+10s"] == 0, result
    health = result["health"]["by_answer"]
    assert set(health) <= {"200 ok", "200 busy"}, health  # never 503 while merely busy
    # The chat model's slots were all taken; the region says "busy" only when the embedding
    # model beside it is too, so it may have stayed "ok" (docs/api.md, "Health").
    assert result["health"]["busy_models"].get("qwen-3.6-35b-a3b"), result["health"]


def test_a_client_that_leaves_frees_the_engine_and_logs_no_error(serve_app, base_url, dev_key, router_memory_before):
    app = serve_app["app_name"]
    tails = _router_log_tail(app)
    result = asyncio.run(scenarios.disconnect(base_url, dev_key, app, streams=QUICK["disconnect"]))
    assert result["by_outcome"] == {"200 left": QUICK["disconnect"]}
    assert result["unfinished_after"]["+10s"] == result["unfinished_before"] == 0
    assert _errors_since(tails) == []  # a normal disconnect is INFO (499), not a page


def test_soak_has_no_errors(serve_app, base_url, dev_key, router_memory_before):
    result = asyncio.run(
        scenarios.soak(base_url, dev_key, serve_app["app_name"], streams=QUICK["soak"], duration_s=QUICK["soak_s"])
    )
    assert result["requests"] > 0
    assert result["errors"] == 0 and result["shed"] == 0, result["by_outcome"]  # 16 streams fit


def test_hostile_bodies_get_our_4xx_and_never_a_5xx(base_url, dev_key):
    result = fuzz.hostile_bodies(base_url, dev_key)
    assert result["server_errors"] == [] and result["hung"] == [] and result["unshaped"] == [], result["answers"]
    assert result["answers"]["nested 10,000 deep"] == "400"
    assert result["answers"]["n 1000"] == "400"
    assert result["answers"]["max_tokens 2^70"] == "400"
    # The parser's refusals (400 invalid_json), on every route that reads a body.
    for name in ("max_tokens of 5,000 digits", "a lone surrogate in content", "model twice", "a UTF-8 BOM",
                 "token: a lone surrogate as api_key", "messages: max_tokens of 5,000 digits",
                 "responses: a lone surrogate in metadata"):
        assert result["answers"][name] == "400", name


def test_schemathesis_over_the_published_schema_finds_no_5xx(base_url, dev_key):
    result = fuzz.schemathesis_run(base_url, dev_key, max_examples=QUICK["fuzz_examples"], max_time_s=QUICK["fuzz_s"])
    assert result["cases"] > 0, result["schemathesis_tail"]
    assert result["server_errors"] == 0, result


def _thread_masks(pid: int) -> set[frozenset[int]]:
    masks = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            masks.add(frozenset(os.sched_getaffinity(int(tid))))
        except ProcessLookupError:  # the thread ended meanwhile
            continue
    return masks


def test_on_one_host_the_gateway_keeps_off_the_engine_workers_cores(serve_app):
    """The session runs with LOCAL_RAY_ENV, which names the host's last CPU (runtime/cpus.py):
    every thread of the router and model replica actors is there; the engine core, born before
    its replica pinned itself, had the whole host, so vLLM bound its worker as it would, and
    then went beside its worker: every thread of it on the worker's CPUs, none on the gateway's
    (where its CPUs were the worker's and the gateway's alone, as on a 2-core host; else it keeps
    what it was born with)."""
    gateway = gateway_cpus(LOCAL_RAY_ENV)
    if gateway is None:
        pytest.skip("nothing to keep off: a one-core host, or SERVE_APP_GATEWAY_CPUS set empty")
    app = serve_app["app_name"]
    models = cluster.model_replicas(scenarios.model_app(app), scenarios.MODEL_DEPLOYMENT)
    actors = [*cluster.routers(app), *models]
    assert len(actors) >= 2
    for actor in actors:
        assert _thread_masks(actor.pid) == {frozenset(gateway)}, actor.deployment
    core = models[0].engine_core()
    assert core is not None
    workers = [child for child in core.children(recursive=True) if child.name().startswith("VLLM::Worker")]
    worker_cpus = frozenset().union(*(mask for worker in workers for mask in _thread_masks(worker.pid)))
    assert worker_cpus and worker_cpus.isdisjoint(gateway)
    if host_cpus() - worker_cpus <= gateway:
        assert _thread_masks(core.pid) == {worker_cpus}
    else:
        assert os.sched_getaffinity(core.pid) > gateway


def test_trace_is_405_with_allow(base_url):
    response = httpx.request("TRACE", f"{base_url}/v1/chat/completions")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert response.json()["error"]["code"] == "method_not_allowed"


@pytest.mark.disruptive
def test_an_engine_kill_ends_streams_with_engine_unavailable_and_the_model_comes_back(
    serve_app, base_url, dev_key, router_memory_before
):
    app = serve_app["app_name"]
    result = asyncio.run(engine_kill(base_url, dev_key, app, streams=QUICK["kill"]))
    assert result["streams_by_outcome"] == {"200 error_event engine_unavailable": QUICK["kill"]}, result
    assert result["first_200_after_s"] is not None, result
    # The chat model it killed says "recovering" while Serve replaces its replica, never "failed";
    # it is the region's required model, so /health is 503 meanwhile though the embedding model
    # serves (docs/reliability.md, "What /health says"), and 200 again once it serves.
    timeline = result["health_timeline"]
    model_states = {entry["states"].get(scenarios.MODEL_ID) for entry in timeline}
    assert "recovering" in model_states and "failed" not in model_states, timeline
    down = [entry for entry in timeline if entry["states"].get(scenarios.MODEL_ID) != "loaded"]
    answers_while_down = {(entry["code"], entry["status"]) for entry in down}
    assert down and answers_while_down <= {(503, "recovering"), (503, "unavailable")}, timeline
    assert result["health_steady"] and (timeline[-1]["code"], timeline[-1]["status"]) == (200, "ok"), timeline
    codes = {answer["code"] for answer in result["answers_meanwhile"]}
    assert codes <= {None, "engine_unavailable", "model_recovering", "hung"}, result["answers_meanwhile"]
    assert not result["routers_imported_vllm"]
    for router in cluster.routers(app):
        assert router.rss_mib < router_memory_before.get(router.pid, router.rss_mib) + ROUTER_GROWTH_MIB

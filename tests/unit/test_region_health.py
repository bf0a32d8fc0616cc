"""``GET /health`` as Route 53's health check reads it (serve_app/router/operations.py ``health``):
a region stays in the global name while it can serve what it is there for. The real router on a
fake engine; Serve's view of each model's replicas is set by the test (``FakeServe``)."""

from pathlib import Path

import pytest
import yaml

from auth_support import MODEL, bearer
from serve_app.auth.keys import SCOPE_ADMIN, SCOPE_INFERENCE, SCOPE_OPERATOR
from serve_app.config import ModelDeploymentArgs
from serve_app.regions.schema import RegionModel, parse_region

EMBED = "qwen-3-embedding-0.6b"
REQUIRED_CHAT = {MODEL: {"region_health": "required"}}


def _health(app) -> tuple[int, dict]:
    app.run(app.services.states.refresh)  # what Serve says now, as the next refresh would read it
    response = app.client.get("/health")
    return response.status_code, response.json()


def _recovering(app, model: str) -> None:
    """Serve is replacing the model's only replica (its engine died): none runs, the deployment
    is UNHEALTHY."""
    app.serve.stop(model)
    app.serve.statuses[f"model-{model}"] = "UNHEALTHY"


def test_a_region_whose_required_model_is_down_leaves_the_global_name_though_another_serves(router_app):
    app = router_app(models=(MODEL, EMBED), model_settings=REQUIRED_CHAT)
    assert _health(app)[0] == 200
    _recovering(app, MODEL)
    code, body = _health(app)
    assert (code, body["status"], body["required"]) == (503, "recovering", [MODEL])
    assert body["models"] == {MODEL: False, EMBED: True} and body["states"][MODEL] == "recovering"
    app.serve.statuses[f"model-{MODEL}"] = "DEPLOY_FAILED"  # its replacement cannot start
    code, body = _health(app)
    assert (code, body["status"], body["states"][MODEL]) == (503, "unavailable", "failed")
    app.serve.statuses.clear()  # no replica, none failing: loading (a redeploy, a new region)
    code, body = _health(app)
    assert (code, body["status"], body["states"][MODEL]) == (503, "unavailable", "loading")


def test_an_optional_model_down_keeps_the_region_in_and_says_degraded(router_app):
    app = router_app(models=(MODEL, EMBED), model_settings=REQUIRED_CHAT)
    _recovering(app, EMBED)
    code, body = _health(app)
    assert (code, body["status"]) == (200, "degraded") and body["models"] == {MODEL: True, EMBED: False}


def test_a_model_an_admin_unloads_is_no_degradation_while_it_drains_or_after(router_app):
    app = router_app(models=(MODEL, EMBED), model_settings=REQUIRED_CHAT)
    app.serve.write(f"llm-{EMBED}", f"model-{EMBED}", "cold", "admin")
    code, body = _health(app)  # its replica still finishes what it took
    assert (code, body["status"], body["states"][EMBED]) == (200, "ok", "unloading")
    app.serve.stop(EMBED)
    code, body = _health(app)
    assert (code, body["status"], body["states"][EMBED]) == (200, "ok", "cold")


def test_the_required_model_cannot_be_unloaded_through_the_api(router_app):
    """Unloading it would turn /health 503 and take the region out of the global name for every
    tenant: an admin call refuses it; the region's settings can make it optional first."""
    app = router_app(models=(MODEL, EMBED), model_settings=REQUIRED_CHAT)
    key, _ = app.auth.keys.create_key(owner="ops", tier="standard",
                                      scopes=(SCOPE_INFERENCE, SCOPE_ADMIN, SCOPE_OPERATOR))
    refused = app.client.post("/v1/models/unload", json={"model": MODEL}, headers=bearer(key))
    error = refused.json()["error"]
    assert (refused.status_code, error["code"], error["param"]) == (409, "model_required", "model")
    assert "region_health" in error["message"] and app.serve.kv == {}  # nothing was written
    assert _health(app)[0] == 200
    allowed = app.client.post("/v1/models/unload", json={"model": EMBED}, headers=bearer(key))
    assert allowed.status_code in (200, 202), allowed.text
    loaded = app.client.post("/v1/models/load", json={"model": MODEL}, headers=bearer(key))
    assert loaded.status_code == 200 and loaded.json()["state"] == "loaded"  # a load is still an admin's


def test_who_may_not_unload_learns_nothing_of_which_model_is_required(router_app):
    app = router_app(models=(MODEL, EMBED), model_settings=REQUIRED_CHAT)
    user, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    other_admin, _ = app.auth.keys.create_key(owner="ops", tier="standard", models=(EMBED,),
                                              scopes=(SCOPE_INFERENCE, SCOPE_ADMIN))
    for key, refusal in ((user, 403), (other_admin, 403)):
        refused = app.client.post("/v1/models/unload", json={"model": MODEL}, headers=bearer(key))
        assert refused.status_code == refusal and refused.json()["error"]["code"] != "model_required"


def test_a_degraded_region_says_so_before_it_says_busy(router_app):
    app = router_app(models=(MODEL, EMBED), model_settings=REQUIRED_CHAT)
    facts = app.services.in_flight
    for _ in range(facts.load(MODEL, 1)["slots"]):  # every slot of the chat model's one replica taken
        facts.begin(MODEL)
    _recovering(app, EMBED)
    code, body = _health(app)
    assert (code, body["status"], body["load"][MODEL]["busy"]) == (200, "degraded", True)


def test_health_says_busy_but_not_how_many_requests_are_in_flight(router_app):
    """/health needs no credential: exact counts polled would read every tenant's traffic here."""
    app = router_app(models=(MODEL, EMBED))
    for _ in range(3):
        app.services.in_flight.begin(MODEL)
    code, body = _health(app)
    assert code == 200 and body["load"] == {MODEL: {"busy": False, "shedding": False},
                                            EMBED: {"busy": False, "shedding": False}}


def test_with_no_model_required_the_region_serves_while_any_model_does(router_app):
    app = router_app(models=(MODEL, EMBED))
    _recovering(app, MODEL)
    code, body = _health(app)
    assert (code, body["status"], body["required"]) == (200, "degraded", [])
    _recovering(app, EMBED)
    code, body = _health(app)
    assert (code, body["status"]) == (503, "recovering")


def test_marking_a_model_required_is_applied_by_a_router_reconfigure(router_app):
    """A ``serve deploy`` that changes ``region_health`` reaches the running router as a new
    user_config (tests/unit/test_serve_layout.py: it restarts nothing)."""
    app = router_app(models=(MODEL, EMBED))
    _recovering(app, MODEL)
    assert _health(app)[0] == 200
    args = app.services.args
    models = [ModelDeploymentArgs(id=m.id, region_health="required" if m.id == MODEL else "optional")
              for m in args.models]
    changed = app.run(app.services.reconfigure, args.model_copy(update={"models": models}), lambda model: None)
    assert changed == ["models"]
    code, body = _health(app)
    assert (code, body["status"], body["required"]) == (503, "recovering", [MODEL])


def test_a_region_whose_routers_cannot_read_the_key_registry_leaves_the_global_name(router_app, monkeypatch):
    """Every credential not cached here would be refused (503 key_registry_unavailable, never failed
    over): /health says so while the models serve, and serves again once the registry reads."""
    from contextlib import contextmanager

    from serve_app.auth.database import RegistryUnavailable

    app = router_app(models=(MODEL, EMBED), model_settings=REQUIRED_CHAT)
    code, body = _health(app)
    assert (code, body["status"], body["registry"]) == (200, "ok", "readable")
    probe = app.auth.registry
    monkeypatch.setattr(probe, "PROBE_EVERY_S", 0)  # every check probes
    database = probe.database
    reads = database.connect

    @contextmanager
    def away(read: bool = False):
        raise RegistryUnavailable("cannot reach the key registry at host=primary")
        yield

    monkeypatch.setattr(database, "connect", away)
    code, body = _health(app)
    assert (code, body["status"], body["registry"]) == (503, "registry_unavailable", "unreadable")
    assert body["models"] == {MODEL: True, EMBED: True}
    _recovering(app, MODEL)  # a required model down is said first: it is what keeps the region out
    assert _health(app)[1]["status"] == "recovering"
    app.serve.replicas[f"model-{MODEL}"] = {"RUNNING": 1}  # its replacement serves
    app.serve.statuses.clear()
    monkeypatch.setattr(database, "connect", reads)
    code, body = _health(app)
    assert (code, body["status"], body["registry"]) == (200, "ok", "readable")


REGION_FILES = sorted((Path(__file__).resolve().parents[2] / "regions").glob("*.yaml"))


@pytest.mark.parametrize("path", REGION_FILES, ids=lambda path: path.name)
def test_every_region_file_holds_its_health_to_its_main_model(path):
    """A region file without it would fall back to "any model serves": an embedding model alone
    would keep the region in the global name (docs/reliability.md, "What /health says")."""
    region = parse_region(yaml.safe_load(path.read_text()))
    assert [model.region_health for model in region.models][0] == "required"


def test_a_required_model_cannot_start_cold():
    with pytest.raises(ValueError, match="region_health: required"):
        ModelDeploymentArgs(id=MODEL, region_health="required", initial_state="cold")
    with pytest.raises(ValueError, match="region_health: required needs state: loaded"):
        RegionModel(id=MODEL, replicas={"min": 1, "max": 1}, region_health="required", state="cold")

"""What an admin may see and do (issue #22, item 6; docs/auth.md, "Admin scopes"): an admin
without the operator scope manages its own owner's keys only (list, revoke, usage), however
unrestricted its models and regions, and another owner's key looks like a key that does not
exist. Tested on the Authenticator and the usage report the routes call, against a real registry
file."""

import pytest

from serve_app.auth import admin
from serve_app.auth.keys import SCOPE_ADMIN, SCOPE_INFERENCE, SCOPE_OPERATOR, KeyStore
from serve_app.errors import APIError
from serve_app.usage.report import usage_report
from serve_app.usage.store import UsageStore
from tests.unit.auth_support import DEV_KEY, MODEL, authenticator, bearer
from tests.unit.test_usage_store import usage_record

BOTH = (SCOPE_INFERENCE, SCOPE_ADMIN)
OPERATOR = (SCOPE_INFERENCE, SCOPE_ADMIN, SCOPE_OPERATOR)


@pytest.fixture
def auth(tmp_path):
    return authenticator(tmp_path)


@pytest.fixture
def keys(auth):
    """Two owners' keys and an operator: acme's admin is scoped to one model, globex's to one
    region, initech's to nothing (every model and region) — an owner admin all the same."""

    def create(owner, **claims):
        raw, record = auth.keys.create_key(owner=owner, tier="standard", **claims)
        return raw, record.key_id

    made = {
        "operator": create("platform", scopes=OPERATOR),
        "initech_admin": create("initech", scopes=BOTH),
        "acme_admin": create("acme", models=(MODEL,), scopes=BOTH),
        "acme": create("acme"),
        "globex": create("globex"),
        "globex_admin": create("globex", regions=("local",), scopes=BOTH),  # all models, one region
    }
    return made


def _caller(auth, keys, name, scope=SCOPE_ADMIN):
    return auth.authenticate(bearer(keys[name][0])["Authorization"], scope=scope)


def _ids(listing) -> set[str]:
    return {row["key_id"] for row in listing}


def test_an_admin_scoped_to_one_model_lists_only_its_owners_keys(auth, keys):
    acme = _ids(auth.list_keys(_caller(auth, keys, "acme_admin")))
    assert acme == {keys["acme_admin"][1], keys["acme"][1]}
    everyone = _ids(auth.list_keys(_caller(auth, keys, "operator")))
    assert everyone == {key_id for _, key_id in keys.values()}


def test_an_admin_scoped_to_one_region_is_its_owners_admin_too(auth, keys):
    globex = _ids(auth.list_keys(_caller(auth, keys, "globex_admin")))
    assert globex == {keys["globex"][1], keys["globex_admin"][1]}


def test_an_admin_of_every_model_and_region_is_still_only_its_owners_admin(auth, keys):
    """A customer's admin key made without --model or --region listed, revoked and read the usage
    of every tenant's keys, and could unload the region's models: that took the operator scope."""
    initech = _caller(auth, keys, "initech_admin")
    assert not admin.manages_every_key(initech)
    assert _ids(auth.list_keys(initech)) == {keys["initech_admin"][1]}
    assert auth.revoke_key(initech, keys["globex"][1]) is False
    assert admin.usage_filter(initech, "*").owner == "initech"
    assert admin.manages_every_key(_caller(auth, keys, "operator"))


def test_the_operator_scope_needs_the_admin_scope(tmp_path):
    with pytest.raises(ValueError, match="needs the admin scope"):
        KeyStore(tmp_path / "keys.sqlite3", create=True).create_key(
            owner="x", tier="standard", scopes=(SCOPE_INFERENCE, SCOPE_OPERATOR))


def test_an_owner_admin_cannot_revoke_another_owners_key_and_it_looks_not_found(auth, keys):
    acme_admin = _caller(auth, keys, "acme_admin")
    assert auth.revoke_key(acme_admin, keys["globex"][1]) is False
    assert auth.revoke_key(acme_admin, "000000000000") is False  # the same answer as no such key
    assert _caller(auth, keys, "globex", SCOPE_INFERENCE).owner == "globex"  # still works
    assert auth.revoke_key(acme_admin, keys["acme"][1]) is True  # its own owner's key
    with pytest.raises(APIError) as refused:
        _caller(auth, keys, "acme", SCOPE_INFERENCE)
    assert refused.value.code == "api_key_revoked"
    assert auth.revoke_key(_caller(auth, keys, "operator"), keys["globex"][1]) is True


def test_the_local_dev_key_is_an_operator(auth, keys):
    dev = auth.authenticate(f"Bearer {DEV_KEY}", scope=SCOPE_ADMIN)
    assert admin.manages_every_key(dev)
    assert _ids(auth.list_keys(dev)) == {key_id for _, key_id in keys.values()}


def test_without_the_admin_scope_nothing_is_managed(auth, keys):
    acme = _caller(auth, keys, "acme", SCOPE_INFERENCE)
    for attempt in (lambda: auth.list_keys(acme), lambda: auth.revoke_key(acme, keys["acme"][1])):
        with pytest.raises(APIError) as refused:
            attempt()
        assert (refused.value.status, refused.value.code) == (403, "insufficient_scope")
    with pytest.raises(APIError):
        admin.usage_filter(acme, "*")


def _report(store, caller, key_id_param):
    wanted = admin.usage_filter(caller, key_id_param)
    return usage_report(
        store, key_id=wanted.key_id, owner=wanted.owner, since="2026-12-01", until="2026-12-31", group_by=("key_id",)
    )


def test_an_owner_admin_reads_only_its_owners_usage(auth, keys):
    store = UsageStore(auth.keys.database)
    store.insert(
        [
            usage_record(key_id=keys["acme"][1], owner="acme"),
            usage_record(key_id=keys["acme_admin"][1], owner="acme"),
            usage_record(key_id=keys["globex"][1], owner="globex"),
        ]
    )
    acme_admin, operator = _caller(auth, keys, "acme_admin"), _caller(auth, keys, "operator")
    mine = _report(store, acme_admin, "*")
    assert {row["key_id"] for row in mine["data"]} == {keys["acme"][1], keys["acme_admin"][1]}
    assert mine["owner"] == "acme"
    # Another owner's key reads exactly like a key nobody holds: an empty report.
    assert _report(store, acme_admin, keys["globex"][1])["data"] == []
    assert _report(store, acme_admin, "000000000000")["data"] == []
    assert [row["key_id"] for row in _report(store, acme_admin, keys["acme"][1])["data"]] == [keys["acme"][1]]
    everything = _report(store, operator, "*")
    assert {row["key_id"] for row in everything["data"]} == {keys["acme"][1], keys["acme_admin"][1], keys["globex"][1]}
    assert _report(store, operator, keys["globex"][1])["totals"]["requests"] == 1


def test_without_key_id_the_report_is_the_callers_own_key(auth, keys):
    acme = _caller(auth, keys, "acme", SCOPE_INFERENCE)
    assert admin.usage_scope(None) == SCOPE_INFERENCE and admin.usage_scope("*") == SCOPE_ADMIN
    assert admin.usage_filter(acme, None) == admin.UsageFilter(key_id=keys["acme"][1], owner=None)


def test_an_empty_key_id_is_a_400_not_every_key(auth, keys):
    with pytest.raises(APIError) as refused:
        admin.usage_filter(_caller(auth, keys, "operator"), "")
    assert (refused.value.status, refused.value.param) == (400, "key_id")
    # And a caller whose own key id were "" (no token names one now) reads nothing, not every key.
    with pytest.raises(ValueError):
        usage_report(UsageStore(auth.keys.database), key_id="", since="2026-12-01", until="2026-12-31",
                     group_by=("key_id",))


def test_a_key_id_that_is_no_key_id_never_reaches_the_registry(tmp_path):
    """A NUL (or any shape but an id's) in the revoke path or the usage query: 404 and 400, never
    the database's own refusal (psycopg's DataError on PostgreSQL was a 500)."""
    from auth_support import authenticator, bearer
    from router_app import router_client
    from serve_app.auth.keys import SCOPE_ADMIN, SCOPE_INFERENCE

    auth = authenticator(tmp_path)
    admin_key, _ = auth.keys.create_key(owner="ops", tier="standard", scopes=(SCOPE_INFERENCE, SCOPE_ADMIN))
    client = router_client(auth)
    revoked = client.post("/v1/admin/keys/%00/revoke", headers=bearer(admin_key))
    assert (revoked.status_code, revoked.json()["error"]["code"]) == (404, "key_not_found")
    for key_id in ("%00", "", "0123456789AB"):
        report = client.get(f"/v1/usage?key_id={key_id}", headers=bearer(admin_key))
        assert (report.status_code, report.json()["error"]["param"]) == (400, "key_id")


def test_through_the_routes_an_owner_admin_sees_and_revokes_only_its_owners_keys(router_app):
    """The attack, as HTTP: an admin key scoped to one model lists keys, revokes another owner's
    key and asks for every key's usage; it gets its own owner's, a 404, and its own owner's."""
    app = router_app()
    acme_admin, _ = app.auth.keys.create_key(owner="acme", tier="standard", models=(MODEL,), scopes=BOTH)
    _, acme = app.auth.keys.create_key(owner="acme", tier="standard")
    _, globex = app.auth.keys.create_key(owner="globex", tier="standard")
    headers = bearer(acme_admin)
    listed = app.client.get("/v1/admin/keys", headers=headers)
    assert listed.status_code == 200
    assert globex.key_id not in _ids(listed.json()["data"]) and acme.key_id in _ids(listed.json()["data"])
    revoke = app.client.post(f"/v1/admin/keys/{globex.key_id}/revoke", headers=headers)
    assert (revoke.status_code, revoke.json()["error"]["code"]) == (404, "key_not_found")
    assert app.auth.keys.get(globex.key_id).disabled_at is None  # untouched
    UsageStore(app.auth.keys.database).insert(
        [usage_record(key_id=acme.key_id, owner="acme"), usage_record(key_id=globex.key_id, owner="globex")]
    )
    every = app.client.get("/v1/usage", params={"key_id": "*", "group_by": "key_id", "since": "2026-12-01", "until": "2026-12-01"}, headers=headers)
    assert every.status_code == 200
    assert {row["key_id"] for row in every.json()["data"]} == {acme.key_id}


def test_an_owner_admins_report_of_another_owners_key_reads_none_of_its_usage(router_app):
    """The report filtered by (key id, owner) read the other key's rows to find none of them: its
    time grew with that key's usage, telling another owner's busy key from an id nobody holds."""
    app = router_app()
    acme_admin, _ = app.auth.keys.create_key(owner="acme", tier="standard", models=(MODEL,), scopes=BOTH)
    _, acme = app.auth.keys.create_key(owner="acme", tier="standard")
    _, globex = app.auth.keys.create_key(owner="globex", tier="standard")
    store = app.services.meter.store
    store.insert([usage_record(key_id=acme.key_id, owner="acme"), usage_record(key_id=globex.key_id, owner="globex")])
    read: list[str | None] = []
    totals = store.totals
    store.totals = lambda **kwargs: read.append(kwargs["key_id"]) or totals(**kwargs)
    query = {"group_by": "key_id", "since": "2026-12-01", "until": "2026-12-01"}

    def report(key_id: str) -> dict:
        answer = app.client.get("/v1/usage", params={**query, "key_id": key_id}, headers=bearer(acme_admin))
        assert answer.status_code == 200, answer.text
        return answer.json()

    theirs, nobodys = report(globex.key_id), report("0000ffffffff")
    assert read == [] and theirs["data"] == nobodys["data"] == []
    assert {k: v for k, v in theirs.items() if k != "key_id"} == {k: v for k, v in nobodys.items() if k != "key_id"}
    assert [row["key_id"] for row in report(acme.key_id)["data"]] == [acme.key_id] and read == [acme.key_id]


def _token(app, key: str) -> str:
    minted = app.client.post("/v1/auth/token", json={"api_key": key})
    assert minted.status_code == 200, minted.text
    return minted.json()["access_token"]


def test_a_leaked_token_is_revoked_over_http_by_its_key_without_revoking_the_key(router_app):
    """Only the CLI revoked one token; a tenant with a leaked token revoked its key (every
    deployment of its own down). Now its key (or any token of it) revokes that token alone."""
    app = router_app()
    key, record = app.auth.keys.create_key(owner="acme", tier="standard")
    leaked, kept = _token(app, key), _token(app, key)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert app.client.post("/v1/chat/completions", json=body, headers=bearer(leaked)).status_code == 200
    revoked = app.client.post("/v1/auth/token/revoke", json={"token": leaked}, headers=bearer(kept))
    assert revoked.status_code == 200 and revoked.json()["revoked"] is True and revoked.json()["jti"]
    refused = app.client.post("/v1/chat/completions", json=body, headers=bearer(leaked))
    assert (refused.status_code, refused.json()["error"]["code"]) == (401, "token_revoked")
    assert app.client.post("/v1/chat/completions", json=body, headers=bearer(kept)).status_code == 200
    assert app.client.post("/v1/chat/completions", json=body, headers=bearer(key)).status_code == 200
    assert app.auth.keys.get(record.key_id).disabled_at is None


def test_a_token_of_another_owners_key_is_no_token_and_an_admin_revokes_its_owners(router_app):
    app = router_app()
    acme_admin, _ = app.auth.keys.create_key(owner="acme", tier="standard", scopes=BOTH)
    acme, _ = app.auth.keys.create_key(owner="acme", tier="standard")
    acme_other, _ = app.auth.keys.create_key(owner="acme", tier="standard")
    globex, _ = app.auth.keys.create_key(owner="globex", tier="standard")
    globex_token = _token(app, globex)
    for caller in (acme, acme_admin):  # a key of another owner; an admin of another owner
        refused = app.client.post("/v1/auth/token/revoke", json={"token": globex_token}, headers=bearer(caller))
        assert (refused.status_code, refused.json()["error"]["code"]) == (404, "token_not_found")
    acme_token = _token(app, acme)
    not_its_key = app.client.post("/v1/auth/token/revoke", json={"token": acme_token}, headers=bearer(acme_other))
    assert not_its_key.status_code == 404  # the same owner's other key is no admin of it
    by_admin = app.client.post("/v1/auth/token/revoke", json={"token": acme_token}, headers=bearer(acme_admin))
    assert by_admin.status_code == 200 and by_admin.json()["revoked"] is True
    assert app.client.get("/v1/models", headers=bearer(globex_token)).status_code == 200  # untouched
    assert app.client.get("/v1/models", headers=bearer(acme_token)).status_code == 401


@pytest.mark.parametrize("body, status, code", [
    ({}, 400, "invalid_token_field"),
    ({"token": 7}, 400, "invalid_token_field"),
    ({"token": "not.a.token"}, 400, "invalid_token"),
    ({"token": "x" * 5000}, 413, "request_too_large"),
])
def test_what_is_no_token_is_a_400_naming_the_field(router_app, body, status, code):
    app = router_app()
    key, _ = app.auth.keys.create_key(owner="acme", tier="standard")
    refused = app.client.post("/v1/auth/token/revoke", json=body, headers=bearer(key))
    assert (refused.status_code, refused.json()["error"]["code"]) == (status, code)
    assert status == 413 or refused.json()["error"]["param"] == "token"
    assert app.client.post("/v1/auth/token/revoke", json={"token": "a.b.c"}).status_code == 401  # a credential first


def test_an_expired_token_needs_no_revocation_and_is_told_so(router_app):
    import time

    from serve_app.auth.authenticator import mint_token
    from serve_app.auth.principal import Principal

    app = router_app()
    key, record = app.auth.keys.create_key(owner="acme", tier="standard")
    principal, an_hour_ago = Principal.from_record(record), int(time.time()) - 3600
    expired = mint_token(app.auth.args, app.auth.keyset.current(), principal, an_hour_ago)
    answer = app.client.post("/v1/auth/token/revoke", json={"token": expired["access_token"]}, headers=bearer(key))
    assert answer.status_code == 200 and answer.json() == {"jti": None, "revoked": False, "reason": "expired"}


def test_a_key_whose_requests_a_leaked_token_spends_still_revokes_it(router_app):
    """The revocation cost a request of the key's rate limit: the leaked token, spending it, kept
    the owner from revoking it (429) just when it mattered. Its write is charged to a bucket of
    its own (found by a review)."""
    from serve_app.auth.config import Tier

    roomy = Tier(requests_per_minute=600, tokens_per_minute=1_000_000)
    app = router_app(tiers={"small": Tier(requests_per_minute=2, tokens_per_minute=100_000), "standard": roomy,
                            "dev": roomy})
    key, _ = app.auth.keys.create_key(owner="acme", tier="small")
    leaked = _token(app, key)
    for _ in range(3):
        app.client.get("/v1/models", headers=bearer(leaked))  # the thief spends the key's minute
    assert app.client.get("/v1/models", headers=bearer(key)).status_code == 429
    revoked = app.client.post("/v1/auth/token/revoke", json={"token": leaked}, headers=bearer(key))
    assert revoked.status_code == 200 and revoked.json()["revoked"] is True
    assert app.client.get("/v1/models", headers=bearer(leaked)).json()["error"]["code"] == "token_revoked"

"""``auth`` args (no off switch, the dev key only in ``local``) and the ``serve-app`` CLI against a
real store and keyset, through a Serve config exactly as an operator runs it."""

import json

import jwt
import pytest
import yaml
from typer.testing import CliRunner

from serve_app.auth import tokens
from serve_app.auth.config import AuthArgs
from serve_app.auth.keys import KeyStore
from serve_app.cli import app
from serve_app.config import parse_app_args
from serve_app.regions.layout import region_applications
from tests.conftest import app_args, load_serve_config


def test_local_config_uses_the_dev_key_env_and_the_state_dir(monkeypatch):
    monkeypatch.delenv("SERVE_APP_STATE_DIR", raising=False)
    args = parse_app_args(app_args(load_serve_config("local.yaml")))
    assert args.auth.dev_api_key_env == "SERVE_APP_DEV_API_KEY"
    assert args.auth.key_store().parent.name == ".state"
    assert args.auth.signing_keys().parent.name == ".state"


@pytest.mark.parametrize("name", ["yul-02.yaml"])
def test_region_configs_name_their_key_material_and_have_no_dev_key(name):
    args = parse_app_args(app_args(load_serve_config(name)))
    assert args.auth.dev_api_key_env is None
    assert args.auth.key_store_path and args.auth.signing_keys_path
    assert args.auth.issuer.startswith("https://") and args.auth.audience.startswith("https://")


def _region(**auth) -> dict:
    return {"region": "yul-02", "models": [{"id": "qwen-3.6-35b-a3b"}], "auth": auth}


PATHS = {"key_store_path": "/srv/keys.sqlite3", "signing_keys_path": "/srv/signing.json"}


@pytest.mark.parametrize(
    "raw, fragment",
    [
        (_region(), "must set key_store_path and signing_keys_path"),
        (_region(**PATHS, dev_api_key_env="SERVE_APP_DEV_API_KEY"), "only allowed in the 'local' region"),
        (_region(**PATHS, enabled=False), "auth.enabled"),
        (_region(**PATHS, disabled=True), "auth.disabled"),
        (_region(key_store_path="keys.sqlite3", signing_keys_path="/x"), "absolute path"),
        (_region(**PATHS, default_tier="gold"), "tier 'gold' is not defined"),
        (_region(**PATHS, token_ttl_s=86400), "token_ttl_s"),
    ],
)
def test_auth_args_have_no_off_switch_and_reject_mistakes(raw, fragment):
    with pytest.raises(ValueError) as err:
        parse_app_args(raw)
    assert fragment in str(err.value)


def test_a_region_with_its_files_named_is_valid():
    assert parse_app_args(_region(**PATHS)).auth.key_store().as_posix() == "/srv/keys.sqlite3"


# --- CLI ---------------------------------------------------------------------------------------
@pytest.fixture
def cli(tmp_path):
    return _cli(tmp_path)


def _cli(tmp_path, **overrides):
    """The CLI on the local config with its files under ``tmp_path`` (and ``overrides`` of its
    router settings), as a region's config lays them out."""
    config = load_serve_config("local.yaml")
    settings = app_args(config)
    settings["auth"] = {
        "key_store_path": str(tmp_path / "keys.sqlite3"),
        "signing_keys_path": str(tmp_path / "signing-keys.json"),
        "dev_api_key_env": "SERVE_APP_DEV_API_KEY",
    }
    settings.update(overrides)
    config["applications"] = region_applications(settings)  # as a region's config lays them out
    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(config))
    runner = CliRunner()

    def run(*argv: str, ok: bool = True, input: str | None = None):
        result = runner.invoke(app, ["--config", str(path), *argv], input=input)
        assert (result.exit_code == 0) is ok, result.output
        return result

    run.auth = AuthArgs.model_validate(settings["auth"])
    return run


def test_cli_creates_lists_and_revokes_keys_printing_the_secret_once(cli):
    created = cli("keys", "create", "--owner", "alice", "--model", "qwen-3.6-a3b", "--tier", "free", "--admin")
    key = created.stdout.strip()  # stdout is the key alone
    assert key.startswith("pgk_") and "\n" not in key
    key_id = key.split("_")[1]
    record = KeyStore(cli.auth.key_store()).lookup(key)
    assert record.models == ("qwen-3.6-35b-a3b",)  # aliases are stored as canonical ids
    assert set(record.scopes) == {"inference", "admin"}  # its owner's admin, not an operator

    listed = cli("keys", "list")
    assert key_id in listed.output and "alice" in listed.output and "active" in listed.output
    assert key.split("_")[2] not in listed.output
    as_json = json.loads(cli("keys", "list", "--json").stdout)
    assert as_json[0]["key_id"] == key_id and "secret_sha256" not in as_json[0]

    cli("keys", "revoke", key_id, "--yes")
    assert json.loads(cli("keys", "list", "--json").stdout)[0]["status"] == "revoked"
    assert "no key" in cli("keys", "revoke", "ffffffffffff", "--yes", ok=False).output


def test_cli_makes_an_operator_only_when_asked_and_lists_its_scopes(cli):
    """--admin without --model/--region made an operator of every owner's keys; now only --operator does."""
    admin = cli("keys", "create", "--owner", "acme", "--admin").stdout.strip()
    operator = cli("keys", "create", "--owner", "ops", "--operator").stdout.strip()
    store = KeyStore(cli.auth.key_store())
    assert set(store.lookup(admin).scopes) == {"inference", "admin"}
    assert set(store.lookup(operator).scopes) == {"inference", "admin", "operator"}
    assert "inference admin operator" in cli("keys", "list").output


def test_cli_grants_the_operator_scope_to_a_key_after_asking(cli):
    key_id = cli("keys", "create", "--owner", "ops", "--admin").stdout.strip().split("_")[1]
    store = KeyStore(cli.auth.key_store(), cache_ttl_s=0)
    assert "not granted (pass --yes" in cli("keys", "grant-operator", key_id, ok=False).output
    assert "operator" not in store.get(key_id).scopes
    assert "operator's key" in cli("keys", "grant-operator", key_id, input="y\n").output
    assert set(store.get(key_id).scopes) == {"inference", "admin", "operator"}
    assert "no key" in cli("keys", "grant-operator", "ffffffffffff", "--yes", ok=False).output
    cli("keys", "revoke", key_id, "--yes")
    assert "is revoked" in cli("keys", "grant-operator", key_id, "--yes", ok=False).output


def test_cli_revoke_asks_first_naming_the_owner_and_a_no_keeps_the_key(cli):
    """Revoking is for good and fails the owner's traffic at once: a mistyped id of another
    customer's key was revoked without a word."""
    key_id = cli("keys", "create", "--owner", "acme").stdout.strip().split("_")[1]

    def status() -> str:
        return json.loads(cli("keys", "list", "--json").stdout)[0]["status"]

    refused = cli("keys", "revoke", key_id, ok=False, input="n\n")
    assert "acme" in refused.output and "cannot be re-enabled" in refused.output
    assert "not revoked (pass --yes" in refused.output and status() == "active"
    unasked = cli("keys", "revoke", key_id, ok=False)  # a script: no answer, its stdin closed
    assert "not revoked (pass --yes" in unasked.output and "Aborted" not in unasked.output
    assert status() == "active"
    cli("keys", "revoke", key_id, input="y\n")
    assert status() == "revoked"
    again = cli("keys", "revoke", key_id)  # nothing to ask: says when, changes nothing
    assert "was revoked on" in again.output and status() == "revoked"
    assert "no key" in cli("keys", "revoke", "ffffffffffff", ok=False).output  # asked nothing


def test_cli_rejects_unknown_models_and_tiers(cli):
    assert "unknown model" in cli("keys", "create", "--owner", "a", "--model", "gpt-4o", ok=False).output
    assert "unknown tier" in cli("keys", "create", "--owner", "a", "--tier", "gold", ok=False).output


def test_cli_rejects_an_unknown_region_and_an_expiry_that_is_not_ahead(cli):
    """A typo'd region made a key refused in every region; --expires-in-days 0 made one that never
    expired, a negative one a key expired at birth: each created and exit 0."""
    assert "unknown region 'yul-2'" in cli("keys", "create", "--owner", "a", "--region", "yul-2", ok=False).output
    for days in ("0", "-1"):
        assert "more than 0" in cli("keys", "create", "--owner", "a", "--expires-in-days", days, ok=False).output
    assert not cli.auth.key_store().exists()  # none was created: not even the store
    created = cli("keys", "create", "--owner", "a", "--region", "yul-02", "--region", "local")
    assert "keys.sqlite3" in created.stderr  # which registry it went to
    cli("keys", "create", "--owner", "b", "--region", "sea-01", "--any-region")  # a region being added
    listed = json.loads(cli("keys", "list", "--json").stdout)
    assert sorted(tuple(k["regions"]) for k in listed) == [("sea-01",), ("yul-02", "local")]


@pytest.mark.parametrize("days", ["inf", "nan", "36501", "1e300"])
def test_cli_refuses_an_expiry_no_database_holds_with_a_message_not_a_traceback(cli, days):
    refused = cli("keys", "create", "--owner", "a", "--expires-in-days", days, ok=False)
    assert "at most 36500" in refused.output and isinstance(refused.exception, SystemExit)
    assert not cli.auth.key_store().exists()


@pytest.mark.parametrize("owner", ["", " acme", "ac\x00me", "a\x1b[31m", "x" * 129, "-flag"])
def test_cli_refuses_an_owner_that_is_no_id(cli, owner):
    refused = cli("keys", "create", "--owner", owner, ok=False)
    assert "is not an id" in refused.output and isinstance(refused.exception, SystemExit)
    assert not cli.auth.key_store().exists()


def test_a_key_for_the_configs_failover_peer_is_for_a_known_region(tmp_path):
    """The local two-region setup's peer ("peer") is no region file: the config names it."""
    from serve_app.devtools.local_regions import PEER_REGION

    cli = _cli(tmp_path, failover={"peers": [{"region": PEER_REGION, "endpoint": "http://127.0.0.1:8000/peer"}]})
    cli("keys", "create", "--owner", "a", "--region", PEER_REGION)  # exits 0 (``run`` asserts it)


def test_cli_rotates_signing_keys_and_mints_and_revokes_tokens(cli):
    cli("signing", "rotate")
    key_id = cli("keys", "create", "--owner", "bob").stdout.strip().split("_")[1]
    token = cli("token", "mint", key_id).stdout.strip()
    keys = tokens.KeysetFile(cli.auth.signing_keys(), check_interval_s=0)
    verify = dict(issuer=cli.auth.issuer, audience=cli.auth.audience, leeway_s=0)
    payload = tokens.verify(token, keys, **verify)
    assert payload["sub"] == key_id

    first_kid = jwt.get_unverified_header(token)["kid"]
    cli("signing", "rotate")
    listed = cli("signing", "list").output
    assert first_kid in listed and "signs+verifies" in listed
    tokens.verify(token, keys, **verify)  # still valid after rotation
    refused = cli("signing", "remove", first_kid, ok=False).output  # its tokens may be live for 15 min
    assert "may be live until" in refused and "--now" in refused
    tokens.verify(token, keys, **verify)
    signer = tokens.load_keyset(cli.auth.signing_keys()).signing_key().kid
    assert "signs now" in cli("signing", "remove", signer, ok=False).output
    assert "signs now" in cli("signing", "remove", signer, "--now", ok=False).output
    cli("signing", "remove", first_kid, "--now")  # a compromised key: its tokens fail at once
    with pytest.raises(tokens.TokenError):
        tokens.verify(token, keys, **verify)

    fresh = cli("token", "mint", key_id).stdout.strip()
    cli("token", "revoke", fresh)
    assert KeyStore(cli.auth.key_store(), cache_ttl_s=0).is_jti_revoked(jwt.decode(fresh, options={"verify_signature": False})["jti"])
    cli("token", "revoke", "A" * 22)  # by its id
    assert KeyStore(cli.auth.key_store(), cache_ttl_s=0).is_jti_revoked("A" * 22)
    assert "neither a token nor a token id" in cli("token", "revoke", "some-jti", ok=False).output  # a typo
    assert not KeyStore(cli.auth.key_store(), cache_ttl_s=0).is_jti_revoked("some-jti")


def test_cli_exports_and_imports_jwks_between_regions(cli, tmp_path):
    cli("signing", "rotate")
    jwks = cli("signing", "export-jwks").stdout
    assert '"d"' not in jwks and "PRIVATE" not in jwks
    peer = tokens.Keyset((tokens.SigningKey.generate(),))
    peer_file = tmp_path / "peer.json"
    peer_file.write_text(json.dumps(peer.jwks()))
    assert "imported 1" in cli("signing", "import-jwks", str(peer_file)).output
    assert "verifies (imported)" in cli("signing", "list").output
    assert "imported 0" in cli("signing", "import-jwks", str(peer_file)).output  # idempotent


def test_cli_refuses_to_remove_the_last_signing_key(cli):
    cli("signing", "rotate")
    (kid,) = [k.kid for k in tokens.load_keyset(cli.auth.signing_keys()).keys]
    assert "no private key" in cli("signing", "remove", kid, ok=False).output


def test_cli_can_prepare_a_regions_keyset_on_an_operator_machine(tmp_path):
    """A region's config names in-cluster paths; --signing-keys points the CLI elsewhere."""
    from tests.conftest import REPO

    keyset = tmp_path / "yul-02.signing-keys.json"
    result = CliRunner().invoke(
        app, ["--config", str(REPO / "configs" / "yul-02.yaml"), "--signing-keys", str(keyset), "signing", "rotate"]
    )
    assert result.exit_code == 0, result.output
    assert tokens.load_keyset(keyset).signing_key().private_pem
    # A region's keys live in the shared registry, whose DSN the operator machine does not have.
    missing = CliRunner().invoke(app, ["--config", str(REPO / "configs" / "yul-02.yaml"), "keys", "list"], env={"SERVE_APP_REGISTRY_DSN": ""})
    assert missing.exit_code == 1 and "SERVE_APP_REGISTRY_DSN" in missing.output


def test_cli_manages_a_regions_keys_in_the_shared_registry_by_dsn(fresh_database):
    from tests.conftest import REPO

    region = ["--config", str(REPO / "configs" / "yul-02.yaml")]
    created = CliRunner().invoke(app, [*region, "--key-store", fresh_database, "keys", "create", "--owner", "acme"])
    assert created.exit_code == 0, created.output
    # The same registry through the env var the region's routers read it from.
    listed = CliRunner().invoke(app, [*region, "keys", "list"], env={"SERVE_APP_REGISTRY_DSN": fresh_database})
    assert listed.exit_code == 0 and "acme" in listed.output

"""serve-app: manage API keys, signing keys and tokens for one region.

Every command reads the key store and signing keyset that a Serve config's ``auth`` args name
(``--config``, default ``configs/local.yaml``, whose files live in ``.state/``), i.e. exactly the
files that config's routers read. Routers pick up changes within ``auth.cache_ttl_s``.

Secrets are printed once: a new API key by ``keys create``, a token by ``token mint`` (its purpose).
Nothing else prints a secret; ``keys list`` shows ids and claims, never hashes.
"""

import json
import time
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
import yaml

from serve_app import catalog
from serve_app.image import gpu_smoke, image_lock
from serve_app.auth import tokens
from serve_app.auth.authenticator import mint_token
from serve_app.auth.principal import Principal
from serve_app.auth.config import AuthArgs
from serve_app.auth.database import is_dsn
from serve_app.auth.keys import ALL, SCOPE_ADMIN, SCOPE_INFERENCE, SCOPE_OPERATOR, KeyRecord, KeyStore, owner_problem
from serve_app.bench import agent_report, cli as bench_cli
from serve_app.config import parse_app_args
from serve_app.faults import cli as faults_cli
from serve_app.paths import REPO_ROOT
from serve_app.regions import layout
from serve_app.regions.cli import app as regions_app
from serve_app.runtime import drain_node as drain_node_module
from serve_app.usage.cli import usage_app

# Never print local variables in a traceback: they can hold a key or a private key.
app = typer.Typer(no_args_is_help=True, help=__doc__.splitlines()[0], pretty_exceptions_show_locals=False)
keys_app = typer.Typer(no_args_is_help=True, help="Create, list and revoke API keys.")
signing_app = typer.Typer(no_args_is_help=True, help="Rotate, list, remove, export and import signing keys.")
token_app = typer.Typer(no_args_is_help=True, help="Mint a token for a key; revoke a token.")
app.add_typer(keys_app, name="keys")
app.add_typer(signing_app, name="signing")
app.add_typer(token_app, name="token")
app.add_typer(regions_app, name="regions", help="Render and check configs/ and terraform/ from regions/.")
app.add_typer(usage_app, name="usage")
app.command("bench")(bench_cli.stream)
app.command("bench-capacity")(bench_cli.capacity)
app.command("bench-setting")(bench_cli.setting)
app.command("idle")(bench_cli.idle)
app.command("bench-wire-tls")(bench_cli.wire_tls)
app.command("bench-agent")(agent_report.command)
app.command("faults")(faults_cli.command)
app.command("gpu-smoke")(gpu_smoke.command)
app.command("image-lock")(image_lock.command)


@app.command("drain-node")
def drain_node(
    deadline_s: Annotated[float, typer.Option("--deadline-s", min=0, help="How long the node may take to empty.")] = (
        drain_node_module.DRAIN_DEADLINE_S),
    address: Annotated[str, typer.Option(help="The Ray cluster's address; auto: this node's.")] = "auto",
) -> None:
    """Drain this Ray node (a GPU worker pod's preStop): Serve moves its replicas, the command waits
    until none is left here (docs/operations.md, "Node maintenance")."""
    try:
        drained = drain_node_module.drain_this_node(deadline_s, address)
    except Exception as err:  # Kubernetes records the hook's failure, then stops the pod as without it
        _fail(f"could not drain this node: {err}")
    if not drained:
        raise typer.Exit(1)


class _Context:
    def __init__(self, config: Path, key_store: str | None, signing_keys: Path | None):
        args = layout.parse_region(yaml.safe_load(config.read_text()))  # the config's one region
        self.region: str = args.region
        self.peers: list[str] = [peer.region for peer in args.failover.peers]
        update: dict[str, object] = {}
        self._registry_dsn: str | None = None
        if signing_keys is not None:
            update["signing_keys_path"] = str(signing_keys.resolve())
        if key_store is not None:  # a registry DSN, or a SQLite file: either replaces the config's
            dsn = is_dsn(key_store)
            update["key_store_path"] = None if dsn else str(Path(key_store).resolve())
            update["key_registry_dsn_env"] = None
            self._registry_dsn = key_store if dsn else None
        self.auth: AuthArgs = args.auth.model_copy(update=update)

    def store(self, create: bool = False) -> KeyStore:
        # cache_ttl_s=0: the CLI always reads what the registry holds now.
        try:
            return KeyStore(self._registry_dsn or self.auth.key_store(), cache_ttl_s=0, create=create)
        except (FileNotFoundError, ValueError) as err:
            _fail(str(err))
        except Exception as err:  # psycopg's OperationalError: the registry cannot be reached
            _fail(f"cannot reach the key registry: {err}")

    def keyset(self) -> tokens.Keyset:
        path = self.auth.signing_keys()
        if not path.exists():
            _fail(f"no signing keyset at {path}; create one with `serve-app signing rotate`")
        return tokens.load_keyset(path)


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


@app.callback()
def main(
    ctx: typer.Context,
    config: Annotated[
        Path,
        typer.Option(envvar="SERVE_APP_CONFIG", help="Serve config whose `auth` args name the files."),
    ] = REPO_ROOT / "configs" / "local.yaml",
    key_store: Annotated[
        str | None,
        typer.Option(
            envvar="SERVE_APP_KEY_STORE",
            help="Use this key registry instead of the config's: a SQLite file, or a postgresql:// DSN "
            "(a region's registry, reached from an operator machine).",
        ),
    ] = None,
    signing_keys: Annotated[
        Path | None,
        typer.Option(
            envvar="SERVE_APP_SIGNING_KEYS",
            help="Use this signing keyset instead of the config's (e.g. to create a region's keyset "
            "on an operator machine before it becomes a Secret).",
        ),
    ] = None,
) -> None:
    try:
        ctx.obj = _Context(config, key_store, signing_keys)
    except (OSError, ValueError) as err:
        _fail(f"cannot read {config}: {err}")


def _ctx(ctx: typer.Context) -> _Context:
    return ctx.obj


# --- keys --------------------------------------------------------------------------------------
@keys_app.command("create")
def keys_create(
    ctx: typer.Context,
    owner: Annotated[str, typer.Option(help="Who the key is for (a customer or team id).")],
    model: Annotated[list[str], typer.Option(help="Allowed model (repeatable); default: all.")] = [],  # noqa: B006
    region: Annotated[list[str], typer.Option(help="Allowed region (repeatable); default: all.")] = [],  # noqa: B006
    tier: Annotated[str | None, typer.Option(help="Rate-limit tier; default: auth.default_tier.")] = None,
    admin: Annotated[bool, typer.Option(help="Also grant the admin scope: its owner's keys and usage.")] = False,
    operator: Annotated[bool, typer.Option(help="An operator's key: admin of every owner's keys and usage, and "
                                                "of the models (load, unload).")] = False,
    expires_in_days: Annotated[float | None, typer.Option(help="Expire after this many days.")] = None,
    any_region: Annotated[bool, typer.Option(help="Take a --region this config and regions/ do not know "
                                                  "(one being added).")] = False,
) -> None:
    """Create a key and print it once; only its hash is stored."""
    c = _ctx(ctx)
    models = []
    for name in model:
        model_id = catalog.canonical_id(name)
        if model_id is None:
            _fail(f"unknown model {name!r}; known: {', '.join(catalog.CATALOG)}")
        models.append(model_id)
    tier = tier or c.auth.default_tier
    if tier not in c.auth.tiers:
        _fail(f"unknown tier {tier!r}; this config defines: {', '.join(c.auth.tiers)}")
    known = _known_regions(c.region, c.peers)
    if not any_region and (unknown := [name for name in region if name not in known]):  # a typo: refused everywhere
        _fail(f"unknown region {', '.join(map(repr, unknown))}; known: {', '.join(sorted(known))} "
              "(--any-region for one being added)")
    # 0 read as "never", a negative as expired; inf and nan were tracebacks, a century past any
    # database's integer: leave it out for a key that does not expire.
    if expires_in_days is not None and not 0 < expires_in_days <= MAX_KEY_DAYS:
        _fail(f"--expires-in-days must be more than 0 and at most {MAX_KEY_DAYS} (leave it out for a key that "
              "does not expire)")
    if (problem := owner_problem(owner)) is not None:
        _fail(problem)
    store = c.store(create=True)
    key, record = store.create_key(
        owner=owner,
        tier=tier,
        models=tuple(models) or (ALL,),
        regions=tuple(region) or (ALL,),
        scopes=(SCOPE_INFERENCE, SCOPE_ADMIN, SCOPE_OPERATOR) if operator else
               (SCOPE_INFERENCE, SCOPE_ADMIN) if admin else (SCOPE_INFERENCE,),
        expires_at=int(time.time() + expires_in_days * 86400) if expires_in_days is not None else None,
    )
    typer.echo(f"created key {record.key_id} for {owner} (tier {tier}, scopes {' '.join(record.scopes)}) "
               f"in {store.database.describe()}", err=True)
    typer.echo("store it now: it is shown this once and cannot be recovered", err=True)
    typer.echo(key)  # stdout carries only the key, for KEY=$(serve-app keys create ...)


MAX_KEY_DAYS = 36_500  # a century: --expires-in-days past it is a mistake (inf overflowed the database)
# From a rotation on an operator's copy of a keyset to its routers signing with the new key: the
# Secret's apply and the kubelet's sync of the mounted file (about a minute), with room.
KEYSET_PROPAGATION_S = 180


def _known_regions(own: str, peers: list[str]) -> set[str]:
    """This config's region and its failover peers, and every region of the repository's
    ``regions/`` (the image carries it)."""
    return {own, *peers, *(path.stem for path in (REPO_ROOT / "regions").glob("*.yaml"))}


@keys_app.command("list")
def keys_list(ctx: typer.Context, as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """List keys with their claims and status (never their hashes)."""
    records = [r.public() for r in _ctx(ctx).store().list_keys()]
    if as_json:
        typer.echo(json.dumps(records, indent=2))
        return
    typer.echo(f"{'KEY ID':<14}{'STATUS':<9}{'TIER':<12}{'SCOPES':<26}{'OWNER':<20}MODELS / REGIONS / EXPIRES")
    for r in records:
        expires = time.strftime("%Y-%m-%d", time.gmtime(r["expires_at"])) if r["expires_at"] else "never"
        typer.echo(
            f"{r['key_id']:<14}{r['status']:<9}{r['tier']:<12}{' '.join(r['scopes']):<26}{r['owner']:<20}"
            f"{','.join(r['models'])} / {','.join(r['regions'])} / {expires}"
        )


@keys_app.command("revoke")
def keys_revoke(
    ctx: typer.Context,
    key_id: str,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask (scripts).")] = False,
) -> None:
    """Disable a key for good; tokens minted from it stop working in this region too. Asks
    first, naming the key's owner: a revoked key cannot be re-enabled, and its owner's traffic
    fails at once."""
    store = _ctx(ctx).store()
    record = _existing(store, key_id)
    if record.disabled_at is not None:  # nothing to ask: revoking again changes nothing
        typer.echo(f"{key_id} was revoked on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(record.disabled_at))}")
        return
    _confirm(yes, f"revoke key {key_id} of {record.owner} (tier {record.tier}, scopes {' '.join(record.scopes)}) "
                  "for good? It cannot be re-enabled", "not revoked")
    if not store.revoke_key(key_id):  # removed meanwhile (another operator)
        _fail(f"no key {key_id!r}")
    typer.echo(f"revoked {key_id}")


@keys_app.command("grant-operator")
def keys_grant_operator(
    ctx: typer.Context,
    key_id: str,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask (scripts).")] = False,
) -> None:
    """Make a key an operator's: admin of every owner's keys and usage, and of the models (load,
    unload). For an operator's own keys made before the scope existed (2026-12-07), whose admin
    powers over every owner the upgrade took away (docs/auth.md, "Admin scopes")."""
    store = _ctx(ctx).store()
    record = _existing(store, key_id)
    if record.disabled_at is not None:
        _fail(f"{key_id} is revoked")
    _confirm(yes, f"make key {key_id} of {record.owner} an operator: it manages every owner's keys and the "
                  "region's models?", "not granted")
    store.grant_operator(key_id)
    typer.echo(f"{key_id} is an operator's key")


def _existing(store: KeyStore, key_id: str) -> KeyRecord:
    """``key_id``'s record, or the CLI's error."""
    record = store.get(key_id)
    if record is None:
        _fail(f"no key {key_id!r}")
    return record


def _confirm(yes: bool, question: str, otherwise: str) -> None:
    """Ask ``question`` unless ``yes``; a no, or no answer at all (a script: its stdin closed),
    says what was not done and how to do it without asking (click's own word was "Aborted!")."""
    if yes:
        return
    try:
        if typer.confirm(question, err=True):
            return
    except typer.Abort:  # end of input, or Ctrl-C
        typer.echo("", err=True)
    _fail(f"{otherwise} (pass --yes to do it without asking)")


# --- signing keys ------------------------------------------------------------------------------
@signing_app.command("rotate")
def signing_rotate(ctx: typer.Context) -> None:
    """Add a new signing key; it signs from now on, older keys keep verifying until removed."""
    path = _ctx(ctx).auth.signing_keys()
    keyset = tokens.load_keyset(path).rotated() if path.exists() else tokens.Keyset((tokens.SigningKey.generate(),))
    tokens.save_keyset(path, keyset)
    typer.echo(f"signing with {keyset.signing_key().kid}; {len(keyset.keys)} key(s) verify ({path})")


@signing_app.command("list")
def signing_list(ctx: typer.Context) -> None:
    keyset = _ctx(ctx).keyset()
    signer = keyset.signing_key().kid
    for key in keyset.keys:
        role = "signs+verifies" if key.kid == signer else ("verifies" if key.private_pem else "verifies (imported)")
        created = time.strftime("%Y-%m-%d %H:%M", time.gmtime(key.created_at))
        typer.echo(f"{key.kid:<22}{created:<18}{role}")


@signing_app.command("remove")
def signing_remove(
    ctx: typer.Context,
    kid: str,
    now: Annotated[bool, typer.Option("--now", help="Remove it though tokens it signed may still be live "
                                                     "(a compromised key: every one fails at once).")] = False,
) -> None:
    """Stop trusting a key: every token it signed fails from now on. Refused within one token
    lifetime (+ leeway) of the rotation that replaced it, unless ``--now``."""
    c = _ctx(ctx)
    path = c.auth.signing_keys()
    try:
        keyset = c.keyset()
        remaining = keyset.without(kid)
    except (KeyError, ValueError) as err:
        _fail(str(err).strip("'\""))
    if keyset.signing_key().kid == kid:  # even --now: the way to end its tokens is rotate, then remove
        _fail(f"{kid} is the key that signs now: every token minted lately is its. `signing rotate` first, "
              "then remove it (--now, for a compromised key)")
    # Tokens it signed live until a token lifetime (+ leeway) after the key that replaced it began
    # to sign (the newest: an older key's replacement came earlier, so this errs on the safe side),
    # which is once the region's routers read the rotated keyset: a rotation made on an operator's
    # copy signs once the Secret is applied and has reached the pods (KEYSET_PROPAGATION_S).
    live_until = keyset.signing_key().created_at + KEYSET_PROPAGATION_S + c.auth.token_ttl_s + c.auth.leeway_s
    if not now and not keyset.find(kid).imported and time.time() < live_until:
        _fail(f"tokens {kid} signed may be live until {time.strftime('%H:%M:%S UTC', time.gmtime(live_until))} "
              "(token_ttl_s + leeway_s after the rotation reached the routers): removing it now fails every "
              "one of them. Wait, or pass --now for a compromised key.")
    keyset = remaining
    tokens.save_keyset(path, keyset)
    typer.echo(f"removed {kid}; signing with {keyset.signing_key().kid}")


@signing_app.command("export-jwks")
def signing_export(ctx: typer.Context) -> None:
    """Print the public keys (JWKS) to import into other regions."""
    typer.echo(json.dumps(_ctx(ctx).keyset().jwks(), indent=2))


@signing_app.command("import-jwks")
def signing_import(ctx: typer.Context, jwks_file: Path) -> None:
    """Trust another region's public keys (verify-only), so its tokens verify here."""
    path = _ctx(ctx).auth.signing_keys()
    keyset = _ctx(ctx).keyset()
    updated = keyset.with_imported(json.loads(jwks_file.read_text()))
    tokens.save_keyset(path, updated)
    typer.echo(f"imported {len(updated.keys) - len(keyset.keys)} key(s)")


# --- tokens ------------------------------------------------------------------------------------
@token_app.command("mint")
def token_mint(ctx: typer.Context, key_id: str) -> None:
    """Mint a token for an active key (no secret needed: this is the operator's tool)."""
    c = _ctx(ctx)
    record = _existing(c.store(), key_id)
    if record.status(time.time()) != "active":
        _fail(f"key {key_id} is {record.status(time.time())}")
    answer = mint_token(c.auth, c.keyset(), Principal.from_record(record), record.expires_at)
    typer.echo(f"expires in {answer['expires_in']}s; scope {answer['scope']}", err=True)
    typer.echo(answer["access_token"])



@token_app.command("revoke")
def token_revoke(ctx: typer.Context, jti_or_token: str) -> None:
    """Revoke one token by its jti (or by the token itself) before it expires."""
    c = _ctx(ctx)
    jti, purge_after = jti_or_token, int(time.time()) + 3600 + c.auth.leeway_s  # the longest TTL
    if jti_or_token.count(".") == 2:
        payload = _verified_payload(c, jti_or_token)
        jti, purge_after = payload["jti"], int(payload["exp"]) + c.auth.leeway_s
    elif not tokens.is_jti(jti):  # a typo "revoked" nothing and said so
        _fail(f"{jti!r} is neither a token nor a token id (jti: 22 characters of A-Z a-z 0-9 _ -)")
    c.store().revoke_jti(jti, purge_after=purge_after)
    typer.echo(f"revoked token {jti}")


def _verified_payload(c: _Context, token: str) -> dict[str, Any]:
    keys = tokens.KeysetFile(c.auth.signing_keys())
    try:
        return tokens.verify(token, keys, issuer=c.auth.issuer, audience=c.auth.audience, leeway_s=c.auth.leeway_s)
    except tokens.TokenError as err:
        _fail(f"not a valid token of this config ({err}); pass its jti instead")

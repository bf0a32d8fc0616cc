"""The key registry on both of its databases: the SQLite file (embedded default) and a real
PostgreSQL server (regions), through the same ``KeyStore``. Two stores on one registry are two
regions sharing it."""

import time
import traceback

import pytest

from serve_app.auth.config import AuthArgs
from serve_app.auth.database import PostgresDatabase, SqliteDatabase
from serve_app.auth.keys import SCOPE_ADMIN, SCOPE_INFERENCE, SCOPE_OPERATOR, KeyStore
from tests.unit.fake_processes import Clock


@pytest.fixture(params=["sqlite", "postgres"])
def registry(request, tmp_path) -> str:
    if request.param == "sqlite":
        path = tmp_path / "keys.sqlite3"
        KeyStore(path, create=True)
        return str(path)
    return request.getfixturevalue("fresh_database")


def test_the_location_picks_the_database(registry):
    store = KeyStore(registry)
    expected = PostgresDatabase if registry.startswith("postgresql://") else SqliteDatabase
    assert isinstance(store.database, expected)


def test_a_key_created_in_one_region_works_in_another(registry):
    here, there = KeyStore(registry, cache_ttl_s=0), KeyStore(registry, cache_ttl_s=0)
    key, record = here.create_key(owner="alice", tier="standard", regions=("yul", "yvr"), scopes=(SCOPE_INFERENCE, SCOPE_ADMIN))
    found = there.lookup(key)
    assert found == record and found.secret_sha256 == record.secret_sha256
    assert found.regions == ("yul", "yvr") and found.scopes == (SCOPE_INFERENCE, SCOPE_ADMIN)
    assert there.lookup(key[:-1] + ("A" if key[-1] != "A" else "B")) is None  # the secret must match
    assert [r.key_id for r in there.list_keys()] == [record.key_id]


def test_a_revocation_anywhere_is_seen_everywhere_once_the_cache_expires(registry):
    clock = Clock()  # the cache's clock, moved by the test: a slow host cannot expire the row early
    here, there = KeyStore(registry, cache_ttl_s=0), KeyStore(registry, cache_ttl_s=5, clock=clock)
    key, record = here.create_key(owner="alice", tier="standard")
    assert there.lookup(key).status(time.time()) == "active"  # now cached for 5 s
    assert here.revoke_key(record.key_id) and not here.revoke_key("000000000000")
    clock.now += 2.4  # before the refresh ahead's half-life: answered from memory, nothing re-read
    assert there.lookup(key).status(time.time()) == "active"  # the cached view, until it expires
    clock.now += 2.7
    assert there.lookup(key).status(time.time()) == "revoked"


def test_an_owner_lists_and_revokes_its_own_keys_only(registry):
    store = KeyStore(registry, cache_ttl_s=0)
    mine = {store.create_key(owner="acme", tier="standard")[1].key_id for _ in range(2)}
    theirs = store.create_key(owner="globex", tier="standard")[1].key_id
    assert {r.key_id for r in store.list_keys(owner="acme")} == mine
    assert {r.key_id for r in store.list_keys()} == mine | {theirs}
    assert not store.revoke_key(theirs, owner="acme")  # as if it did not exist
    assert store.get(theirs).disabled_at is None
    assert store.revoke_key(sorted(mine)[0], owner="acme")


def test_no_key_becomes_an_operator_but_by_an_operators_grant(registry):
    """Until 2026-12-07 an admin key of every model and region was an operator: a customer's admin
    key made with the CLI's defaults managed every tenant's keys. The upgrade gives the new scope
    to nobody (it would have kept exactly those keys operators); the CLI grants it."""
    admin, operator = (SCOPE_INFERENCE, SCOPE_ADMIN), (SCOPE_INFERENCE, SCOPE_ADMIN, SCOPE_OPERATOR)
    store = KeyStore(registry, cache_ttl_s=0)
    ops = store.create_key(owner="platform", tier="standard", scopes=admin)[1].key_id
    user = store.create_key(owner="acme", tier="standard")[1].key_id
    assert KeyStore(registry, cache_ttl_s=0).get(ops).scopes == admin  # a restart grants nothing
    assert store.grant_operator(ops) and store.grant_operator(user) and not store.grant_operator("0000ffffffff")
    assert store.get(ops).scopes == operator
    assert store.get(user).scopes == (SCOPE_INFERENCE, SCOPE_ADMIN, SCOPE_OPERATOR)  # admin comes with it
    assert store.grant_operator(ops) and store.get(ops).scopes == operator  # twice: nothing more


def test_revoked_token_ids_are_shared_and_revoking_twice_is_fine(registry):
    here, there = KeyStore(registry, cache_ttl_s=0), KeyStore(registry, cache_ttl_s=0)
    now = int(time.time())
    here.revoke_jti("jti-1", purge_after=now + 60)
    here.revoke_jti("jti-1", purge_after=now + 120)  # an upsert, on both databases
    assert there.is_jti_revoked("jti-1") and not there.is_jti_revoked("jti-2")


def test_a_missing_sqlite_file_is_not_created_by_a_reader(tmp_path):
    with pytest.raises(FileNotFoundError, match="serve-app keys create"):
        KeyStore(tmp_path / "missing.sqlite3")
    assert not (tmp_path / "missing.sqlite3").exists()


def test_a_region_names_its_registry_by_env_var_and_an_empty_one_fails_loudly(fresh_database):
    args = AuthArgs(key_registry_dsn_env="REGISTRY_DSN", signing_keys_path="/srv/signing-keys.json")
    args.check_region("yul")  # no key_store_path needed with a registry
    assert args.key_store({"REGISTRY_DSN": fresh_database}) == fresh_database
    with pytest.raises(ValueError, match="REGISTRY_DSN"):
        args.key_store({})


@pytest.mark.parametrize("dsn, described", [
    ("postgresql://serve_app:s3cret@db.internal:5432/registry",
     "user=serve_app password=*** dbname=registry host=db.internal port=5432"),
    ("postgresql://:s3cret@db/reg", "password=*** dbname=reg host=db"),  # no user
    ("postgresql://app@db/reg?password=s3cret&sslmode=require&sslpassword=k3y",
     "user=app password=*** dbname=reg host=db sslmode=require sslpassword=***"),
    ("host=db password='s3 cr\\'et' user=app", "password=*** host=db user=app"),
    ("host=db password=ab&cd user=app", "password=*** host=db user=app"),
    ("host=db password=ab\\ cd user=app", "password=*** host=db user=app"),
    ("host=db passwrd=s3cret", "(a DSN libpq cannot read)"),  # not shown at all
])
def test_the_dsn_is_never_logged_with_its_password(dsn, described):
    """Every form libpq reads a secret in (a URL's user info or query, keywords, quoting)."""
    shown = PostgresDatabase(dsn).describe()
    assert sorted(shown.split()) == sorted(described.split())  # libpq's keywords, in its order
    assert "s3" not in shown and "k3y" not in shown


def test_a_dsn_in_libpqs_keywords_is_a_registry_not_a_sqlite_path_named_with_its_password():
    """`--key-store "host=db user=app password=..."` (or the region's env var so written) was taken
    for a SQLite file, whose "does not exist" error printed the whole string."""
    from serve_app.auth.database import RegistryUnavailable, is_dsn, open_database
    from tests.conftest import free_port

    for path in ("/var/lib/serve_app/keys.sqlite3", "keys.sqlite3", ".state/keys.sqlite3", "C:/keys.sqlite3"):
        assert not is_dsn(path)
    dsn = f"host=127.0.0.1 port={free_port()} user=app password=s3cret dbname=registry"
    database = open_database(dsn)
    assert isinstance(database, PostgresDatabase)
    with pytest.raises(RegistryUnavailable) as refused:
        with database.connect():
            pass
    assert "s3cret" not in "".join(traceback.format_exception(refused.value))


@pytest.mark.parametrize("dsn", ["postgresql://ops:Tr0ub%4dor%&3@db/serve_app", "host=db password='s3cret"])
def test_a_dsn_libpq_cannot_read_is_refused_without_showing_its_password(dsn):
    """libpq's message for a password with a stray ``%`` (or an open quote) quotes it: the CLI
    printed it to the terminal, a router to its log."""
    from serve_app.auth.database import RegistryUnavailable

    with pytest.raises(RegistryUnavailable) as refused:
        with PostgresDatabase(dsn).connect():
            pass
    shown = "".join(traceback.format_exception(refused.value))
    assert "cannot be read" in shown and "Tr0ub" not in shown and "s3cret" not in shown


def test_a_registry_outage_is_a_503_with_retry_after_not_a_500(tmp_path, fresh_database):
    import asyncio

    from serve_app.auth.database import PostgresDatabase, RegistryUnavailable
    from serve_app.errors import APIError
    from tests.conftest import free_port
    from auth_support import authenticator

    auth = authenticator(tmp_path)
    auth.keys = KeyStore(fresh_database, cache_ttl_s=0)
    key, _ = auth.keys.create_key(owner="alice", tier="standard")
    auth.keys.database = PostgresDatabase(f"postgresql://serve_app@127.0.0.1:{free_port()}/gone")  # the server went away
    with pytest.raises(RegistryUnavailable):
        auth.keys.lookup(key)
    with pytest.raises(APIError) as refused:
        asyncio.run(auth.authenticate_async(f"Bearer {key}", scope=SCOPE_INFERENCE))
    assert refused.value.status == 503 and refused.value.code == "key_registry_unavailable"
    assert refused.value.headers["Retry-After"] and "127.0.0.1" not in refused.value.message


def test_reads_go_to_the_regions_read_replica_and_writes_to_the_primary(postgres_dsn):
    """A replica is another server in production; here another database stands in for it, so a
    read that went to the primary would find what only the primary holds."""
    from tests.postgres_server import new_database

    primary, replica = new_database(postgres_dsn), new_database(postgres_dsn)
    KeyStore(replica)  # the replica's schema (replication would bring it)
    here = KeyStore(primary, cache_ttl_s=0, replica=replica)
    key, record = here.create_key(owner="alice", tier="standard")  # a write: to the primary
    assert KeyStore(primary, cache_ttl_s=0).lookup(key) == record
    assert here.lookup(key) is None  # a read: from the replica, which has not got it
    assert here.list_keys() == []
    assert here.revoke_key(record.key_id)  # writes find the primary's row
    assert KeyStore(primary, cache_ttl_s=0).get(record.key_id).disabled_at is not None


def test_a_tokens_key_the_replica_has_not_got_yet_is_read_from_the_primary(postgres_dsn):
    """A key created a moment ago, whose token another region minted (its first request failed
    over here): the replica lags, the primary holds it. A token for a key id nobody holds is
    still none."""
    from tests.postgres_server import new_database

    primary, replica = new_database(postgres_dsn), new_database(postgres_dsn)
    KeyStore(replica)
    here = KeyStore(primary, cache_ttl_s=0, replica=replica)
    _, record = KeyStore(primary).create_key(owner="alice", tier="standard")  # through another region
    assert here.get(record.key_id) == record
    assert here.get("0000ffffffff") is None


def test_reads_go_to_the_primary_while_the_replica_cannot_be_reached(fresh_database, caplog):
    """The region's replica away (a failover, a link down): key lookups read the primary, and the
    replica is not asked again for REPLICA_AWAY_S, instead of every lookup failing 503 after its
    connect timeout while /health said the region served."""
    from tests.conftest import free_port

    gone = f"postgresql://serve_app@127.0.0.1:{free_port()}/replica"
    _, record = KeyStore(fresh_database).create_key(owner="alice", tier="standard")
    here = KeyStore(fresh_database, cache_ttl_s=0, replica=gone)
    assert here.get(record.key_id) == record  # the replica refused: read from the primary
    assert "reading from the primary" in caplog.text and "127.0.0.1" in caplog.text
    connects = []
    opened = here.database._open
    here.database._open = lambda dsn: connects.append(dsn) or opened(dsn)
    assert here.get(record.key_id) == record
    assert gone not in connects  # not asked again within REPLICA_AWAY_S
    here.database._replica_away_until = 0.0  # its 30 s are over: the replica is asked again
    here.get(record.key_id)
    assert connects[-1] == gone


def test_a_replica_that_fails_mid_read_sends_the_next_reads_to_the_primary(postgres_dsn):
    """A kept connection to a replica that vanished without a FIN fails its statement (after the
    15 s timeout), not its connect: that too marks the replica away."""
    import psycopg

    from serve_app.auth.database import RegistryUnavailable
    from tests.postgres_server import new_database

    primary, replica = new_database(postgres_dsn), new_database(postgres_dsn)
    KeyStore(replica)
    here = KeyStore(primary, cache_ttl_s=0, replica=replica)
    key, record = here.create_key(owner="alice", tier="standard")  # on the primary only
    assert here.lookup(key) is None  # read on the replica, which has not got it
    with pytest.raises(RegistryUnavailable):
        with here.database.connect(read=True):
            raise psycopg.OperationalError("server closed the connection unexpectedly")
    assert here.lookup(key) == record  # read on the primary now


def test_the_read_replica_is_named_by_env_and_only_beside_a_primary():
    args = AuthArgs(key_registry_dsn_env="PRIMARY", key_registry_read_dsn_env="REPLICA")
    assert args.key_store_replica({"PRIMARY": "postgresql://p/x", "REPLICA": "postgresql://r/x"}) == "postgresql://r/x"
    assert args.key_store_replica({"PRIMARY": "postgresql://p/x", "REPLICA": " "}) is None  # empty: all on the primary
    assert AuthArgs(key_registry_read_dsn_env="REPLICA").key_store_replica({"REPLICA": "postgresql://r/x"}) is None


def _replicated(primary: KeyStore, replica: str, key_id: str) -> None:
    """Copy a key's row as the primary holds it now to ``replica`` (what replication would bring,
    up to that moment: from then on the replica lags)."""
    with primary.database.connect() as db:
        row = dict(db.execute("SELECT * FROM api_keys WHERE key_id = ?", (key_id,)).fetchone())
    with KeyStore(replica).database.connect() as db:
        db.execute(f"INSERT INTO api_keys ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})", tuple(row.values()))


def test_a_revocation_reaches_a_router_whose_replica_lags_with_its_next_reading_of_the_primary(postgres_dsn):
    """A router's cached row is read again from the region's replica: one that lags (or has
    stopped replaying) kept a revoked key and a revoked token working, for as long as it lagged.
    The revocations are read from the primary (every cache_ttl_s in a router)."""
    from tests.postgres_server import new_database

    primary, replica = new_database(postgres_dsn), new_database(postgres_dsn)
    operator = KeyStore(primary, cache_ttl_s=0)  # the CLI, or another region's admin endpoint
    key, record = operator.create_key(owner="alice", tier="standard")
    _replicated(operator, replica, record.key_id)
    clock = Clock()
    router = KeyStore(primary, cache_ttl_s=5, replica=replica, clock=clock)
    jti = "J" * 22
    assert router.lookup(key).status(time.time()) == "active" and not router.is_jti_revoked(jti)
    assert operator.revoke_key(record.key_id)
    operator.revoke_jti(jti, purge_after=int(time.time()) + 900)
    clock.now += 6  # past the cache's 5 s: read again, from the replica, which has neither revocation
    assert router.lookup(key).status(time.time()) == "active" and not router.is_jti_revoked(jti)
    assert router.follow_revocations() == 2
    assert router.lookup(key).status(time.time()) == "revoked" and router.is_jti_revoked(jti)
    assert router.follow_revocations() == 0  # held already: not read whole again every pass
    clock.now += 3600  # held for good: no later read of the replica brings the key back
    assert router.lookup(key).status(time.time()) == "revoked"


def test_a_revocation_made_here_is_refused_here_at_once_whatever_the_replica_holds(postgres_dsn):
    from tests.postgres_server import new_database

    primary, replica = new_database(postgres_dsn), new_database(postgres_dsn)
    operator = KeyStore(primary, cache_ttl_s=0)
    key, record = operator.create_key(owner="alice", tier="standard")
    _replicated(operator, replica, record.key_id)
    router = KeyStore(primary, cache_ttl_s=5, replica=replica)
    assert router.lookup(key).status(time.time()) == "active"
    assert router.revoke_key(record.key_id)  # the router's own admin endpoint
    assert router.get(record.key_id).status(time.time()) == "revoked"  # not re-read from the replica


def test_a_bulk_revocation_is_read_whole_once_in_batches(registry):
    from serve_app.auth.keys import REVOCATION_ROWS_PER_READ

    store = KeyStore(registry, cache_ttl_s=0)
    count = REVOCATION_ROWS_PER_READ + 20
    with store.database.connect() as db:  # a bulk of keys, then revoked at once
        for i in range(count):
            db.execute("INSERT INTO api_keys VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       (f"{i:012x}", b"x", "acme", '["*"]', '["*"]', "standard", '["inference"]',
                        int(time.time()), None, int(time.time())))
    router = KeyStore(registry, cache_ttl_s=5)
    assert router.follow_revocations() == count  # every row, across two statements
    assert router.follow_revocations() == 0
    assert router.get(f"{count - 1:012x}").status(time.time()) == "revoked"

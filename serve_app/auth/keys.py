"""API keys: their format, their hashes, and the registry the router reads and the CLI writes.

A key is ``pgk_<key_id>_<secret>``. The prefix makes leaked keys easy to recognise (secret
scanners, log filters); the key id is public and names the row; the secret is 43 random base62
characters (~256 bits). Only SHA-256 of the secret is stored: with that much entropy a slow
password hash adds nothing, and a fast hash keeps verification cheap on every request.

Claims live in columns so the CLI can list and edit them. Reads go through a short TTL cache so a
router sees CLI edits within ``cache_ttl_s`` without a restart, and without a query per request;
lookups of ids the registry does not hold are cached too, and bounded (``cache.py``).

The registry is a SQLite file (the embedded default, one region) or PostgreSQL (``database.py``):
one registry every region reads, so a key created once works in each region its ``regions``
allow, and a revocation made anywhere is refused everywhere within ``cache_ttl_s``.
"""

import functools
import hashlib
import hmac
import json
import re
import secrets
import string
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serve_app.auth.cache import CacheMiss, LookupCache, MissBudget, RegistryBusy  # noqa: F401 (re-exported)
from serve_app.auth.database import open_database
from serve_app.auth.refresh import Refresher
from serve_app.telemetry.logs import module_logger

logger = module_logger(__name__)

PREFIX = "pgk"
ALL = "*"
SCOPE_INFERENCE = "inference"
SCOPE_ADMIN = "admin"
# With admin: every owner's keys and usage, and the region's models (load, unload). Its own scope
# since 2026-12-07: an admin key unrestricted in models and regions was one, so a customer's admin
# key made without --model/--region managed every tenant's keys. No key got it by the upgrade
# (that would have kept exactly those customers' keys operators): an operator gives it to its own
# keys with ``serve-app keys grant-operator`` (``grant_operator``).
SCOPE_OPERATOR = "operator"
SCOPES = (SCOPE_INFERENCE, SCOPE_ADMIN, SCOPE_OPERATOR)
# How far back each read of the revocations goes (``follow_revocations``): a revocation is dated
# by the clock of the host that made it (a router, an operator's machine), which may be this much
# behind; the rows read again are few (revocations are rare) and cost nothing to hold again.
REVOCATION_LOOK_BACK_S = 600
REVOCATION_ROWS_PER_READ = 500  # the rows of keys newly revoked, read this many a statement (a bulk revocation)

_ALPHABET = string.ascii_letters + string.digits
_SECRET_LEN = 43  # log2(62) * 43 ≈ 256 bits
# Key ids a router lists as real (about 100 bytes each in memory): past this, newer ids' lookups
# share the budget for unknown ids during a flood (``cache.py``).
MAX_KNOWN_IDS = 500_000
# Rows read again ahead of their expiry (cache.py, "Refresh ahead"): on this many threads of the
# store's own, at most MAX_PENDING_REFRESHES waiting or running at once (past that, rows expire and
# are read on a request's path, as without).
REFRESH_THREADS = 2
MAX_PENDING_REFRESHES = 16
# Used with fullmatch only: ``$`` (and ``match``) would accept a key followed by a newline.
_KEY_RE = re.compile(rf"{PREFIX}_([0-9a-f]{{12}})_([0-9A-Za-z]{{{_SECRET_LEN}}})")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS api_keys (
    key_id        TEXT PRIMARY KEY,
    secret_sha256 BLOB NOT NULL,
    owner         TEXT NOT NULL,
    models        TEXT NOT NULL,  -- JSON list of canonical model ids, or ["*"]
    regions       TEXT NOT NULL,  -- JSON list of region ids, or ["*"]
    tier          TEXT NOT NULL,
    scopes        TEXT NOT NULL,  -- JSON list, e.g. ["inference", "admin"]
    created_at    INTEGER NOT NULL,
    expires_at    INTEGER,        -- NULL: never
    disabled_at   INTEGER         -- NULL: active; set by `serve-app keys revoke`
);
-- Each router lists the ids created since its last listing (KeyStore.refresh_known_ids), and the
-- keys and tokens revoked lately, from the primary (KeyStore.follow_revocations).
CREATE INDEX IF NOT EXISTS api_keys_created_at ON api_keys (created_at);
CREATE INDEX IF NOT EXISTS api_keys_disabled_at ON api_keys (disabled_at);
CREATE TABLE IF NOT EXISTS revoked_tokens (
    jti         TEXT PRIMARY KEY,
    revoked_at  INTEGER NOT NULL,
    purge_after INTEGER NOT NULL  -- once the token has expired anyway, the row can go
);
CREATE INDEX IF NOT EXISTS revoked_tokens_revoked_at ON revoked_tokens (revoked_at);
"""


def digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def parse_key(raw: str) -> tuple[str, str] | None:
    """``(key_id, secret)`` when ``raw`` has the API-key shape, else None."""
    match = _KEY_RE.fullmatch(raw)
    return (match.group(1), match.group(2)) if match else None


_KEY_ID_RE = re.compile(r"[0-9a-f]{12}")
# A customer or team id: printable, no spaces or control characters (``keys list`` prints it to a
# terminal; a NUL is refused by PostgreSQL with an error of its own).
_OWNER_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@:+-]{0,127}")


def is_key_id(raw: str) -> bool:
    """Whether ``raw`` has a key id's shape (what a ``pgk_`` key carries after its prefix)."""
    return _KEY_ID_RE.fullmatch(raw) is not None


def owner_problem(owner: str) -> str | None:
    """Why ``owner`` cannot own a key, if it cannot."""
    if _OWNER_RE.fullmatch(owner) is None:
        return (f"owner {owner!r} is not an id: letters, digits and . _ @ : + - (at most 128, beginning with a "
                "letter or digit)")
    return None


def looks_like_key(raw: str) -> bool:
    return raw.startswith(PREFIX + "_")


@dataclass(frozen=True)
class KeyRecord:
    key_id: str
    owner: str
    models: tuple[str, ...]
    regions: tuple[str, ...]
    tier: str
    scopes: tuple[str, ...]
    created_at: int
    expires_at: int | None = None
    disabled_at: int | None = None
    secret_sha256: bytes = field(default=b"", repr=False)

    def secret_matches(self, secret: str) -> bool:
        # Constant-time: response timing must not reveal how much of a guessed hash matched.
        return hmac.compare_digest(digest(secret), self.secret_sha256)

    def status(self, now: float) -> str:
        if self.disabled_at is not None:
            return "revoked"
        if self.expires_at is not None and now >= self.expires_at:
            return "expired"
        return "active"

    def public(self) -> dict[str, Any]:
        """Everything but the hash: what `keys list` and the admin endpoint show."""
        return {
            "key_id": self.key_id,
            "owner": self.owner,
            "models": list(self.models),
            "regions": list(self.regions),
            "tier": self.tier,
            "scopes": list(self.scopes),
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "status": self.status(time.time()),
        }


class KeyStore:
    """``location``: a SQLite path, or a ``postgresql://`` DSN (``database.open_database``)."""

    def __init__(
        self,
        location: Path | str,
        *,
        cache_ttl_s: float = 5,
        create: bool = False,
        replica: str | None = None,
        miss_lookups_per_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``replica``: the DSN of the registry's read replica nearest this region, if any.
        ``miss_lookups_per_s``: how many raw keys of ids this store holds no row for it looks up
        a second (the router's bound on a flood of made-up ids); None: unbounded (the CLI)."""
        self.database = open_database(location, create=create, replica=replica)
        self.database.create_schema(_SCHEMA)
        budget = MissBudget(miss_lookups_per_s, clock) if miss_lookups_per_s else None
        # Every key id the registry holds, as last listed (refresh_known_ids): never budgeted.
        self._known_ids: set[str] = set()
        self._known_since = 0  # the newest created_at listed so far
        self._refresher = Refresher(REFRESH_THREADS, MAX_PENDING_REFRESHES, clock=clock)
        # A revoked key's row is final: revocation is for good (``revoke_key``).
        self._keys = LookupCache(
            cache_ttl_s, budget=budget, known=self._known_ids.__contains__, refresher=self._refresher, clock=clock,
            is_final=lambda record: record is not None and record.disabled_at is not None,
        )
        # Every answer is a row here ("not revoked" is the common one), and lookups follow a
        # valid signature, so no budget: a caller cannot choose a token's jti without a signing key.
        # "Revoked" is final (its row is purged only once the token has expired anyway).
        self._revoked = LookupCache(
            cache_ttl_s, is_miss=lambda _: False, is_final=lambda revoked: revoked is True,
            refresher=self._refresher, clock=clock,
        )

    def _connect(self, read: bool = False):
        # A transaction per operation (SQLite: on the thread's kept connection; PostgreSQL: on one
        # an earlier operation left, or a new one): reads are rare (cached). Reads may go to a read
        # replica: its lag adds to cache_ttl_s.
        return self.database.connect(read)

    # --- reads (cached) ---------------------------------------------------------------------
    def get(self, key_id: str, offline: bool = False) -> KeyRecord | None:
        """``offline``: from the cache only, or CacheMiss (the router's event loop never waits on
        the database: it retries the whole check in a thread, ``Authenticator.authenticate_async``).
        Never budgeted: callers hold a verified token or are the operator (``lookup`` is budgeted)."""
        return self._keys.get(key_id, lambda: self._load(key_id, primary_too=True), offline)

    def find(self, key_id: str, offline: bool = False) -> KeyRecord | None:
        """``get`` for an id a caller chose (an admin's usage query names any id): read as a raw
        key's id is, on the replica only, an id with no row spending the miss budget (RegistryBusy)."""
        return self._keys.get(key_id, functools.partial(self._load, key_id), offline, budgeted=True, ahead=False)

    def lookup(self, raw_key: str, offline: bool = False) -> KeyRecord | None:
        """The record whose secret ``raw_key`` carries, or None (bad shape, unknown, wrong secret).
        Anyone can send a well-formed key, so its id's lookup is budgeted (RegistryBusy): an id
        with no row here spends the miss budget."""
        parsed = parse_key(raw_key)
        if parsed is None:
            return None
        key_id = parsed[0]
        load = functools.partial(self._load, key_id)
        # Read ahead only for the key's holder: ids are public, and a wrong secret must not cost a query.
        record = self._keys.get(key_id, load, offline, budgeted=True, ahead=False)
        if record is None or not record.secret_matches(parsed[1]):
            return None
        self._keys.refresh_ahead(key_id, load)
        return record

    def is_jti_revoked(self, jti: str, offline: bool = False) -> bool:
        return self._revoked.get(jti, lambda: self._jti_row_exists(jti), offline)

    def close(self) -> None:
        """No more background re-reads (the router stopping); lookups still work."""
        self._refresher.close()

    def know_ids_of(self, other: "KeyStore") -> None:
        """Start from ``other``'s listing (a router's new store after its settings changed): the
        ids it knows are never budgeted as made-up here either, and the next listing goes on from
        where its last one got. Updated in place: the lookup cache holds the set's membership test."""
        since = other._known_since  # first: its listing adds ids before it moves this on
        self._known_ids.update(other._known_ids)
        self._known_since = max(self._known_since, since)

    def follow_revocations(self) -> int:
        """The keys and tokens revoked in the last ``REVOCATION_LOOK_BACK_S``, read from the
        primary and held as revoked here (for good, as any revocation): a key or token revoked in
        any region is refused here within one call's interval however far the region's read
        replica lags (a cached row is otherwise read again from the replica, which may not have
        the revocation yet). How many it held anew. The router calls it every ``cache_ttl_s``,
        where a read replica serves its lookups (without one they read the primary already)."""
        since = int(time.time()) - REVOCATION_LOOK_BACK_S
        with self._connect(read=False) as db:
            # The ids first, the whole rows of the keys not held as revoked here yet only: a bulk
            # revocation is read whole once, not every pass for ten minutes.
            ids = [row["key_id"] for row in db.execute("SELECT key_id FROM api_keys WHERE disabled_at >= ?", (since,))]
            new = [key_id for key_id in ids if getattr(self._keys.held(key_id), "disabled_at", None) is None]
            keys = []
            for start in range(0, len(new), REVOCATION_ROWS_PER_READ):
                batch = new[start:start + REVOCATION_ROWS_PER_READ]
                marks = ", ".join("?" * len(batch))
                keys += db.execute(f"SELECT * FROM api_keys WHERE key_id IN ({marks})", tuple(batch)).fetchall()
            jtis = db.execute("SELECT jti, purge_after FROM revoked_tokens WHERE revoked_at >= ?", (since,)).fetchall()
        for row in keys:
            self._keys.put_final(row["key_id"], _record(row))
        now = time.time()
        new_jtis = [row for row in jtis if self._revoked.held(row["jti"]) is not True]
        for row in new_jtis:  # held until the token would have expired anyway (its row's purge)
            self._revoked.put_final(row["jti"], True, for_s=row["purge_after"] - now)
        return len(keys) + len(new_jtis)

    def refresh_known_ids(self) -> int:
        """List the key ids created since the last listing (all of them the first time) into the
        ids whose lookups a flood of made-up ids can never hold back (``cache.py``), at most
        ``MAX_KNOWN_IDS``; how many are known. Revoked keys stay listed: they are real ids, and
        their lookup says revoked. A minute of overlap covers keys created as the last listing ran."""
        since = max(0, self._known_since - 60)
        with self._connect(read=True) as db:
            rows = db.execute(
                "SELECT key_id, created_at FROM api_keys WHERE created_at >= ? ORDER BY created_at LIMIT ?",
                (since, MAX_KNOWN_IDS + 1),
            ).fetchall()
        for row in rows:
            if len(self._known_ids) >= MAX_KNOWN_IDS:
                logger.warning("key registry: over %d keys; newer key ids share the unknown-id budget", MAX_KNOWN_IDS)
                break
            self._known_ids.add(row["key_id"])  # a set's add is atomic under the GIL: readers need no lock
            self._known_since = max(self._known_since, int(row["created_at"]))
        return len(self._known_ids)

    def _load(self, key_id: str, primary_too: bool = False) -> KeyRecord | None:
        """``primary_too``: a token's key that the read replica does not hold yet is read from the
        primary (a key created a moment ago, whose token another region minted: it would be
        refused). Only signed tokens name such ids, so no outsider chooses these queries."""
        with self._connect(read=True) as db:
            row = db.execute("SELECT * FROM api_keys WHERE key_id = ?", (key_id,)).fetchone()
        if row is None and primary_too and getattr(self.database, "replica", None):
            with self._connect(read=False) as db:
                row = db.execute("SELECT * FROM api_keys WHERE key_id = ?", (key_id,)).fetchone()
        return _record(row) if row else None

    def _jti_row_exists(self, jti: str) -> bool:
        with self._connect(read=True) as db:
            return db.execute("SELECT 1 FROM revoked_tokens WHERE jti = ?", (jti,)).fetchone() is not None

    # --- writes (the CLI and the admin endpoint) --------------------------------------------
    def create_key(
        self,
        *,
        owner: str,
        tier: str,
        models: tuple[str, ...] = (ALL,),
        regions: tuple[str, ...] = (ALL,),
        scopes: tuple[str, ...] = (SCOPE_INFERENCE,),
        expires_at: int | None = None,
    ) -> tuple[str, KeyRecord]:
        """A new key. The returned string is the only copy of the secret that will ever exist."""
        unknown = set(scopes) - set(SCOPES)
        if unknown:
            raise ValueError(f"unknown scopes {sorted(unknown)}; known: {', '.join(SCOPES)}")
        if SCOPE_OPERATOR in scopes and SCOPE_ADMIN not in scopes:
            raise ValueError("the operator scope needs the admin scope")
        if (problem := owner_problem(owner)) is not None:
            raise ValueError(problem)
        secret = "".join(secrets.choice(_ALPHABET) for _ in range(_SECRET_LEN))
        record = KeyRecord(
            key_id=secrets.token_hex(6),
            owner=owner,
            models=tuple(models),
            regions=tuple(regions),
            tier=tier,
            scopes=tuple(scopes),
            created_at=int(time.time()),
            expires_at=expires_at,
            secret_sha256=digest(secret),
        )
        with self._connect() as db:
            db.execute(
                "INSERT INTO api_keys VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, NULL)",
                (
                    record.key_id,
                    record.secret_sha256,
                    owner,
                    json.dumps(record.models),
                    json.dumps(record.regions),
                    tier,
                    json.dumps(record.scopes),
                    record.created_at,
                    expires_at,
                ),
            )
        self._keys.forget(record.key_id)  # were its id cached as a miss here, it works at once
        return f"{PREFIX}_{record.key_id}_{secret}", record

    def list_keys(self, owner: str | None = None) -> list[KeyRecord]:
        """Every key, or ``owner``'s only."""
        where, params = ("WHERE owner = ? ", (owner,)) if owner is not None else ("", ())
        with self._connect(read=True) as db:
            rows = db.execute(f"SELECT * FROM api_keys {where}ORDER BY created_at, key_id", params).fetchall()
        return [_record(row) for row in rows]

    def grant_operator(self, key_id: str) -> bool:
        """Add the operator scope (and admin) to ``key_id``'s; True if the key exists. The CLI's
        alone: an operator's own keys after the upgrade that made the scope."""
        with self._connect() as db:
            row = db.execute("SELECT scopes FROM api_keys WHERE key_id = ?", (key_id,)).fetchone()
            if row is None:
                return False
            scopes = json.loads(row["scopes"])
            wanted = [*scopes, *(scope for scope in (SCOPE_ADMIN, SCOPE_OPERATOR) if scope not in scopes)]
            db.execute("UPDATE api_keys SET scopes = ? WHERE key_id = ?", (json.dumps(wanted), key_id))
        self._keys.forget(key_id)
        return True

    def revoke_key(self, key_id: str, owner: str | None = None) -> bool:
        """Disable a key for good; True if it existed (and, given ``owner``, is that owner's).
        Tokens minted from it stop working too."""
        sql = "UPDATE api_keys SET disabled_at = COALESCE(disabled_at, ?) WHERE key_id = ?"
        params: tuple = (int(time.time()), key_id)
        if owner is not None:
            sql, params = sql + " AND owner = ?", (*params, owner)
        with self._connect() as db:
            revoked = db.execute(sql, params).rowcount > 0
            row = db.execute("SELECT * FROM api_keys WHERE key_id = ?", (key_id,)).fetchone() if revoked else None
        if row is not None:  # refused here at once, whatever the replica holds yet (another owner's id: untouched)
            self._keys.put_final(key_id, _record(row))
        return revoked

    def revoke_jti(self, jti: str, *, purge_after: int) -> None:
        now = int(time.time())
        with self._connect() as db:
            db.execute("DELETE FROM revoked_tokens WHERE purge_after < ?", (now,))
            db.execute(
                "INSERT INTO revoked_tokens VALUES (?, ?, ?) ON CONFLICT (jti) DO UPDATE"
                " SET revoked_at = excluded.revoked_at, purge_after = excluded.purge_after",
                (jti, now, purge_after),
            )
        self._revoked.put_final(jti, True, for_s=purge_after - time.time())


def _record(row) -> KeyRecord:
    """A row of either database (``sqlite3.Row`` or psycopg's dict row)."""
    return KeyRecord(
        key_id=row["key_id"],
        owner=row["owner"],
        models=tuple(json.loads(row["models"])),
        regions=tuple(json.loads(row["regions"])),
        tier=row["tier"],
        scopes=tuple(json.loads(row["scopes"])),
        created_at=row["created_at"],
        expires_at=row["expires_at"],
        disabled_at=row["disabled_at"],
        secret_sha256=bytes(row["secret_sha256"]),  # psycopg reads BYTEA as memoryview
    )

"""What an admin may see and do: the keys it lists and revokes, the usage it reads.

Key admin acts on the registry every region shares (a revocation applies everywhere), so only an
operator manages other owners' keys. Two kinds of admin (a key or token with the ``admin`` scope;
tokens signed by another region's key carry neither scope):

- an **operator**: the ``operator`` scope too (``serve-app keys create --operator``), or the
  local dev key: lists and revokes every key, reads every key's usage, loads and unloads models.
  Until 2026-12-07 any admin key unrestricted in models and regions was one, so a customer's
  admin key made without ``--model``/``--region`` managed every tenant; no key got the scope by
  the upgrade (an operator grants it to its own: ``serve-app keys grant-operator``);
- an **owner admin**, any other: lists, revokes and reads the usage of its own owner's keys only.
  Another owner's key looks exactly like a key that does not exist (404 ``key_not_found``, an
  empty report), so an owner admin cannot learn which ids other owners hold. It cannot load or
  unload a model: a model serves every owner in its region (``router/operations.set_wanted``).

``GET /v1/usage`` without ``key_id`` is any key's own usage (``inference`` scope); with one it is
an admin's view, through ``usage_filter``.
"""

from dataclasses import dataclass

from serve_app.auth.keys import ALL, SCOPE_ADMIN, SCOPE_INFERENCE, SCOPE_OPERATOR, is_key_id
from serve_app.auth.principal import Principal, forbidden
from serve_app.errors import APIError


def manages_every_key(caller: Principal) -> bool:
    """An operator: an admin with the operator scope (the local dev key has every scope, and is
    confined to the local region by construction)."""
    return SCOPE_ADMIN in caller.scopes and SCOPE_OPERATOR in caller.scopes


def may_revoke_token(caller: Principal, key_id: str, key_owner: str | None) -> bool:
    """Whether ``caller`` may revoke a token of ``key_id`` (owned by ``key_owner``; None: no such
    key): any caller its own key's (a leaked token, without revoking the key), an admin those of
    the keys it manages."""
    if key_id == caller.key_id:
        return True
    if SCOPE_ADMIN not in caller.scopes or key_owner is None:
        return False
    return manages_every_key(caller) or key_owner == caller.owner


def managed_owner(caller: Principal) -> str | None:
    """The owner whose keys ``caller`` may manage, or None for every owner (an operator).
    A caller without the admin scope manages nothing: 403 (the routes check it first)."""
    if SCOPE_ADMIN not in caller.scopes:
        raise forbidden("this endpoint needs the 'admin' scope", "insufficient_scope", SCOPE_ADMIN)
    return None if manages_every_key(caller) else caller.owner


@dataclass(frozen=True)
class UsageFilter:
    """What one usage report may cover: ``key_id`` None is every key, ``owner`` None every owner."""

    key_id: str | None
    owner: str | None


def usage_scope(key_id_param: str | None) -> str:
    """The scope ``GET /v1/usage`` authenticates for: one's own usage is inference's."""
    return SCOPE_INFERENCE if key_id_param is None else SCOPE_ADMIN


def usage_filter(caller: Principal, key_id_param: str | None) -> UsageFilter:
    """``GET /v1/usage``'s ``key_id`` (absent: the caller's own key; ``*``: every key; an id) as
    the report's filter: an owner admin's report is its owner's keys only, so another owner's key
    id reads as an empty report, like an id nobody holds."""
    if key_id_param is None:
        return UsageFilter(key_id=caller.key_id, owner=None)
    # "" would otherwise read as "every key"; anything but an id's shape (a NUL, say) never reaches
    # the database, which would refuse it with an error of its own.
    if key_id_param != ALL and not is_key_id(key_id_param):
        raise APIError(400, "key_id must be a key id or *", param="key_id", code="invalid_usage_query")
    return UsageFilter(key_id=None if key_id_param == ALL else key_id_param, owner=managed_owner(caller))

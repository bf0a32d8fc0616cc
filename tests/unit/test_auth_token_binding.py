"""A token never says more than the registry does (issue #22, item 6): where the registry holds
the token's key, its row decides the owner and tier, and the token may only narrow the row's
models, regions and scopes. A validly signed token from a peer region (an imported kid) is the
attack: whoever holds that region's signing key could otherwise bill another owner, or run at
another tier, with any key id they know."""

import asyncio
import time

import pytest

from serve_app.auth import tokens
from serve_app.auth.config import DEFAULT_TIERS
from serve_app.auth.keys import SCOPE_ADMIN, SCOPE_INFERENCE
from serve_app.errors import APIError
from tests.unit.auth_support import MODEL, OTHER_MODEL, authenticator, claims, current_key, sign


def _bearer(token: str) -> str:
    return f"Bearer {token}"


@pytest.fixture
def regions(tmp_path):
    """yvr-01, which imports yul-02's public keys (its tokens verify in yvr), and the key store
    yvr reads (in production both regions read the one shared registry)."""
    yul = authenticator(tmp_path / "yul", region="yul-02", dev_api_key_env=None)
    yvr = authenticator(tmp_path / "yvr", region="yvr-01", dev_api_key_env=None, tiers=dict(DEFAULT_TIERS))
    keyset = tokens.load_keyset(yvr.keyset.path).with_imported(yul.jwks())
    tokens.save_keyset(yvr.keyset.path, keyset)
    yvr.keyset = tokens.KeysetFile(yvr.keyset.path, check_interval_s=0)
    return yul, yvr


def test_a_peer_token_claiming_another_owner_and_tier_runs_as_the_registry_says(regions):
    yul, yvr = regions
    _, record = yvr.keys.create_key(owner="globex", tier="free", models=(MODEL,), regions=("yvr-01",))
    # yul-02's signing key: a valid signature, imported in yvr-01; every claim beyond the key id a lie.
    lies = dict(owner="acme", tier="enterprise", models=["*"], regions=["*"], scope="inference admin")
    forged = sign(current_key(yul), claims(yvr, sub=record.key_id, **lies))
    caller = yvr.authenticate(_bearer(forged), scope=SCOPE_INFERENCE)
    assert (caller.owner, caller.tier) == ("globex", "free")
    assert caller.models == {MODEL} and caller.regions == {"yvr-01"} and caller.scopes == {SCOPE_INFERENCE}
    assert caller.signed_in == "yul-02"
    assert yvr.priority(caller, None) == DEFAULT_TIERS["free"].priority
    with pytest.raises(APIError) as refused:
        yvr.authorize_model(caller, OTHER_MODEL)
    assert refused.value.code == "model_not_allowed"
    # Charged as the free key it is: more than free's minute is refused outright.
    with pytest.raises(APIError) as too_big:
        asyncio.run(yvr.admit(caller, DEFAULT_TIERS["free"].tokens_per_minute + 1))
    assert too_big.value.code == "request_exceeds_tier_limit"


def test_our_own_tokens_follow_a_registry_edit_within_the_cache_ttl(regions):
    _, yvr = regions  # cache_ttl_s 0: the edit is seen at the next request
    raw, record = yvr.keys.create_key(owner="globex", tier="enterprise", scopes=(SCOPE_INFERENCE, SCOPE_ADMIN))
    token = asyncio.run(yvr.issue_token(None, raw))["access_token"]
    assert yvr.authenticate(_bearer(token), scope=SCOPE_ADMIN).tier == "enterprise"
    with yvr.keys.database.connect() as db:  # an operator downgrades the key
        db.execute(
            "UPDATE api_keys SET tier = ?, models = ?, scopes = ? WHERE key_id = ?",
            ("free", f'["{MODEL}"]', '["inference"]', record.key_id),
        )
    caller = yvr.authenticate(_bearer(token), scope=SCOPE_INFERENCE)  # the token still says enterprise
    assert (caller.tier, caller.models) == ("free", {MODEL})
    with pytest.raises(APIError) as refused:
        yvr.authenticate(_bearer(token), scope=SCOPE_ADMIN)
    assert refused.value.code == "insufficient_scope"


def test_a_token_may_narrow_its_key_but_never_widen_it(regions):
    _, yvr = regions
    _, wide = yvr.keys.create_key(owner="globex", tier="standard", scopes=(SCOPE_INFERENCE, SCOPE_ADMIN))
    narrow = sign(current_key(yvr), claims(yvr, sub=wide.key_id, owner="globex", models=[MODEL], scope="inference"))
    caller = yvr.authenticate(_bearer(narrow), scope=SCOPE_INFERENCE)
    assert caller.models == {MODEL} and caller.scopes == {SCOPE_INFERENCE}
    _, tight = yvr.keys.create_key(owner="globex", tier="standard", models=(MODEL,), regions=("yvr-01",))
    wider = sign(current_key(yvr), claims(yvr, sub=tight.key_id, owner="globex", scope="inference admin"))
    caller = yvr.authenticate(_bearer(wider), scope=SCOPE_INFERENCE)
    assert caller.models == {MODEL} and caller.regions == {"yvr-01"} and caller.scopes == {SCOPE_INFERENCE}


@pytest.mark.parametrize("sub", ["0000aaaa1111", "dev"])
def test_a_peer_token_for_a_key_the_registry_does_not_hold_is_refused(regions, sub):
    """Regions share one registry: such a token is a signer's word alone (a stolen peer key
    claiming any owner: its stored Responses, its bill, its cache salt). The dev key's token is
    honoured only where our own key signed it."""
    yul, yvr = regions
    now = int(time.time())
    token = sign(current_key(yul), claims(yvr, sub=sub, owner="acme", iat=now, nbf=now, exp=now + 300))
    with pytest.raises(APIError) as refused:
        yvr.authenticate(_bearer(token), scope=SCOPE_INFERENCE)
    assert (refused.value.status, refused.value.code) == (401, "invalid_token")
    assert "not in the key registry" in refused.value.message
    ours = sign(current_key(yvr), claims(yvr, sub="0000aaaa1111", owner="acme", iat=now, nbf=now, exp=now + 300))
    with pytest.raises(APIError) as also_refused:  # our own key's, for a key that is not (or no longer) there
        yvr.authenticate(_bearer(ours), scope=SCOPE_INFERENCE)
    assert also_refused.value.code == "invalid_token"


def test_a_dev_token_is_honoured_only_where_a_dev_key_is_set_and_our_own_key_signed_it(regions, tmp_path):
    _, yvr = regions  # a production region: no dev key
    now = int(time.time())
    dev = claims(yvr, sub="dev", owner="acme", tier="enterprise", iat=now, nbf=now, exp=now + 300)
    with pytest.raises(APIError) as refused:
        yvr.authenticate(_bearer(sign(current_key(yvr), dev)), scope=SCOPE_INFERENCE)
    assert refused.value.code == "invalid_token"
    local = authenticator(tmp_path / "local")  # make run's: the dev key is set
    caller = local.authenticate(_bearer(sign(current_key(local), claims(local, sub="dev", iat=now, nbf=now,
                                                                         exp=now + 300))), scope=SCOPE_INFERENCE)
    assert caller.key_id == "dev"

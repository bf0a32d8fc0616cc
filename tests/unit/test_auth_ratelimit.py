"""Token-bucket arithmetic on a fake clock, the token estimate, and 429s with their headers."""

import asyncio
import dataclasses

import pytest

from serve_app.auth.keys import SCOPE_ADMIN, SCOPE_INFERENCE
from serve_app.auth.ratelimit import RateLimiter
from tests.unit.auth_support import MODEL, authenticator, bearer, chat
from router_app import router_client


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


def test_requests_per_minute_refill_continuously(clock):
    limiter = RateLimiter(clock)
    assert [limiter.acquire("k", 2, 10_000, 1).allowed for _ in range(3)] == [True, True, False]
    denied = limiter.acquire("k", 2, 10_000, 1)
    assert denied.retry_after_s == pytest.approx(30)  # 2/min: one request every 30 s
    clock.now += 29
    assert not limiter.acquire("k", 2, 10_000, 1).allowed
    clock.now += 1
    allowed = limiter.acquire("k", 2, 10_000, 1)
    assert allowed.allowed and allowed.requests.remaining == 0
    assert allowed.requests.reset_s == pytest.approx(60)  # empty → full takes a minute


def test_tokens_per_minute_and_both_or_neither_are_charged(clock):
    limiter = RateLimiter(clock)
    assert limiter.acquire("k", 100, 1000, 700).allowed
    denied = limiter.acquire("k", 100, 1000, 400)
    assert not denied.allowed
    assert denied.tokens.remaining == 300
    assert denied.requests.remaining == 99  # the refused request cost nothing
    assert denied.retry_after_s == pytest.approx(6)  # 100 tokens at 1000/min
    assert limiter.acquire("k", 100, 1000, 300).allowed


def test_a_request_bigger_than_a_minute_of_tokens_costs_a_full_bucket_not_forever(clock):
    limiter = RateLimiter(clock)
    assert limiter.acquire("k", 100, 1000, 50_000).allowed
    assert not limiter.acquire("k", 100, 1000, 50_000).allowed
    clock.now += 60
    assert limiter.acquire("k", 100, 1000, 50_000).allowed


def test_keys_have_separate_buckets_and_tier_changes_apply_at_once(clock):
    limiter = RateLimiter(clock)
    assert limiter.acquire("a", 1, 1000, 1).allowed
    assert limiter.acquire("b", 1, 1000, 1).allowed
    assert not limiter.acquire("a", 1, 1000, 1).allowed
    clock.now += 1
    upgraded = limiter.acquire("a", 600, 1000, 1)  # 600/min refills 10 a second
    assert upgraded.allowed and upgraded.requests.limit == 600
    downgraded = limiter.acquire("a", 1, 1000, 1)  # clamped to the new, smaller bucket
    assert downgraded.requests.limit == 1 and downgraded.requests.remaining == 0


def test_idle_full_buckets_are_forgotten(clock):
    limiter = RateLimiter(clock)
    limiter.PRUNE_EVERY = 3
    limiter.acquire("a", 10, 1000, 1)
    limiter.acquire("b", 10, 1000, 1)
    clock.now += 60  # both full again
    limiter.acquire("c", 10, 1000, 1)
    assert limiter.bucket_count() == 2  # c's two buckets; a and b are gone


def test_a_lease_granted_as_a_sweep_runs_comes_out_of_the_buckets_kept(clock):
    """A full bucket is swept away; the lease on it must debit the bucket the limiter keeps."""
    limiter = RateLimiter(clock)
    limiter.PRUNE_EVERY = 2
    limiter.acquire("other", 10, 1000, 1)  # the next call is the one that sweeps
    decision, requests, tokens = limiter.lease("k", 600, 1_000_000, 1000, want_requests=30, want_tokens=50_000)
    assert decision.allowed and (requests, tokens) == (30, 50_000)
    assert decision.requests.remaining == 569 and decision.tokens.remaining == 949_000
    kept = limiter.peek("k", 600, 1_000_000, 0)
    assert (kept.requests.remaining, kept.tokens.remaining) == (569, 949_000)  # not a free slice


def test_headers_follow_openai_names():
    limiter = RateLimiter(Clock())
    limiter.acquire("k", 1, 1000, 10)
    headers = limiter.acquire("k", 1, 1000, 10).headers()
    assert headers["x-ratelimit-limit-requests"] == "1"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"] == "60.000s"
    assert headers["x-ratelimit-limit-tokens"] == "1000"
    assert headers["x-ratelimit-remaining-tokens"] == "990"
    assert headers["Retry-After"] == "60"
    assert headers["retry-after-ms"] == "60000"


def test_over_the_limit_is_429_with_retry_after_and_ratelimit_headers(tmp_path):
    auth = authenticator(tmp_path)
    client = router_client(auth)
    key, _ = auth.keys.create_key(owner="tiny", tier="tiny")  # 2 requests/min
    first = chat(client, key)
    assert first.status_code == 200
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert chat(client, key).status_code == 200
    refused = chat(client, key)
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert int(refused.headers["Retry-After"]) >= 1
    for name in ("limit", "remaining", "reset"):
        assert refused.headers[f"x-ratelimit-{name}-requests"]
        assert refused.headers[f"x-ratelimit-{name}-tokens"]
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"


def test_a_raw_key_and_its_tokens_share_one_budget(tmp_path):
    auth = authenticator(tmp_path)
    client = router_client(auth)
    key, _ = auth.keys.create_key(owner="tiny", tier="tiny")
    token = client.post("/v1/auth/token", json={"api_key": key}).json()["access_token"]
    assert chat(client, key).status_code == 200
    assert chat(client, token).status_code == 200
    assert chat(client, token).status_code == 429


def test_a_tier_missing_from_the_config_fails_closed(tmp_path):
    auth = authenticator(tmp_path)
    key, _ = auth.keys.create_key(owner="x", tier="platinum")
    response = chat(router_client(auth), key)
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "unknown_tier"


def test_a_limiter_outage_admits_within_the_routers_grace_only(tmp_path):
    from serve_app.auth.authenticator import Authenticator
    from serve_app.auth.lease import LeasedRateLimiter
    from serve_app.auth.ratelimit import SharedRateLimiter
    from tests.unit.auth_support import auth_args

    class Broken(SharedRateLimiter):
        def actor(self):
            raise ConnectionError("no ray here")

    auth = Authenticator(auth_args(tmp_path), "local", LeasedRateLimiter(Broken("local")), environ={})
    key, _ = auth.keys.create_key(owner="x", tier="tiny")
    client = router_client(auth)
    assert chat(client, key).status_code == 200
    assert chat(client, key).status_code == 429  # the grace is bounded (tests/unit/test_auth_audit.py)


def test_a_request_that_could_never_fit_the_tier_is_400_and_charges_no_tokens(tmp_path):
    auth = authenticator(tmp_path)
    client = router_client(auth)
    key, _ = auth.keys.create_key(owner="tiny", tier="tiny")  # 2 requests/min, 1000 tokens/min
    too_big = chat(client, key, n=4, max_tokens=300)  # 4 × 300 completion tokens > 1000
    assert too_big.status_code == 400
    error = too_big.json()["error"]
    assert (error["code"], error["param"]) == ("request_exceeds_tier_limit", "max_tokens")
    assert "Retry-After" not in too_big.headers
    # None of its tokens were charged; one of the minute's two requests was (it was read and
    # priced: test_a_request_refused_once_read_and_priced_still_costs_a_request_of_its_key).
    served = chat(client, key)
    assert served.status_code == 200 and served.headers["x-ratelimit-remaining-requests"] == "0"
    assert int(served.headers["x-ratelimit-remaining-tokens"]) > 1000 - 100  # the small chat's alone


# --- charging what a request cost beyond its estimate ------------------------------------------------
def test_a_charge_past_the_bucket_is_a_debt_the_next_requests_wait_out(clock):
    limiter = RateLimiter(clock)
    assert limiter.acquire("k", 100, 1000, 900).allowed
    window = limiter.charge("k", 1000, 600)  # the real prompt was 600 over the estimate
    assert window.remaining == 0  # never a negative header
    assert limiter._buckets[("k", "tokens")].level == -500
    denied = limiter.acquire("k", 100, 1000, 100)
    assert not denied.allowed and denied.retry_after_s == pytest.approx(36)  # -500 → 100 at 1000/min
    clock.now += 36
    assert limiter.acquire("k", 100, 1000, 100).allowed


def test_with_charges_a_key_gets_its_minute_plus_at_most_one_requests_under_estimate(clock):
    """A hostile prompt (digits: one token a byte) is estimated at a quarter of its real count.
    Charged the difference as each request ends, the key's real tokens over 10 minutes stay
    within 10 minutes' limit plus one bucket and one request's under-estimate; without the
    charge it would get four times its limit."""
    limiter = RateLimiter(clock)
    tpm, estimate, real = 10_000, 500, 2_000
    used = 0
    for _ in range(600):  # one attempt a second for 10 minutes
        if limiter.acquire("k", 1000, tpm, estimate).allowed:
            used += real
            limiter.charge("k", tpm, real - estimate)
        clock.now += 1
    assert used <= 10 * tpm + tpm + (real - estimate)
    assert used >= 10 * tpm - real  # and it is not starved either


def test_the_authenticator_charges_in_the_background_and_never_refuses(tmp_path):
    limiter = RateLimiter()
    auth = authenticator(tmp_path, limiter=limiter)
    key, _ = auth.keys.create_key(owner="tiny", tier="tiny")  # 1000 tokens/min
    caller = auth.authenticate(f"Bearer {key}", scope=SCOPE_INFERENCE)

    async def run():
        await auth.admit(caller, 900)
        auth.charge(caller, 5000)
        auth.charge(caller, 0)  # nothing to charge: no task
        auth.charge(dataclasses.replace(caller, tier="gone"), 10)  # a tier this region lacks: nothing
        assert len(auth._charging) == 1
        await asyncio.gather(*auth._charging)

    asyncio.run(run())
    assert limiter._buckets[(caller.key_id, "tokens")].level == pytest.approx(100 - 5000, abs=1)


# --- the limiter before the body, and on every route (issue 22, item 3) ---------------------------
def test_a_key_over_its_limit_is_refused_before_its_body_is_read(tmp_path):
    auth = authenticator(tmp_path)
    client = router_client(auth)
    key, _ = auth.keys.create_key(owner="tiny", tier="tiny")  # 2 requests/min
    assert chat(client, key).status_code == chat(client, key).status_code == 200
    # Not JSON at all: a 429, not the body's 400, so the router never parsed it.
    refused = client.post("/v1/chat/completions", content=b"{not json" + b" " * 400, headers=bearer(key))
    assert (refused.status_code, refused.json()["error"]["code"]) == (429, "rate_limit_exceeded")
    assert int(refused.headers["Retry-After"]) >= 1 and refused.headers["x-ratelimit-remaining-requests"] == "0"


def test_a_body_its_tier_could_never_admit_is_refused_unread_declared_or_chunked(tmp_path):
    auth = authenticator(tmp_path)
    client = router_client(auth)
    key, _ = auth.keys.create_key(owner="tiny", tier="tiny")  # 1,000 tokens/min: 4,000 bytes of prompt
    declared = client.post("/v1/chat/completions", content=b"{not json" + b" " * 5000, headers=bearer(key))
    assert (declared.status_code, declared.json()["error"]["code"]) == (400, "request_exceeds_tier_limit")

    def chunks():
        yield b"{not json"
        for _ in range(10):
            yield b" " * 1000

    chunked = client.post("/v1/chat/completions", content=chunks(), headers=bearer(key))
    assert (chunked.status_code, chunked.json()["error"]["code"]) == (400, "request_exceeds_tier_limit")
    assert chat(client, key).status_code == 200  # neither was charged: the key's 2 requests are left


METERED_ROUTES = [
    ("GET", "/v1/usage", False), ("GET", "/v1/responses/resp_x", False), ("DELETE", "/v1/responses/resp_x", False),
    ("POST", "/v1/responses/resp_x/cancel", False), ("GET", "/v1/models", False), ("GET", f"/v1/models/{MODEL}", False),
    ("GET", "/v1/admin/keys", True), ("POST", "/v1/admin/keys/pgk_0123456789ab/revoke", True),
    ("POST", "/v1/models/load", True), ("POST", "/v1/models/unload", True),
]


@pytest.mark.parametrize(("method", "path", "admin"), METERED_ROUTES)
def test_every_authenticated_route_costs_a_request_of_the_keys_limit(tmp_path, method, path, admin):
    auth = authenticator(tmp_path)
    client = router_client(auth)
    scopes = (SCOPE_INFERENCE, SCOPE_ADMIN) if admin else (SCOPE_INFERENCE,)
    key, _ = auth.keys.create_key(owner="tiny", tier="tiny", scopes=scopes)  # 2 requests/min
    answered = [client.request(method, path, headers=bearer(key)) for _ in range(3)]
    assert [a.status_code for a in answered[:2]] != [429, 429] and answered[2].status_code == 429
    assert answered[2].json()["error"]["code"] == "rate_limit_exceeded"


def test_a_request_refused_once_read_and_priced_still_costs_a_request_of_its_key(router_app):
    """A refusal at admission (over the tier's minute, over the budget) cost the router a parse —
    and a Responses follow-up its stored conversation — so it costs the key one request: a key
    cannot have it done faster than its requests/min, and once they are spent it is refused
    before its body is read."""
    app = router_app()  # the tiny tier: 2 requests/min, 1,000 tokens/min
    over_tier, _ = app.auth.keys.create_key(owner="a", tier="tiny")
    over_budget, record = app.auth.keys.create_key(owner="b", tier="tiny")
    app.meter.store.set_budget(record.key_id, tokens_per_day=5, tokens_per_month=None)
    for key, code, refusal in ((over_tier, 400, "request_exceeds_tier_limit"), (over_budget, 429, "budget_exceeded")):
        for _ in range(2):
            answer = chat(app.client, key, max_tokens=995)  # with its prompt, over 1,000
            assert (answer.status_code, answer.json()["error"]["code"]) == (code, refusal)
        unread = app.client.post("/v1/chat/completions", content=b"{not json", headers=bearer(key))
        assert (unread.status_code, unread.json()["error"]["code"]) == (429, "rate_limit_exceeded")
    assert not app.engine.calls  # none of them reached a replica


def test_a_key_in_token_debt_still_pays_its_refusals_in_requests(clock):
    """A zero-token acquisition is a refusal's count (``count_refused``): it needs a request only,
    so a key whose real prompts put it in token debt cannot have bodies refused for free."""
    limiter = RateLimiter(clock)
    assert limiter.acquire("k", 3, 1000, 900).allowed
    limiter.charge("k", 1000, 2_000)  # its real prompt: 2,000 over the estimate
    counted = [limiter.acquire("k", 3, 1000, 0) for _ in range(3)]
    assert [d.allowed for d in counted] == [True, True, False]  # 3 a minute, the first request's included
    assert counted[-1].requests.remaining == 0 and counted[-1].retry_after_s > 0
    assert counted[0].tokens.remaining == 0 and counted[0].tokens.signed < -1_000  # the debt, kept for the routers
    assert not limiter.acquire("k", 3, 1000, 1).allowed  # a request the engine would run waits out the debt


def test_a_429_at_admission_costs_its_key_a_request(router_app):
    """Short of tokens, a request is refused at admission after its parse and price: that
    refusal costs a request as every other does, so a key cannot be refused there faster than its
    requests/min — and once they are spent, it is refused before its body is read."""
    app = router_app()  # the tiny tier: 2 requests/min, 1,000 tokens/min
    key, _ = app.auth.keys.create_key(owner="a", tier="tiny")
    assert chat(app.client, key, max_tokens=900).status_code == 200
    short = chat(app.client, key, max_tokens=900)
    assert (short.status_code, short.json()["error"]["code"]) == (429, "rate_limit_exceeded")
    unread = app.client.post("/v1/chat/completions", content=b"{not json", headers=bearer(key))
    assert (unread.status_code, unread.json()["error"]["code"]) == (429, "rate_limit_exceeded")  # not 400
    assert unread.headers["x-ratelimit-remaining-requests"] == "0"


def test_the_shared_limiter_actor_is_placed_on_the_node_of_the_router_that_creates_it():
    """Ray places an actor that asks for no resource on a node picked at random (a region's GPU
    worker as likely as its head), and a worker's scale-down restarted it with every bucket full."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from serve_app.auth.ratelimit import SharedRateLimiter

    options = SharedRateLimiter("yul-02").actor_options("ab" * 28)
    placed = options["scheduling_strategy"]
    assert isinstance(placed, NodeAffinitySchedulingStrategy) and (placed.node_id, placed.soft) == ("ab" * 28, True)
    assert options["num_cpus"] == 0 and options["lifetime"] == "detached" and options["name"] == "ratelimit-yul-02"

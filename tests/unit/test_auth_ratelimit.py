"""Token-bucket arithmetic on a fake clock, the token estimate, and 429s with their headers."""

import pytest

from serve_app.auth.ratelimit import UNSPECIFIED_COMPLETION_TOKENS, RateLimiter, request_token_cost
from tests.unit.auth_support import authenticator, chat
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


@pytest.mark.parametrize(
    "body, expected",
    [
        ({"messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 50}, 110 + 50),
        ({"prompt": "abcd" * 10, "max_completion_tokens": 5, "n": 2}, 10 + 10),
        ({"prompt": ""}, UNSPECIFIED_COMPLETION_TOKENS),
        ({"prompt": "", "max_tokens": "many", "n": -1}, UNSPECIFIED_COMPLETION_TOKENS),
    ],
)
def test_token_cost_is_estimated_up_front(body, expected):
    assert request_token_cost(body) == pytest.approx(expected, abs=2)


def test_token_cost_uses_the_received_body_size_when_given():
    body = {"messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 50}
    assert request_token_cost(body, body_bytes=4000) == 1000 + 50


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


def test_a_request_that_could_never_fit_the_tier_is_400_and_charges_nothing(tmp_path):
    auth = authenticator(tmp_path)
    client = router_client(auth)
    key, _ = auth.keys.create_key(owner="tiny", tier="tiny")  # 2 requests/min, 1000 tokens/min
    too_big = chat(client, key, n=4, max_tokens=300)  # 4 × 300 completion tokens > 1000
    assert too_big.status_code == 400
    error = too_big.json()["error"]
    assert (error["code"], error["param"]) == ("request_exceeds_tier_limit", "max_tokens")
    assert "Retry-After" not in too_big.headers
    # Nothing was charged: both of the minute's requests are still there.
    assert [chat(client, key).status_code for _ in range(2)] == [200, 200]

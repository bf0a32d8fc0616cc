"""How the authenticator's refusals look to the client: the status, code, ``param`` and
headers of each (401 and 403 themselves: ``principal.py``), and the log line that records one
without the credential."""

import time
from collections.abc import Iterator
from contextlib import contextmanager

from serve_app.auth.config import Tier
from serve_app.auth.database import RegistryUnavailable
from serve_app.auth.keys import KeyRecord
from serve_app.auth.principal import Principal, unauthorized
from serve_app.auth.ratelimit import Decision
from serve_app.errors import APIError, retry_later
from serve_app.telemetry.logs import module_logger

logger = module_logger(__name__)

# When the limiter cannot decide at all (a limiter without a grace of its own), callers wait this.
LIMITER_DOWN_RETRY_S = 1


def exceeds_tier(principal: Principal, tier: Tier, tokens: int, param: str = "max_tokens",
                 generates: bool = True) -> APIError:
    """``param``: the field to change (``Surface.size_param``): a completion limit, or the input
    of a route that generates nothing."""
    if generates:
        what, remedy = f"its prompt plus n × {param}", f"lower {param} or n, or shorten the prompt"
    else:
        what, remedy = f"its {param}", f"shorten {param} or split it across requests"
    return APIError(
        400,
        f"this request may cost up to {tokens} tokens ({what}), "
        f"more than tier {principal.tier} allows in a minute ({tier.tokens_per_minute}); {remedy}",
        param=param,
        code="request_exceeds_tier_limit",
    )


def rate_limited(principal: Principal, tier: Tier, retry_after_s: float, headers: dict[str, str]) -> APIError:
    return APIError(
        429,
        f"Rate limit reached for key {principal.key_id} (tier {principal.tier}: "
        f"{tier.requests_per_minute} requests/min, {tier.tokens_per_minute} tokens/min); "
        f"retry in {retry_after_s:.1f}s",
        code="rate_limit_exceeded",
        headers=headers,
    )


def bearer(authorization: str | None) -> str:
    if not authorization or not authorization.strip():
        raise unauthorized(
            "missing Authorization header; send 'Authorization: Bearer <API key or token>'",
            "missing_authorization",
            error=None,
        )
    parts = authorization.split()
    if len(parts) != 2 or parts[0].lower() != "bearer":
        raise unauthorized(
            "malformed Authorization header; expected 'Bearer <API key or token>'",
            "invalid_authorization_header",
            error="invalid_request",
        )
    return parts[1]


def decided(decision: Decision | None) -> Decision:
    """A limiter that cannot decide (None) fails closed. The router's limiter never does: it
    keeps enforcing each key from its last known state while the actor is away (lease.py)."""
    if decision is None:
        raise APIError(
            503,
            "the rate limiter is unavailable; retry shortly",
            code="rate_limiter_unavailable",
            headers={"Retry-After": str(LIMITER_DOWN_RETRY_S)},
        )
    return decision


def check_active(record: KeyRecord) -> None:
    status = record.status(time.time())
    if status != "active":
        raise unauthorized(f"API key {record.key_id} is {status}", f"api_key_{status}")


@contextmanager
def logged_refusal() -> Iterator[None]:
    try:
        yield
    except APIError as err:
        logger.info("auth refused: %s %s", err.status, err.code)  # the code only, never the credential
        raise


def registry_unavailable(err: RegistryUnavailable) -> APIError:
    """A registry outage as the client sees it: 503 with Retry-After (the cause is logged here,
    never sent: it may name hosts)."""
    logger.warning("key registry unavailable: %s", err)
    return retry_later("the key registry is unavailable", "key_registry_unavailable")

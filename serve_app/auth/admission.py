"""May they do this, now: a known caller's model and engine priority, its admission against its
tier's limits (requests and tokens per minute, through a ``Limiter``: the rate-limit actor, or this
replica's lease of a key), and the charges and refunds that settle a request's real cost afterwards
(docs/auth.md, "Rate limits"). A base of ``Authenticator``, which holds what it reads: ``args``
(the tiers), ``region``, ``limiter`` and ``_charging`` (the background charges under way)."""

import asyncio
from typing import Any, Protocol

from serve_app.auth.config import AuthArgs, Tier
from serve_app.auth.principal import Principal, forbidden
from serve_app.auth.ratelimit import Decision
from serve_app.auth.refusals import decided, exceeds_tier, rate_limited


class Limiter(Protocol):
    async def acquire(self, key_id: str, rpm: int, tpm: int, tokens: int) -> Decision | None: ...

    def refuses(self, key_id: str, rpm: int, tpm: int, tokens: int) -> Decision | None:
        """A refusal of a request costing ``tokens`` known without asking anyone, or None."""

    async def charge(self, key_id: str, rpm: int, tpm: int, tokens: int) -> object: ...


class Admission:
    args: AuthArgs
    region: str
    limiter: Limiter
    _charging: set[asyncio.Task]

    def authorize_model(self, principal: Principal, model_id: str) -> None:
        if not principal.allows_model(model_id):
            raise forbidden(f"this key is not allowed to use {model_id}", "model_not_allowed")

    def priority(self, principal: Principal, requested: Any) -> int:
        """The engine priority a request runs at: its tier's, or a lower one it asked for (a
        larger number); never a higher one. Called after ``admit`` (which refuses unknown tiers)."""
        floor = self.args.tiers[principal.tier].priority
        return max(floor, requested) if isinstance(requested, int) and not isinstance(requested, bool) else floor

    def refuse_early(self, principal: Principal, min_tokens: int, prompt_param: str = "messages") -> None:
        """Before the body is read, what ``admit`` would refuse for certain, so that it costs no
        parse: a tier this region does not offer (403), a request whose prompt alone, estimated
        from its declared size (``min_tokens``), is over the tier's minute (400 naming
        ``prompt_param``, the route's input), and a key that the limiter knows has no request, or
        fewer than ``min_tokens``, left now (429)."""
        tier = self._tier(principal)
        if min_tokens > tier.tokens_per_minute:
            raise exceeds_tier(principal, tier, min_tokens, prompt_param, generates=False)
        refusal = self.limiter.refuses(principal.key_id, tier.requests_per_minute, tier.tokens_per_minute, min_tokens)
        if refusal is not None:
            raise rate_limited(principal, tier, refusal.retry_after_s, refusal.headers())

    def body_limit(self, principal: Principal, chars_per_token: int) -> int:
        """The most bytes a body of ``principal``'s may have: its tier's minute of prompt tokens."""
        return self._tier(principal).tokens_per_minute * chars_per_token

    async def admit(self, principal: Principal, tokens_estimate: int, param: str = "max_tokens",
                    generates: bool = True) -> dict[str, str]:
        """Charge one request and its token estimate: the ``x-ratelimit-*`` headers, or 429.
        A refusal costs one request (``count_refused``): a key short of tokens cannot have its
        bodies parsed and priced faster than its requests/min by being refused here. ``param``,
        ``generates``: what a request too big for the tier is told to change (``exceeds_tier``)."""
        tier = self._tier(principal)
        if tokens_estimate > tier.tokens_per_minute:  # waiting would never help: not a 429
            await self.count_refused(principal)
            raise exceeds_tier(principal, tier, tokens_estimate, param, generates)
        decision = decided(await self.limiter.acquire(
            principal.key_id, tier.requests_per_minute, tier.tokens_per_minute, tokens_estimate))
        if not decision.allowed:
            await self.count_refused(principal)
            raise rate_limited(principal, tier, decision.retry_after_s, decision.headers())
        return decision.headers()

    async def count_refused(self, principal: Principal) -> None:
        """Charge one request (no tokens) for a request refused after its key was known (its
        body, its model, its stored conversation, its price, its budget): a refusal that cost the
        router a parse or a registry read is not free, so a key cannot have it done faster than
        its requests/min. Once they are spent, the next is refused unread."""
        tier = self.args.tiers.get(principal.tier)
        if tier is not None:
            await self.limiter.acquire(principal.key_id, tier.requests_per_minute, tier.tokens_per_minute, 0)

    def _tier(self, principal: Principal) -> Tier:
        tier = self.args.tiers.get(principal.tier)
        if tier is None:  # fail closed: a tier missing from this region's config is not "unlimited"
            raise forbidden(f"rate-limit tier {principal.tier!r} is not offered in region {self.region}", "unknown_tier")
        return tier

    def charge(self, principal: Principal, tokens: int) -> None:
        """Charge ``tokens`` more against the key's tokens/min, never refused: what a request
        turned out to cost beyond what ``admit`` charged (its real prompt over the estimate,
        docs/auth.md). Synchronous, for the moment a request ends; the limiter is told in the
        background (no actor call when this replica holds a lease of the key)."""
        if tokens > 0:
            self._tell_limiter(principal, tokens)

    def refund(self, principal: Principal, tokens: int) -> None:
        """Give back ``tokens`` of what ``admit`` charged, for a request this region admitted and
        then did not serve: failed by the gateway itself before any model replica took it (503
        ``model_loading``, ``overloaded``, a replica gone before its answer began…), or served by
        a peer region, which charges its own limits (``Context._not_served_here``). The request
        itself still counts (requests/min). Never for a shorter answer (docs/auth.md, "Rate limits")."""
        if tokens > 0:
            self._tell_limiter(principal, -tokens)

    def _tell_limiter(self, principal: Principal, tokens: int) -> None:
        tier = self.args.tiers.get(principal.tier)
        if tier is None:
            return
        charged = self.limiter.charge(principal.key_id, tier.requests_per_minute, tier.tokens_per_minute, tokens)
        task = asyncio.get_running_loop().create_task(charged)
        self._charging.add(task)  # held until done: the loop keeps only a weak reference
        task.add_done_callback(self._charging.discard)

"""What a request may cost, priced the way the engine will run it: one cost model for the router.

The router charges a request before the engine runs it (the rate limit's tokens/min, the
budget's escrow), so the charge must be the most the engine can generate for it — and the engine
must obey exactly the limit that was charged. ``price()`` does both, after strict validation and
alias resolution: it reads the one limit field the route's vLLM request model obeys, refuses the
limit fields that model would silently ignore (charged for one number, served another), writes
that one field back, sets it when the request has none, and counts the sequences the engine
generates. The body is changed in place; the replica receives exactly what was priced.

What vLLM 0.32 obeys (its serving code: ``get_max_tokens`` in ``entrypoints/serve/utils/api_utils``
and each route's ``to_sampling_params``; ``tests/unit/test_pricing.py`` checks every row against
vLLM's own request models, so an upgrade that changes a rule fails there):

  route        obeys                               ignored (400 here)                    sequences
  chat         max_completion_tokens if set,       max_output_tokens                     n
               else max_tokens
  completions  max_tokens (vLLM's default: 16)     max_completion_tokens,                prompts × n
                                                   max_output_tokens
  responses    max_output_tokens                   max_tokens, max_completion_tokens     1
  messages     max_tokens (required)               max_completion_tokens,                1
                                                   max_output_tokens

A completions ``prompt`` that is a list of strings or of token-id lists is one prompt per entry
(vLLM's ``prompt_to_seq``), each generating ``n``; one list of token ids is one prompt;
``prompt_embeds`` entries are prompts too. Beam search (``use_beam_search``) is refused: each of
its ``max_tokens`` steps submits every beam's whole prefix to the engine again and only the
returned beams are billed, so its cost has no price the router could state. ``best_of`` is not
a field of vLLM 0.32's chat or completions requests (ignored by the engine: one sequence per n).

The surfaces that generate nothing (their row in ``serve_app/surfaces``: ``embeddings``,
``count_tokens``, ``tokenize``, ``detokenize``) are priced by their prompt alone: embeddings by
their input tokens, which is what OpenAI charges them by (the estimate from size, or the exact
count of an input of token ids when that is more: a list of ids is ~2-7 bytes a token);
detokenize by its ids, exactly. What tokenize and count_tokens really counted is in their answer
(the row's ``counts``): the key's rate limit is charged the rest once it is known, as a
generation's real prompt is.

The prompt is estimated from the size of the body the router received, ``CHARS_PER_TOKEN`` bytes
a token: free (no second JSON encode, no tokenizer at the router), and it counts tools and
schemas too. It can be under the engine's real count (digits and CJK text tokenize at 1–3 bytes a
token; the chat template adds its own tokens): at most ``CHARS_PER_TOKEN`` times under for text,
plus the template. The rate limiter charges the difference once the real count is known
(``Authenticator.charge``, docs/auth.md).
"""

from dataclasses import dataclass
from typing import Any

from serve_app.errors import APIError
from serve_app.router.embeddings_schema import token_ids_in
from serve_app.router.request_schema import MAX_N
from serve_app.surfaces import BY_NAME, Limit

CHARS_PER_TOKEN = 4
# The most sequences one request may ask the engine for (a completions request's n × prompts): as
# many as chat's n may be. 500 prompts × n 128 once held a CPU engine's every slot for 9 minutes.
MAX_SEQUENCES = MAX_N
LIMIT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


@dataclass(frozen=True)
class Price:
    """The most a request may cost, in tokens: its prompt (estimated) plus ``sequences`` times
    the completion limit each of them obeys. ``limit_set_by_router``: the request set no limit
    and the router wrote one (the replica may lower it to the context the real prompt leaves,
    rather than refusing the request for an estimate it never made)."""

    prompt_tokens: int
    sequences: int
    completion_tokens_each: int
    limit_set_by_router: bool = False

    @property
    def completion_tokens(self) -> int:
        return self.sequences * self.completion_tokens_each

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def estimate_prompt_tokens(body_bytes: int) -> int:
    """The prompt's tokens, estimated from the size of the body that carries it."""
    return max(0, body_bytes) // CHARS_PER_TOKEN


def price(
    method: str, body: dict[str, Any], body_bytes: int, *, context_len: int, default_max_tokens: int | None,
    default_total: int | None = None,
) -> Price:
    """Price ``body`` (a replica ``method``'s, validated, model resolved) and normalise its limit
    in place so that the engine obeys exactly the limit priced. ``body_bytes``: the size of what
    the prompt came in (the request, plus a continued conversation's stored history);
    ``context_len``: the model's served context; ``default_max_tokens``: the limit of a request
    that sets none (``ModelDeploymentArgs.default_max_tokens``), each of its sequences;
    ``default_total``: the most such a request's sequences may generate together (what its key's
    tier leaves after the prompt), shared among them so that a request without a limit is served
    rather than refused for a limit it never set. APIError 400 for a limit field the route
    ignores, two chat limits that disagree, a limit over the context, beam search, the prompt's
    logprobs with ``n`` over 1."""
    prompt = estimate_prompt_tokens(body_bytes)
    if not BY_NAME[method].generates:
        if method == "embeddings":
            prompt = max(prompt, token_ids_in(body.get("input")))
        elif method == "detokenize":  # its tokens are the ids it sends: exact
            prompt = max(prompt, token_ids_in(body.get("tokens")))
        return Price(prompt, 0, 0)
    if method == "completions":  # a prompt of token ids is ~2 bytes an id: its count is exact
        prompt = max(prompt, token_ids_in(body.get("prompt")))
    route = BY_NAME[method].limit
    if method in ("chat", "completions"):  # the only requests vLLM runs beam search and prompt logprobs for
        _refuse_beam_search(body)
        _refuse_prompt_logprobs_per_sample(method, body)
    limit = _limit(route, method, body, context_len)
    set_by_router = limit is None
    sequences = _sequences(method, body)
    if sequences > MAX_SEQUENCES:  # one request holding the engine's every slot for minutes
        raise APIError(
            400,
            f"this request would generate {sequences} sequences (n × prompts); at most {MAX_SEQUENCES} a request",
            param="n" if body.get("n") not in (None, 1) else "prompt",
            code="too_many_sequences",
        )
    if limit is None:
        ceiling = min(default_max_tokens, route.default_cap or default_max_tokens)
        if default_total is not None:
            ceiling = min(ceiling, default_total // sequences)
        limit = max(1, min(ceiling, context_len - prompt))
    if route.also_read is not None:
        body.pop(route.also_read, None)
    body[route.field] = limit
    # Completions' max_tokens 0 (echo: score the prompt) still runs one step: vLLM sends 1.
    return Price(prompt, sequences, max(1, limit), set_by_router)


def ignored_limit_fields(route: Limit) -> tuple[str, ...]:
    """The limit fields the surface's vLLM request model would silently ignore."""
    return tuple(f for f in LIMIT_FIELDS if f not in (route.field, route.also_read))


def _limit(route: Limit, method: str, body: dict[str, Any], context_len: int) -> int | None:
    """The limit the request set, in the field the engine obeys; None when it set none."""
    for field in ignored_limit_fields(route):
        if body.get(field) is not None:
            raise APIError(
                400,
                f"{field} is not a limit on {BY_NAME[method].route}, which would ignore it and generate up to "
                f"its own limit; set {route.field} instead",
                param=field,
                code="unsupported_limit_field",
            )
    limit, field = body.get(route.field), route.field
    if route.also_read is not None and (other := body.get(route.also_read)) is not None:
        if limit is not None and other != limit:
            raise APIError(
                400,
                f"{route.field} ({limit}) and {route.also_read} ({other}) disagree; the engine would obey "
                f"{route.field} alone: set one of them",
                param=route.also_read,
                code="conflicting_limits",
            )
        if limit is None:
            limit, field = other, route.also_read
    if limit is not None and limit > context_len:  # could never be served: 400, not a 429 for its cost
        raise APIError(
            400,
            f"{field} is {limit}, more than the model's context of {context_len} tokens (prompt included)",
            param=field,
            code="context_length_exceeded",
        )
    return limit


def _sequences(method: str, body: dict[str, Any]) -> int:
    """How many sequences the engine generates: chat ``n``; completions one per prompt per ``n``;
    Responses and Messages have no ``n`` (vLLM ignores one sent anyway)."""
    if method not in ("chat", "completions"):
        return 1
    n = body.get("n")
    n = n if isinstance(n, int) and n >= 1 else 1  # validated already; None is vLLM's 1
    return n * prompt_count(body) if method == "completions" else n


def prompt_count(body: dict[str, Any]) -> int:
    """The prompts of a completions body, as vLLM's ``prompt_to_seq`` splits ``prompt_embeds``
    and ``prompt``: a string or one list of token ids is one prompt, any other list one per entry."""
    return sum(_entries(body.get(field)) for field in ("prompt_embeds", "prompt"))


def _entries(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, (str, bytes, dict)):
        return 1
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return 1
    return len(value) if isinstance(value, list) else 1


def _asks_prompt_logprobs(method: str, body: dict[str, Any]) -> bool:
    """Whether vLLM computes the prompt's logprobs: asked for (a vLLM extra), or implied by
    ``echo`` (completions: with ``logprobs``; chat: always, ``top_logprobs`` defaulting to 0)."""
    if body.get("prompt_logprobs") is not None:
        return True
    return bool(body.get("echo")) and (method == "chat" or body.get("logprobs") is not None)


def _refuse_prompt_logprobs_per_sample(method: str, body: dict[str, Any]) -> None:
    """vLLM computes a prompt's logprobs once for each of the ``n`` samples, each prefilling the
    whole prompt (such a request reads nothing from the prefix cache), and repeats them in every
    choice: an 8,000-token prompt with n 128 was 128 full prefills and ~20M logprob entries on
    the replica every tenant shares, priced and billed as one prompt."""
    n = body.get("n")
    if isinstance(n, int) and n > 1 and _asks_prompt_logprobs(method, body):
        asked = "prompt_logprobs" if body.get("prompt_logprobs") is not None else "echo"
        raise APIError(
            400,
            f"the prompt's logprobs ({asked}) are computed again for each of the n samples, the whole prompt "
            "each time: set n to 1 (send one request a sample: each is priced as one prompt)",
            param="n",
            code="unsupported_parameter",
        )


def _refuse_beam_search(body: dict[str, Any]) -> None:
    if body.get("use_beam_search"):
        raise APIError(
            400,
            "beam search is not offered: its cost cannot be known before it runs (every step submits "
            "each beam's whole prefix again); use n for several samples",
            param="use_beam_search",
            code="unsupported_parameter",
        )

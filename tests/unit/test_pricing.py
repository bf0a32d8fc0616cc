"""The router's cost model (serve_app/router/pricing.py) against vLLM's own field handling.

Every rule of the price is checked against what vLLM 0.32's request models and ``get_max_tokens``
do with the body the router forwards: the completion limit the engine obeys, and how many
sequences it generates. A vLLM upgrade that changes a rule fails here. vLLM's protocol modules are
imported in this module only (no engine is started: ~8 s of imports)."""

import copy
import json
from types import SimpleNamespace
from typing import Any

import pytest

from serve_app import surfaces
from serve_app.errors import APIError
from serve_app.router import pricing
from serve_app.router.pricing import Price, price
from serve_app.router.request_schema import validate_body

vllm_chat = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest  # noqa: E402
from vllm.entrypoints.anthropic.serving import AnthropicServingMessages  # noqa: E402
from vllm.entrypoints.openai.completion.protocol import CompletionRequest  # noqa: E402
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest  # noqa: E402
from vllm.entrypoints.serve.utils.api_utils import get_max_tokens  # noqa: E402
from vllm.renderers.inputs.preprocess import prompt_to_seq  # noqa: E402

ChatCompletionRequest = vllm_chat.ChatCompletionRequest
CONTEXT = 8192
DEFAULT = 4096
MODEL = "qwen-3.6-35b-a3b"
MESSAGES = [{"role": "user", "content": "Write a limerick about the sea."}]


# --- what vLLM does with a body: (max_tokens each sequence obeys, sequences) ----------------------
def _chat_engine(request, prompt_tokens: int) -> tuple[int, int]:
    # build_tok_params is where ChatCompletionRequest picks its limit field (0: none set).
    requested = request.build_tok_params(SimpleNamespace(max_model_len=CONTEXT)).max_output_tokens or None
    max_tokens = get_max_tokens(CONTEXT, requested, prompt_tokens, {})
    params = request.to_sampling_params(max_tokens, {})
    return params.max_tokens, params.n


def engine(method: str, body: dict[str, Any], prompt_tokens: int) -> tuple[int, int]:
    """The completion limit vLLM runs ``body`` with, and the sequences it generates, for a
    prompt of ``prompt_tokens`` (as each route's serving code calls vLLM's own helpers)."""
    body = copy.deepcopy(body)
    if method == "chat":
        return _chat_engine(ChatCompletionRequest.model_validate(body), prompt_tokens)
    if method == "messages":
        request = AnthropicMessagesRequest.model_validate(body)
        return _chat_engine(AnthropicServingMessages.to_chat_completion_request(request), prompt_tokens)
    if method == "completions":
        request = CompletionRequest.model_validate(body)
        params = request.to_sampling_params(get_max_tokens(CONTEXT, request.max_tokens, prompt_tokens, {}), {})
        prompts = len(prompt_to_seq(request.prompt_embeds or [])) + len(prompt_to_seq(request.prompt))
        return params.max_tokens, prompts * params.n
    if method == "responses":
        request = ResponsesRequest.model_validate(body)
        truncate = -1 if request.truncation != "disabled" else None
        limit = get_max_tokens(CONTEXT, request.max_output_tokens, prompt_tokens, {}, truncate_prompt_tokens=truncate)
        return request.to_sampling_params(limit, {}).max_tokens, 1
    raise AssertionError(method)


def priced(method: str, body: dict[str, Any], body_bytes: int | None = None) -> Price:
    """The router's order: strict validation, then the price (which normalises ``body``)."""
    validate_body(method, body)
    size = len(json.dumps(body).encode()) if body_bytes is None else body_bytes
    return price(method, body, size, context_len=CONTEXT, default_max_tokens=DEFAULT)


def refusal(method: str, body: dict[str, Any]) -> APIError:
    with pytest.raises(APIError) as refused:
        priced(method, body)
    assert refused.value.status == 400
    return refused.value


def chat(**fields) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, **fields}


def completions(**fields) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Once upon a time", **fields}


def responses(**fields) -> dict[str, Any]:
    return {"model": MODEL, "input": "Write a limerick about the sea.", **fields}


def messages(**fields) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 64, **fields}


# --- the price is what vLLM runs --------------------------------------------------------------------
AGREEING = [
    ("chat", chat(max_tokens=300)),
    ("chat", chat(max_completion_tokens=300)),
    ("chat", chat(max_tokens=300, max_completion_tokens=300)),  # equal: fine
    ("chat", chat(max_completion_tokens=50, n=7)),
    ("chat", chat()),  # no limit: the router's default
    ("chat", chat(n=3)),
    ("completions", completions(max_tokens=200)),
    ("completions", completions()),  # vLLM's (and OpenAI's) default of 16
    ("completions", completions(max_tokens=100, n=2, prompt=["a", "b", "c"])),
    ("completions", completions(max_tokens=100, prompt=[1, 2, 3, 4])),  # one prompt of token ids
    ("completions", completions(max_tokens=100, n=4, prompt=[[1, 2], [3], [4, 5, 6]])),
    ("completions", completions(max_tokens=0, echo=True)),  # scoring: vLLM still runs one step
    ("responses", responses(max_output_tokens=500)),
    ("responses", responses()),
    ("responses", responses(truncation="auto")),
    ("messages", messages()),
    ("messages", messages(max_tokens=2000)),
]


@pytest.mark.parametrize("method, body", AGREEING)
def test_the_price_is_the_limit_and_the_sequences_vllm_runs_the_normalised_body_with(method, body):
    charged = priced(method, body)
    assert engine(method, body, charged.prompt_tokens) == (charged.completion_tokens_each, charged.sequences)
    assert charged.total == charged.prompt_tokens + charged.sequences * charged.completion_tokens_each


@pytest.mark.parametrize("method, body", AGREEING)
def test_the_normalised_body_carries_exactly_one_limit_field(method, body):
    priced(method, body)
    assert [f for f in pricing.LIMIT_FIELDS if f in body] == [surfaces.BY_NAME[method].limit.field]


def test_a_request_without_a_limit_gets_the_default_or_the_context_left_and_says_so():
    body = chat()
    charged = priced("chat", body, body_bytes=400)
    assert charged == Price(100, 1, DEFAULT, limit_set_by_router=True)
    assert body["max_completion_tokens"] == DEFAULT

    long_prompt = chat()
    charged = priced("chat", long_prompt, body_bytes=4 * 8000)  # ~8000 prompt tokens: 192 left
    assert charged.completion_tokens_each == 192 == long_prompt["max_completion_tokens"]
    assert engine("chat", long_prompt, charged.prompt_tokens)[0] == 192

    over = chat()
    assert priced("chat", over, body_bytes=4 * 9000).completion_tokens_each == 1  # never 0 or less

    assert priced("completions", completions()).completion_tokens_each == 16
    assert not priced("chat", chat(max_tokens=5)).limit_set_by_router


def test_the_completions_default_is_vllms_own():
    assert surfaces.COMPLETIONS_DEFAULT_MAX_TOKENS == CompletionRequest.model_fields["max_tokens"].default


def test_a_default_below_the_route_default_wins():
    body = completions()
    validate_body("completions", body)
    assert price("completions", body, 100, context_len=CONTEXT, default_max_tokens=8).completion_tokens_each == 8


def test_a_default_shares_what_the_tier_leaves_among_the_sequences():
    """A request that sets no limit gets one that its key's tier can admit with every sequence
    counted, so ``n`` or a list of prompts is served, never a 400 about a max_tokens it never sent."""
    body = chat(n=4)
    validate_body("chat", body)
    charged = price("chat", body, 400, context_len=CONTEXT, default_max_tokens=DEFAULT, default_total=1000 - 100)
    assert charged.completion_tokens_each == 225 and body["max_completion_tokens"] == 225
    assert charged.total <= 1000  # the tier's minute: admitted
    prompts = completions(prompt=["a", "b", "c"], n=2)
    validate_body("completions", prompts)
    assert price("completions", prompts, 100, context_len=CONTEXT, default_max_tokens=DEFAULT,
                 default_total=60).completion_tokens_each == 10
    one = chat()
    validate_body("chat", one)
    assert price("chat", one, 100, context_len=CONTEXT, default_max_tokens=DEFAULT,
                 default_total=10**6).completion_tokens_each == DEFAULT  # a roomy tier: the model's default


# --- limit fields the engine would ignore are refused ----------------------------------------------
IGNORED = [
    ("chat", chat(max_output_tokens=5), "max_output_tokens"),
    ("completions", completions(max_completion_tokens=5), "max_completion_tokens"),
    ("completions", completions(max_output_tokens=5), "max_output_tokens"),
    ("responses", responses(max_tokens=5), "max_tokens"),
    ("responses", responses(max_completion_tokens=5), "max_completion_tokens"),
    ("messages", messages(max_completion_tokens=5), "max_completion_tokens"),
    ("messages", messages(max_output_tokens=5), "max_output_tokens"),
]


@pytest.mark.parametrize("method, body, field", IGNORED)
def test_vllm_ignores_the_limit_fields_the_router_refuses(method, body, field):
    """Sent alone, the field changes nothing in vLLM: the engine would generate up to its own
    limit (here 64 on Messages, the default elsewhere) whatever the field says."""
    without = {k: v for k, v in body.items() if k != field}
    assert engine(method, body, 10) == engine(method, without, 10)
    assert engine(method, body, 10)[0] != 5


@pytest.mark.parametrize("method, body, field", IGNORED)
def test_a_limit_field_the_route_ignores_is_a_400_naming_it(method, body, field):
    refused = refusal(method, body)
    assert refused.param == field and refused.code == "unsupported_limit_field"
    assert surfaces.BY_NAME[method].limit.field in refused.message


def test_a_null_limit_field_is_no_limit_at_all():
    body = chat(max_output_tokens=None, max_tokens=None)
    assert priced("chat", body).limit_set_by_router


def test_two_chat_limits_that_disagree_are_a_400_and_vllm_would_obey_max_completion_tokens():
    body = chat(max_completion_tokens=10, max_tokens=8000)
    assert engine("chat", body, 10)[0] == 10  # which one vLLM obeys
    refused = refusal("chat", body)
    assert refused.code == "conflicting_limits" and refused.param == "max_tokens"


def test_a_limit_over_the_context_is_a_400_context_length_exceeded():
    refused = refusal("completions", completions(max_tokens=CONTEXT + 1))
    assert refused.code == "context_length_exceeded" and refused.param == "max_tokens"
    assert refusal("chat", chat(max_tokens=CONTEXT + 1)).param == "max_tokens"


@pytest.mark.parametrize("method, body", [("chat", chat(use_beam_search=True, n=4)), ("completions", completions(use_beam_search=True))])
def test_beam_search_is_refused(method, body):
    refused = refusal(method, body)
    assert refused.param == "use_beam_search" and refused.code == "unsupported_parameter"


def _vllm_prompt_logprobs(method: str, body: dict[str, Any]) -> bool:
    """Whether vLLM computes ``body``'s prompt logprobs, each sample its own prefill of the whole
    prompt (``skip_reading_prefix_cache``)."""
    model = ChatCompletionRequest if method == "chat" else CompletionRequest
    params = model.model_validate(copy.deepcopy(body)).to_sampling_params(16, {})
    assert params.skip_reading_prefix_cache == (params.prompt_logprobs is not None)
    return params.prompt_logprobs is not None


PROMPT_LOGPROBS = [
    ("chat", {"prompt_logprobs": 0}),
    ("chat", {"prompt_logprobs": 5}),
    ("chat", {"echo": True}),  # top_logprobs defaults to 0: the prompt's logprobs all the same
    ("chat", {"echo": True, "logprobs": True, "top_logprobs": 3}),
    ("chat", {"logprobs": True, "top_logprobs": 3}),  # the samples' logprobs only
    ("chat", {"echo": False}),
    ("completions", {"echo": True, "logprobs": 20, "max_tokens": 0}),
    ("completions", {"echo": True, "logprobs": 0}),
    ("completions", {"prompt_logprobs": 1}),
    ("completions", {"echo": True}),  # the prompt's text, no logprobs
    ("completions", {"logprobs": 5}),
]


@pytest.mark.parametrize("method, fields", PROMPT_LOGPROBS)
def test_prompt_logprobs_are_refused_with_several_samples_exactly_when_vllm_computes_them(method, fields):
    body = (chat if method == "chat" else completions)(**fields)
    assert priced(method, {**copy.deepcopy(body), "n": 1}).sequences == 1  # one sample: one prefill, priced
    if _vllm_prompt_logprobs(method, body):
        refused = refusal(method, {**body, "n": 128})
        assert refused.param == "n" and refused.code == "unsupported_parameter"
    else:
        assert priced(method, {**body, "n": 4}).sequences == 4


# --- sequences ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "prompt",
    ["text", ["a"], ["a", "b", "c"], [7], [7, 8, 9], [[7], [8, 9]], [], [[]]],
)
def test_prompts_are_counted_as_vllm_splits_them(prompt):
    assert pricing.prompt_count({"prompt": prompt}) == len(prompt_to_seq(prompt))


def test_prompt_embeds_are_prompts_too():
    assert pricing.prompt_count({"prompt": "x", "prompt_embeds": ["e1", "e2"]}) == 3
    assert pricing.prompt_count({"prompt": "x", "prompt_embeds": "e1"}) == 2


def test_vllm_has_no_other_field_that_limits_or_multiplies_generation():
    """A new limit or multiplier field in vLLM (best_of back, n on Responses) must be priced."""
    watched = ("max_tokens", "max_completion_tokens", "max_output_tokens", "n", "best_of", "use_beam_search", "prompt_embeds")
    fields = {
        "chat": {"max_tokens", "max_completion_tokens", "n", "use_beam_search"},
        "completions": {"max_tokens", "n", "use_beam_search", "prompt_embeds"},
        "responses": {"max_output_tokens"},
        "messages": {"max_tokens"},
    }
    models = {"chat": ChatCompletionRequest, "completions": CompletionRequest, "responses": ResponsesRequest, "messages": AnthropicMessagesRequest}
    for method, model in models.items():
        assert {f for f in model.model_fields if f in watched} == fields[method], method


# --- priced by size ----------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["tokenize", "detokenize", "count_tokens"])
def test_counting_routes_are_priced_by_their_size_and_generate_nothing(method):
    body = {"model": MODEL, "prompt": "x" * 200_000}
    charged = price(method, body, 200_000, context_len=CONTEXT, default_max_tokens=DEFAULT)
    assert charged == Price(50_000, 0, 0) and charged.total == 50_000
    assert body == {"model": MODEL, "prompt": "x" * 200_000}  # nothing to normalise


@pytest.mark.parametrize("prompt", [[0] * 50_000, [[0] * 25_000, [7] * 25_000]])
def test_a_completions_prompt_of_token_ids_is_priced_by_their_count_not_their_bytes(prompt):
    """"0," is 2 bytes a token: 50,000 ids were priced as 25,009 tokens (half), as embeddings'
    input of ids was before it was counted."""
    body = completions(prompt=prompt, max_tokens=10)
    raw = len(json.dumps(body, separators=(",", ":")))  # as a client sends it compact
    assert pricing.estimate_prompt_tokens(raw) < 30_000
    charged = price("completions", body, raw, context_len=100_000, default_max_tokens=DEFAULT)
    assert charged.prompt_tokens == 50_000


# --- the attacks of issue #22 ("The charge is not what the engine generates", bullets 1-3) ----------
def charge(method: str, body: dict[str, Any], size: int) -> int | None:
    """The tokens the router charges for ``body`` of ``size`` bytes, normalising it as the
    replica will receive it (None: refused with a 400, so nothing runs)."""
    try:
        return priced(method, body, size).total
    except APIError as err:
        assert err.status == 400
        return None


ATTACKS = [
    # 1: six prompts, each generating 8000, charged as one on a 40,000/min free key
    ("completions", completions(prompt=["Tell me a story."] * 6, max_tokens=8000)),
    # 2: the router read max_completion_tokens (1); completions and Messages obey max_tokens (8000)
    ("completions", completions(max_completion_tokens=1, max_tokens=8000)),
    ("messages", messages(max_completion_tokens=1, max_tokens=8000)),
    ("chat", chat(max_output_tokens=1)),  # chat ignores max_output_tokens
    # 3: no limit at all: charged 1024, may generate 8192 - prompt, times n
    ("chat", chat(n=4)),
    ("responses", responses()),
]


@pytest.mark.parametrize("method, body", ATTACKS)
def test_no_body_is_charged_less_than_the_engine_may_generate_for_it(method, body):
    size = len(json.dumps(body).encode())
    sent = copy.deepcopy(body)
    charged = charge(method, sent, size)
    if charged is not None:  # admitted: the engine runs `sent`, as normalised
        prompt = pricing.estimate_prompt_tokens(size)
        limit, sequences = engine(method, sent, prompt)
        assert charged >= prompt + limit * sequences

"""Prefix-cache isolation between owners (serve_app/router/isolation.py): the router's salt, the
client's salt refused, and the salt followed through vLLM's own code to the block hashes its
prefix cache matches on — the attack being one owner reading another's prompt off
``cached_tokens`` and ``prefill_ms`` (docs/threat-model.md)."""

import asyncio

import pytest
from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.entrypoints.pooling.embed.protocol import EmbeddingCompletionRequest

from serve_app.errors import APIError
from serve_app.router.isolation import cache_salt
from serve_app.router.request_schema import validate_body
from serve_app.surfaces import BY_NAME
from tests.conftest import REPO

MODEL = "qwen-3.6-35b-a3b"
USER = [{"role": "user", "content": "hi"}]
BODY = {
    "chat": {"model": MODEL, "messages": USER},
    "completions": {"model": MODEL, "prompt": "hi"},
    "responses": {"model": MODEL, "input": "hi"},
    "messages": {"model": MODEL, "max_tokens": 8, "messages": USER},
    "count_tokens": {"model": MODEL, "messages": USER},
    "embeddings": {"model": "qwen-3-embedding-0.6b", "input": "hi"},
    "tokenize": {"model": MODEL, "prompt": "hi"},
    "detokenize": {"model": MODEL, "tokens": [1]},
}
# The replica methods that run the model, and vLLM's request model for each: where the router
# sets ``body["cache_salt"]`` (Messages: vLLM copies it onto the chat request it converts to).
# Embeddings too: a pooling model with last-token pooling caches prefixes (vLLM's
# ModelConfig.is_prefix_caching_supported), so an embedding's timing is the same oracle.
GENERATING = {
    "chat": ChatCompletionRequest,
    "completions": CompletionRequest,
    "responses": ResponsesRequest,
    "messages": AnthropicMessagesRequest,
    "embeddings": EmbeddingCompletionRequest,
}


def test_every_strict_body_is_listed_here():
    assert set(BODY) == set(BY_NAME)


@pytest.mark.parametrize("method", sorted(BODY))
@pytest.mark.parametrize("value", ["o1-" + "0" * 64, "", None, 7])
def test_a_client_cannot_choose_its_cache_salt(method, value):
    """Owner B sending A's salt (or any) would share A's cache: a 400 naming the field."""
    validate_body(method, dict(BODY[method]))  # the body is fine without it
    with pytest.raises(APIError) as refused:
        validate_body(method, {**BODY[method], "cache_salt": value})
    assert (refused.value.status, refused.value.param) == (400, "cache_salt")
    assert "set by the server" in refused.value.message


def test_the_salt_is_the_owners_deterministic_and_distinct():
    assert cache_salt("acme") == cache_salt("acme")  # every key, replica and region of one owner
    owners = ["acme", "acme2", "Acme", "", "alice@example.com", "a/b\\c\x00", "\ud800", "x" * 10_000]
    salts = {cache_salt(owner) for owner in owners}
    assert len(salts) == len(owners)


def test_the_replica_gets_its_owners_salt_beside_the_body_and_a_peer_never_does(router_app):
    """The salt travels in the router's call to the replica (``wire.Call.cache_salt``), never in
    the body: the body is also what a failover forwards, and a peer's router refuses the field."""
    from serve_app.engine.vllm_engine import _engine_body

    app = router_app()
    alice, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    alices_other, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    bob, _ = app.auth.keys.create_key(owner="bob", tier="standard")
    for key in (alice, alices_other, bob):
        assert app.client.post("/v1/chat/completions", json=BODY["chat"], headers={"Authorization": f"Bearer {key}"}).status_code == 200
    tokenized = {"model": BODY["chat"]["model"], "prompt": "hi"}
    assert app.client.post("/tokenize", json=tokenized, headers={"Authorization": f"Bearer {bob}"}).status_code == 200
    salts = [call.cache_salt for _, call in app.engine.calls]
    assert salts == [cache_salt("alice"), cache_salt("alice"), cache_salt("bob"), None]  # nothing to salt in a count
    assert all("cache_salt" not in call.body for _, call in app.engine.calls)
    _, first = app.engine.calls[0]
    assert _engine_body(first)["cache_salt"] == cache_salt("alice")  # what vLLM's request model gets


@pytest.mark.parametrize("owner", ["acme", "alice@example.com", "team/ml\\x\x00", "x" * 10_000, "\ud800"])
@pytest.mark.parametrize("method", sorted(GENERATING))
def test_vllms_request_models_take_the_salt_as_the_router_sets_it(method, owner):
    """vLLM refuses a salt over 128 characters or with @ / \\ NUL: ours never has them."""
    body = {**BODY[method], "cache_salt": cache_salt(owner)}
    request = GENERATING[method].model_validate(body)
    assert request.cache_salt == cache_salt(owner)
    if method == "messages":
        chat = AnthropicServingMessages.to_chat_completion_request(request)
        assert chat.cache_salt == cache_salt(owner)


# --- the salt through vLLM's renderer and input processor to the prefix cache's block hashes ----
@pytest.fixture(scope="module")
def vllm_front():
    """vLLM's online renderer and input processor for the tiny model, as the replica builds
    them (no engine core): what turns a request into the engine request the cache hashes."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.renderers.online_renderer import OnlineRenderer
    from vllm.renderers.registry import renderer_from_config
    from vllm.v1.engine.input_processor import InputProcessor

    from serve_app.devtools.tiny_model import ensure_tiny_model

    path = ensure_tiny_model()
    config = EngineArgs(model=str(path), max_model_len=1024, enable_prefix_caching=True).create_engine_config()
    renderer = renderer_from_config(config)
    online = OnlineRenderer(
        config.model_config, renderer, request_logger=None, chat_template=None, chat_template_content_format="auto"
    )
    return config, online, InputProcessor(config, renderer)


PROMPT = "The quarterly numbers of the private acquisition are as follows, in confidence: " * 4


def _block_hashes(vllm_front, method: str, salt: str | None) -> list:
    from vllm.sampling_params import SamplingParams

    config, online, processor = vllm_front
    prompt = PROMPT
    body = {"model": MODEL, **({"cache_salt": salt} if salt else {})}
    if method == "chat":
        _, (engine_input,) = asyncio.run(
            online.render_chat(ChatCompletionRequest(**body, messages=[{"role": "user", "content": prompt}]))
        )
    elif method == "completions":
        (engine_input,) = asyncio.run(online.render_completion(CompletionRequest(**body, prompt=prompt)))
    else:
        engine_input = asyncio.run(online.render_responses(ResponsesRequest(**body, input=prompt))).engine_input
    core = processor.process_inputs("req", engine_input, SamplingParams(max_tokens=1), ("generate",))
    return _block_hashes_of(config, core, salt)


def _block_hashes_of(config, core, salt: str | None) -> list:
    """The prefix cache's block hashes of engine request ``core``, which carries ``salt``."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    assert core.cache_salt == salt
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    # The engine picks its hash granularity from the KV cache layout (no engine here); any size
    # shows the chain: the salt is hashed into the first block, every later one chains from it.
    request = Request.from_engine_core_request(core, get_request_block_hasher(16, hash_fn))
    assert len(request.block_hashes) >= 2, "the prompt must fill blocks for the check to mean anything"
    return request.block_hashes


@pytest.mark.parametrize("method", ["chat", "completions", "responses"])
def test_one_owners_prompt_never_hits_another_owners_cache(vllm_front, method):
    mine = _block_hashes(vllm_front, method, cache_salt("owner-a"))
    assert _block_hashes(vllm_front, method, cache_salt("owner-a")) == mine  # one owner's keys share
    theirs = _block_hashes(vllm_front, method, cache_salt("owner-b"))
    assert not set(mine) & set(theirs)  # not one block in common, so no cached_tokens to read
    unsalted = _block_hashes(vllm_front, method, None)
    assert not set(unsalted) & set(mine)  # what every tenant shared before the salt


def test_regions_cache_prefixes_so_the_salt_matters_there():
    """vLLM caches prefixes unless told not to; only the CPU default turns it off, and the
    benchmark's copy of its chat model (the agent workload's local config keeps it on, as regions do)."""
    for config in sorted((REPO / "configs").glob("*.yaml")):
        text = config.read_text()
        cpu_default = config.name in ("local.yaml", "local-bench.yaml")
        assert ("enable-prefix-caching: false" in text) == cpu_default, config.name


def test_the_published_schema_says_no_client_value_is_valid():
    """Contract fuzzers read /openapi.json: they must expect the 400, not a 200."""
    from serve_app.router import ingress
    from serve_app.router.openapi import build

    schemas = build(ingress.app)["components"]["schemas"]
    for name in ("ChatCompletionBody", "CompletionBody", "ResponsesBody", "MessagesBody"):
        published = schemas[name]["properties"]["cache_salt"]
        assert published["not"] == {} and "default" not in published
        assert "cache_salt" not in schemas[name].get("required", [])


# --- and the same through vLLM's pooling path, for embeddings -------------------------------------
@pytest.fixture(scope="module")
def pooling_front(tmp_path_factory):
    """vLLM's embedding input processor for the tiny embedding checkpoint, as its pooling serving
    object builds it (no engine core): the embedding request → the engine request the cache hashes."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.pooling.embed.io_processor import EmbedIOProcessor
    from vllm.renderers.chat_utils import ChatTemplateConfig
    from vllm.renderers.registry import renderer_from_config
    from vllm.v1.engine.input_processor import InputProcessor

    from serve_app import catalog
    from serve_app.devtools.tiny_embedding_model import ensure_tiny_embedding_model

    path = ensure_tiny_embedding_model(tmp_path_factory.mktemp("tiny-embed") / "model")
    engine = catalog.get("qwen-3-embedding-0.6b").engine
    config = EngineArgs(
        model=str(path), runner=engine.runner, hf_overrides=engine.hf_overrides, max_model_len=1024
    ).create_engine_config()
    assert config.cache_config.enable_prefix_caching  # last-token pooling: vLLM caches prefixes
    renderer = renderer_from_config(config)
    io = EmbedIOProcessor(vllm_config=config, renderer=renderer,
                          chat_template_config=ChatTemplateConfig(chat_template=None, chat_template_content_format="auto"))
    return config, io, InputProcessor(config, renderer)


def _embedding_block_hashes(pooling_front, salt: str | None) -> list:
    from vllm.entrypoints.pooling.typing import PoolingServeContext

    config, io, processor = pooling_front
    request = EmbeddingCompletionRequest(model="m", input=PROMPT, **({"cache_salt": salt} if salt else {}))
    params = io.create_pooling_params(request)
    params.verify(config.model_config)
    # vLLM's ServingEmbedding._init_ctx: the request's cache_salt becomes a prompt extra.
    extras = {"cache_salt": request.cache_salt} if request.cache_salt is not None else {}
    ctx = PoolingServeContext(request=request, model_name="m", request_id="r", pooling_params=params,
                              lora_request=None, priorities=0, prompt_extras=extras)
    (render_params,) = io.get_request_factory_online(ctx)
    engine_input = io.render(render_params)
    core = processor.process_inputs("req", engine_input["prompts"], engine_input["params"], ("embed",))
    return _block_hashes_of(config, core, salt)


def test_one_owners_embedding_input_never_hits_another_owners_cache(pooling_front):
    mine = _embedding_block_hashes(pooling_front, cache_salt("owner-a"))
    assert _embedding_block_hashes(pooling_front, cache_salt("owner-a")) == mine
    assert not set(mine) & set(_embedding_block_hashes(pooling_front, cache_salt("owner-b")))
    assert not set(mine) & set(_embedding_block_hashes(pooling_front, None))

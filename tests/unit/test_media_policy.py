"""The media policy (serve_app/config/media.py MediaPolicy, serve_app/router/media.py): media parts
refused at the router unless a region allows their hosts, and the engine started so that it
fetches from those hosts only. The attack: a URL part (``image_url``, ``input_image``, an
Anthropic ``image`` source) naming a cluster-internal address, fetched by a multimodal
checkpoint from inside the cluster (docs/threat-model.md, "SSRF through media URLs")."""

import pytest
import yaml
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.renderers.chat_utils import has_non_text_content
from vllm.utils.argparse_utils import FlexibleArgumentParser

from serve_app.app import MODEL_PROCESS_ENV, model_actor_options
from serve_app.regions.layout import region_args
from serve_app.config import MEDIA_OFF_HOST, MediaPolicy, ModelDeploymentArgs, parse_app_args
from serve_app.regions import schema as regions
from serve_app.regions import serve_config
from serve_app.router.media import MEDIA_NOT_ALLOWED, is_text_part, media_problem
from serve_app.router.request_schema import validate_body
from tests.conftest import REPO

MODEL = "qwen-3.6-35b-a3b"
OFF = MediaPolicy()
CDN = MediaPolicy(allowed_domains=("cdn.example.com", "img.example.org"))
INTERNAL = "http://10.0.0.5:6379/latest/meta-data"
PIXEL = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="


def parse_flags(model: ModelDeploymentArgs):
    return make_arg_parser(FlexibleArgumentParser()).parse_args(model.engine_cli_args("/weights"))


# --- the policy in the app's args and the engine's flags ---------------------------------------
@pytest.mark.parametrize("raw", ["off", False, {}, {"allowed_domains": []}])
def test_media_is_off_by_default_and_when_said_so(raw):
    assert ModelDeploymentArgs(id=MODEL).media == OFF
    assert not ModelDeploymentArgs(id=MODEL, media=raw).media.enabled


@pytest.mark.parametrize(
    "raw, fragment",
    [
        ("on", "name the hosts"),
        ({"allowed_domains": ["10.0.0.5"]}, "not an IP address"),
        ({"allowed_domains": ["[::1]"]}, "not an IP address"),
        ({"allowed_domains": ["https://cdn.example.com"]}, "no scheme, port or path"),
        ({"allowed_domains": ["cdn.example.com:443"]}, "no scheme, port or path"),
        ({"allowed_domains": ["CDN.example.com"]}, "lower-case"),
        ({"allowed_domains": ["*.example.com"]}, "lower-case host name"),
        ({"allowed_domains": ["localhost"]}, "lower-case host name"),
        ({"allowed_domains": ["redis.default.svc"]}, "cluster- or host-internal"),
        ({"allowed_domains": ["metadata.google.internal"]}, "cluster- or host-internal"),
        ({"allowed_domains": ["x.cluster.local"]}, "cluster- or host-internal"),
        ({"allowed_domains": ["a.example.com", "a.example.com"]}, "listed twice"),
        ({"allowed": ["a.example.com"]}, "allowed"),
    ],
)
def test_an_allow_list_names_public_hosts_only(raw, fragment):
    with pytest.raises(ValueError) as err:
        parse_app_args({"models": [{"id": MODEL, "media": raw}]})
    assert "models.0.media" in str(err.value) and fragment in str(err.value)


def test_with_media_off_the_engine_may_fetch_from_no_host_and_no_local_file():
    flags = parse_flags(ModelDeploymentArgs(id=MODEL))
    assert flags.allowed_media_domains == [MEDIA_OFF_HOST]  # vLLM: an empty list allows every host
    assert flags.allowed_local_media_path == ""


def test_an_allow_list_is_the_engines_allowed_media_domains():
    flags = parse_flags(ModelDeploymentArgs(id=MODEL, media={"allowed_domains": list(CDN.allowed_domains)}))
    assert flags.allowed_media_domains == ["cdn.example.com", "img.example.org"]
    assert flags.allowed_local_media_path == ""


@pytest.mark.parametrize("flag", ["allowed-media-domains", "allowed_local_media_path"])
def test_extra_args_cannot_widen_what_the_engine_fetches(flag):
    with pytest.raises(ValueError) as err:
        parse_app_args({"models": [{"id": MODEL, "engine": {"extra_args": {flag: "/"}}}]})
    assert "the media policy sets it" in str(err.value)


def test_the_engine_follows_no_redirect_whatever_the_config_says(monkeypatch):
    """An allowed host that answers 302 to an internal address must not be followed."""
    import vllm.envs

    model = ModelDeploymentArgs(id=MODEL, resources={"env": {"VLLM_MEDIA_URL_ALLOW_REDIRECTS": "1", "A": "b"}})
    env = model_actor_options(model)["runtime_env"]["env_vars"]
    assert env == {**MODEL_PROCESS_ENV, "A": "b", "VLLM_MEDIA_URL_ALLOW_REDIRECTS": "0"}
    assert "VLLM_MEDIA_URL_ALLOW_REDIRECTS" in vllm.envs.environment_variables  # still vLLM's switch
    monkeypatch.setenv("VLLM_MEDIA_URL_ALLOW_REDIRECTS", env["VLLM_MEDIA_URL_ALLOW_REDIRECTS"])
    assert vllm.envs.environment_variables["VLLM_MEDIA_URL_ALLOW_REDIRECTS"]() is False


class RecordingConnection:
    """Stands in for vLLM's HTTP connection: records what the engine would fetch."""

    def __init__(self):
        self.fetched = []

    def get_bytes(self, url, *, timeout=None, allow_redirects=True, max_bytes=None):
        import base64

        self.fetched.append(url)
        return base64.b64decode(PIXEL.split(",", 1)[1])


@pytest.mark.parametrize("url", [INTERNAL, "https://cdn.example.com@10.0.0.5/x.png", "http://[::1]/x.png", "file:///etc/passwd"])
@pytest.mark.parametrize("policy", [OFF, CDN])
def test_vllms_connector_under_our_flags_fetches_nothing_outside_the_list(url, policy):
    """The backstop behind the router: vLLM's own MediaConnector with the flags we start it with."""
    from vllm.multimodal.media import MediaConnector
    from vllm.multimodal.media.image import ImageMediaIO

    connection = RecordingConnection()
    connector = MediaConnector(connection=connection, allowed_media_domains=policy.engine_domains())
    with pytest.raises((ValueError, RuntimeError)):
        connector.load_from_url(url, ImageMediaIO())
    assert connection.fetched == []
    if policy.enabled:
        connector.load_from_url("https://cdn.example.com/pixel.png", ImageMediaIO())
        assert connection.fetched == ["https://cdn.example.com/pixel.png"]


# --- the region file --------------------------------------------------------------------------
def _region(media) -> dict:
    data = yaml.safe_load((REPO / "regions" / "yul-02.yaml").read_text())
    if media is not None:
        data["media"] = media
    return data


def test_regions_keep_media_off_unless_their_file_says_otherwise():
    for region in regions.load_regions(REPO / "regions").values():
        assert not region.media.enabled, region.id  # none allows media today
    for config in sorted((REPO / "configs").glob("*.yaml")):
        args = parse_app_args(region_args(yaml.safe_load(config.read_text())))
        for model in args.models:
            assert parse_flags(model).allowed_media_domains == [MEDIA_OFF_HOST], config.name


def test_a_regions_allow_list_reaches_the_router_and_the_engine_flag():
    region = regions.parse_region(_region({"allowed_domains": ["cdn.example.com"]}))
    rendered = serve_config.app_args(region)
    assert all(m["media"] == {"allowed_domains": ["cdn.example.com"]} for m in rendered["models"])
    args = parse_app_args(rendered)
    for model in args.models:
        assert model.media.allowed_domains == ("cdn.example.com",)
        flags = model.engine_cli_args("/weights")
        assert flags[flags.index("--allowed-media-domains") + 1] == "cdn.example.com"
    # `media: off` in YAML (a boolean to YAML 1.1) renders as nothing: off is the default.
    off = regions.parse_region(yaml.safe_load(yaml.safe_dump(_region(None)) + "media: off\n"))
    assert all("media" not in m for m in serve_config.app_args(off)["models"])


def test_a_bad_allow_list_in_a_region_file_names_the_field():
    with pytest.raises(regions.RegionError) as err:
        regions.parse_region(_region({"allowed_domains": ["169.254.169.254"]}), "regions/yul-02.yaml")
    assert "regions/yul-02.yaml: media.allowed_domains: '169.254.169.254': name a host, not an IP address" in str(err.value)


# --- what counts as text: vLLM's rule ---------------------------------------------------------
PARTS = [
    {"type": "text", "text": "hi"},
    {"type": "input_text", "text": "hi"},
    {"type": "output_text", "text": "hi"},
    {"type": "refusal", "refusal": "no"},
    {"type": "thinking", "thinking": "hm"},
    {"type": "tool_reference", "name": "t"},
    {"text": "no type is text"},
    {"type": "image_url", "image_url": {"url": INTERNAL}},
    {"type": "input_image", "image_url": INTERNAL},
    {"type": "audio_url", "audio_url": {"url": INTERNAL}},
    {"type": "video_url", "video_url": {"url": INTERNAL}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "image_embeds", "image_embeds": "AAAA"},
    {"type": "file", "file": {"file_id": "f"}},
    {"type": "input_file", "file_url": INTERNAL},
    {"type": "text", "text": "x", "uuid": "u", "image_url": INTERNAL},  # vLLM reads the key
    {"image_url": INTERNAL},
    {"type": 5},
    "a plain string",
]


@pytest.mark.parametrize("part", PARTS, ids=repr)
def test_text_is_what_vllm_renders_as_text(part):
    assert is_text_part(part) == (not has_non_text_content([{"role": "user", "content": [part]}]))


# --- the router's check, per surface ----------------------------------------------------------
def chat(*parts) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "look"}, *parts]}]}


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def refused(method, body, policy, param):
    validate_body(method, body)  # the strict schema lets it through: this check is what refuses
    problem = media_problem(method, body, policy)
    assert problem is not None, "accepted"
    assert (problem.status, problem.code, problem.param) == (400, MEDIA_NOT_ALLOWED, param)
    assert problem.message.startswith(param)
    return problem


def test_an_image_url_part_is_refused_with_media_off():
    problem = refused("chat", chat(image(INTERNAL)), OFF, "messages[0].content[1]")
    assert "'image_url'" in problem.message and "media input is off" in problem.message


# The strict schema already refuses a chat part without a string type.
@pytest.mark.parametrize("part", [p for p in PARTS if not is_text_part(p) and isinstance(p, dict) and "type" in p
                                  and isinstance(p["type"], str)], ids=repr)
def test_with_media_off_every_part_that_is_not_text_is_refused(part):
    refused("chat", chat(part), OFF, "messages[0].content[1]")


def test_text_passes_whatever_the_policy():
    body = chat({"type": "text", "text": "more"})
    body["messages"].append({"role": "assistant", "content": "plain"})
    assert media_problem("chat", body, OFF) is None
    assert media_problem("completions", {"model": MODEL, "prompt": INTERNAL}, OFF) is None


def test_an_allow_list_takes_its_hosts_and_inline_media():
    for part in (
        image("https://cdn.example.com/cat.png"),
        image("http://img.example.org/cat.png"),
        image("HTTPS://CDN.EXAMPLE.COM/cat.png"),  # hosts compare as vLLM normalises them
        image(PIXEL),
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "video_url", "video_url": {"url": "https://cdn.example.com/v.mp4"}},
    ):
        assert media_problem("chat", chat(part), CDN) is None, part


@pytest.mark.parametrize(
    "url, says",
    [
        (INTERNAL, "not '10.0.0.5'"),
        ("https://evil.example.net/cat.png", "not 'evil.example.net'"),
        ("https://cdn.example.com.evil.example.net/x.png", "not 'cdn.example.com.evil.example.net'"),
        ("https://sub.cdn.example.com/x.png", "not 'sub.cdn.example.com'"),
        ("https://cdn.example.com@10.0.0.5/x.png", "user name or password"),
        ("https://10.0.0.5\\@cdn.example.com/x.png", "not '10.0.0.5'"),
        ("file:///etc/passwd", "must be https://"),
        ("gopher://cdn.example.com/x", "must be https://"),
        ("//cdn.example.com/x.png", "must be https://"),
        ("http://[::1/x.png", "cannot be parsed"),
    ],
)
def test_an_allow_list_refuses_every_other_host_and_scheme(url, says):
    problem = refused("chat", chat(image(url)), CDN, "messages[0].content[1].image_url")
    assert says in problem.message


def test_a_media_key_on_a_text_typed_part_is_checked_too():
    """vLLM reads image_url off a part with a uuid whatever its type says."""
    part = {"type": "text", "text": "x", "uuid": "u", "image_url": INTERNAL}
    refused("chat", chat(part), OFF, "messages[0].content[1]")
    refused("chat", chat(part), CDN, "messages[0].content[1].image_url")


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "https://cdn.example.com/a.png"}, "uuid": "invoice-1"},
    {"type": "image_url", "image_url": None, "uuid": "invoice-1"},  # no data: the cache's copy, if any
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}, "uuid": "call-7"},
])
def test_a_media_part_that_names_its_cache_id_is_refused(part):
    """vLLM keys its processor and encoder caches by a part's uuid, across owners and with no
    cache salt: another owner's image would answer for it, or this one would answer for theirs."""
    problem = refused("chat", chat(part), CDN, "messages[0].content[1].uuid")
    assert "uuid is not supported" in problem.message


def test_tokenize_renders_media_too_and_is_checked_alike():
    body = {"model": MODEL, "messages": chat(image(INTERNAL))["messages"]}
    refused("tokenize", body, OFF, "messages[0].content[1]")
    assert media_problem("detokenize", {"model": MODEL, "tokens": [1]}, OFF) is None


def test_responses_input_images_and_tool_output_images():
    message = {"role": "user", "content": [{"type": "input_text", "text": "x"}, {"type": "input_image", "image_url": INTERNAL}]}
    body = {"model": MODEL, "input": [message]}
    refused("responses", body, OFF, "input[0].content[1]")
    refused("responses", body, CDN, "input[0].content[1].image_url")
    message["content"][1]["image_url"] = "https://cdn.example.com/x.png"
    assert media_problem("responses", body, CDN) is None
    output = {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image", "image_url": INTERNAL}]}
    refused("responses", {"model": MODEL, "input": [output]}, CDN, "input[0].output[0].image_url")
    reasoning = {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hm"}], "summary": []}
    assert media_problem("responses", {"model": MODEL, "input": [reasoning, "x"]}, OFF) is None
    assert media_problem("responses", {"model": MODEL, "input": INTERNAL}, OFF) is None


def anthropic(*blocks) -> dict:
    return {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, *blocks]}]}


def test_anthropic_images_and_documents():
    url_image = {"type": "image", "source": {"type": "url", "url": INTERNAL}}
    inline = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PIXEL.split(",")[1]}}
    document = {"type": "document", "source": {"type": "url", "url": "https://cdn.example.com/a.pdf"}}
    for method in ("messages", "count_tokens"):
        body = anthropic(url_image)
        if method == "count_tokens":
            body.pop("max_tokens")
        refused(method, body, OFF, "messages[0].content[1]")
        refused(method, body, CDN, "messages[0].content[1].source.url")
    refused("messages", anthropic(inline), OFF, "messages[0].content[1]")
    assert media_problem("messages", anthropic(inline), CDN) is None
    allowed = {"type": "image", "source": {"type": "url", "url": "https://img.example.org/a.png"}}
    assert media_problem("messages", anthropic(allowed), CDN) is None
    # vLLM drops documents unread: refused either way, rather than answered as if read.
    assert "not supported" in refused("messages", anthropic(document), CDN, "messages[0].content[1]").message
    refused("messages", anthropic(document), OFF, "messages[0].content[1]")
    result = {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "ok"}, url_image]}
    refused("messages", anthropic(result), CDN, "messages[0].content[1].content[1].source.url")
    thinking = {"type": "tool_use", "id": "t", "name": "f", "input": {}}
    assert media_problem("messages", anthropic(thinking, {"type": "tool_result", "tool_use_id": "t", "content": "ok"}), OFF) is None


def test_the_check_reads_what_vllm_converts_an_anthropic_image_to():
    """The URL the router checks is the one vLLM's converter hands the chat renderer."""
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    body = anthropic({"type": "image", "source": {"type": "url", "url": INTERNAL}})
    chat_request = AnthropicServingMessages.to_chat_completion_request(AnthropicMessagesRequest.model_validate(body))
    converted = {"model": MODEL, "messages": list(chat_request.messages)}
    refused("chat", converted, CDN, "messages[0].content[1].image_url")


def test_the_router_refuses_a_media_part_before_any_replica_on_every_surface(router_app):
    """Through the real pipeline (its validate stage), in each surface's own error shape: a part
    the region's policy (off by default) does not take never reaches the engine that would fetch it."""
    from auth_support import bearer

    app = router_app()
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    anthropic_image = {"type": "image", "source": {"type": "url", "url": INTERNAL}}
    attempts = [
        ("/v1/chat/completions", {**chat(image(INTERNAL)), "max_tokens": 4}, bearer(key)),
        ("/v1/responses", {"model": MODEL, "max_output_tokens": 4, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": INTERNAL}]}]}, bearer(key)),
        ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [anthropic_image]}]},
         {"x-api-key": key}),
    ]
    for path, body, headers in attempts:
        answer = app.client.post(path, json=body, headers=headers)
        assert answer.status_code == 400, (path, answer.text)
        error = answer.json()["error"]
        assert error.get("code", error.get("type")) in (MEDIA_NOT_ALLOWED, "invalid_request_error"), (path, error)
        assert "media input is off" in error["message"]
    assert not app.engine.calls

"""Property tests of the request parser and validators: whatever bytes a client sends to any route,
the answer is an APIError with a 4xx status, never another exception (a 500), and what passes is a
body every later stage can encode. The token endpoint's body parse is fuzzed through the real route."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from serve_app import surfaces
from serve_app.engine import anthropic_shape
from serve_app.errors import APIError
from serve_app.faults import fuzz
from serve_app.router.pricing import price
from serve_app.router.request_schema import MAX_JSON_DEPTH, parse_json_object, validate_body
from serve_app.router.strict import INT64
from router_app import build_router_app, close_router_app
from tests.unit.auth_support import DEV_KEY, MODEL, OTHER_MODEL
from tests.unit.hostile_json import (
    EMBEDDING_MODEL,
    JSON_VALUES,
    SURFACES,
    VALID_BODIES,
    encode,
    fuzz_settings,
    hostile_bodies,
    offender_in_body,
    valid_bodies,
)



def assert_client_error(err: APIError) -> None:
    assert 400 <= err.status < 500, (err.status, err.message)
    # The refusal itself must be sendable in either shape (a lone surrogate quoted back would not be).
    json.dumps(err.body(), ensure_ascii=False).encode("utf-8")
    json.dumps(anthropic_shape.error_body(err.status, err.message), ensure_ascii=False).encode("utf-8")


def assert_forwardable(body: dict) -> None:
    """What passes can be re-encoded for a peer region, stored, and handed to the engine."""
    json.dumps(body, allow_nan=False, ensure_ascii=False).encode("utf-8")
    pending, depth = [(body, 0)], 0
    while pending:
        value, level = pending.pop()
        depth = max(depth, level)
        if isinstance(value, dict):
            pending += [(child, level + 1) for child in value.values()]
        elif isinstance(value, list):
            pending += [(child, level + 1) for child in value]
        elif type(value) is int:
            assert -INT64 - 1 <= value <= INT64
    assert depth <= MAX_JSON_DEPTH + 1


def parse_and_validate(surface: str, raw: bytes) -> None:
    try:
        body = parse_json_object(raw)
    except APIError as err:
        assert_client_error(err)
        return
    assert_forwardable(body)
    try:
        validate_body(surface, body)
    except APIError as err:
        assert_client_error(err)


@pytest.mark.parametrize("surface", SURFACES)
def test_the_valid_bodies_the_fuzz_starts_from_are_valid(surface):
    for body in VALID_BODIES[surface]:
        validate_body(surface, parse_json_object(encode(body)))


@pytest.mark.parametrize("surface", SURFACES)
@fuzz_settings(max_examples=120)
@given(data=st.data())
def test_any_bytes_to_any_surface_are_accepted_or_a_4xx(surface, data):
    parse_and_validate(surface, data.draw(hostile_bodies(surface)))


@pytest.mark.parametrize("surface", SURFACES)
@fuzz_settings(max_examples=60)
@given(data=st.data())
def test_an_offender_anywhere_is_refused_with_its_path(surface, data):
    body, param = data.draw(offender_in_body(surface))
    with pytest.raises(APIError) as refused:
        parse_json_object(encode(body))
    assert (refused.value.status, refused.value.code, refused.value.param) == (400, "invalid_json", param)


@fuzz_settings(max_examples=150)
@given(value=JSON_VALUES)
def test_clean_json_parses_as_json_loads_reads_it(value):
    """No false refusal: whatever json.loads reads without an offender comes back the same."""
    raw = encode(value)
    try:
        expected = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique)
        assert_forwardable(expected)
    except (ValueError, AssertionError, UnicodeEncodeError):
        return  # holds an offender: the other tests cover it
    if isinstance(expected, dict):
        assert parse_json_object(raw) == expected


def _unique(pairs):
    obj = dict(pairs)
    if len(obj) < len(pairs):
        raise ValueError("duplicate")
    return obj


# --- the token endpoint: its body is read before any credential is checked ---------------------
@pytest.fixture(scope="module")
def token_client(tmp_path_factory):
    """The real router (``router_app.py``), one for the module: hypothesis runs many bodies in one test."""
    patch = pytest.MonkeyPatch()
    app = build_router_app(tmp_path_factory.mktemp("token-fuzz"), patch)
    yield app.client
    close_router_app(app)
    patch.undo()


_API_KEYS = st.one_of(
    st.sampled_from([DEV_KEY, "pgk_0123456789ab_" + "A" * 43, "pgk_", "", "\x00", "\ud800", "a\udfff"]),
    st.text(max_size=20),
)
TOKEN_BODIES = st.one_of(
    st.builds(lambda key: {"api_key": key}, _API_KEYS).map(encode),
    st.builds(lambda value: {"api_key": value}, JSON_VALUES).map(encode),
    hostile_bodies("chat"),
)


@fuzz_settings(max_examples=120)
@given(raw=TOKEN_BODIES)
def test_the_token_endpoint_answers_any_body_with_a_token_or_a_4xx(token_client, raw):
    response = token_client.post("/v1/auth/token", content=raw)  # a 500 raises here
    assert response.status_code == 200 or 400 <= response.status_code < 500, response.text
    if response.status_code != 200:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


# --- the fault suite's hostile bodies (serve-app faults sends them to a running service) ---------
_SURFACE_OF_ROUTE = {
    fuzz.ROUTE_CHAT: "chat", fuzz.ROUTE_MESSAGES: "messages", fuzz.ROUTE_RESPONSES: "responses",
    fuzz.ROUTE_DETOKENIZE: "detokenize", fuzz.TOKEN_PATH: None,
}
_PARSER_ATTACKS = [
    name for name in fuzz.HOSTILE
    if any(word in name for word in ("UTF", "BOM", "NaN", "Infinity", "1e400", "digits", "2^63", "2^64", "surrogate",
                                     "twice", "past int64", "JSON", "empty", "10,000 deep"))
]


@pytest.mark.parametrize("name", list(fuzz.HOSTILE))
def test_the_fault_suites_hostile_bodies_are_accepted_or_a_4xx_here_too(name):
    route, raw = fuzz.HOSTILE[name]
    surface = _SURFACE_OF_ROUTE[route]
    if name in _PARSER_ATTACKS:
        with pytest.raises(APIError) as refused:
            parse_json_object(raw)
        assert (refused.value.status, refused.value.code) == (400, "invalid_json")
    elif surface is not None:
        parse_and_validate(surface, raw)


# --- found by this fuzz past the parser: another surface's limit field passes validation untyped
@pytest.mark.parametrize(
    "surface, field",
    [("chat", "max_output_tokens"), ("completions", "max_completion_tokens"), ("responses", "max_tokens"),
     ("messages", "max_output_tokens")],
)
def test_another_surfaces_limit_field_of_a_wrong_type_is_a_4xx(surface, field):
    body = {**VALID_BODIES[surface][0], field: "8"}  # not this surface's field: it passes through validation
    validate_body(surface, body)
    with pytest.raises(APIError) as refused:  # the price stage names it: a 400, not a TypeError's 500
        price(surface, body, 100, context_len=8192, default_max_tokens=4096)
    assert_client_error(refused.value)
    assert refused.value.param == field


# --- the whole pipeline: every surface, hostile bodies, on the real router ------------------------
@pytest.fixture(scope="module")
def dev_router(tmp_path_factory):
    """The real router and pipeline on a fake engine, its dev key valid (``router_app.py``)."""
    patch = pytest.MonkeyPatch()
    models = (MODEL, OTHER_MODEL, EMBEDDING_MODEL)  # every surface finds a model of its task
    app = build_router_app(tmp_path_factory.mktemp("pipeline-fuzz"), patch, models=models)
    yield app
    close_router_app(app)
    patch.undo()


_ROUTES = {surface.name: surface.route for surface in surfaces.SURFACES}


@pytest.mark.parametrize("surface", sorted(set(SURFACES) & set(_ROUTES)))
def test_no_hostile_body_is_a_5xx_anywhere_on_the_pipeline(dev_router, surface):
    """Past the parser too: validation, pricing, media, the replica call and the relay. Whatever
    the body, the answer is a success or a 4xx in the surface's own error shape, never a 500."""
    anthropic = surfaces.BY_NAME[surface].dialect.api_key_header
    headers = {"Authorization": f"Bearer {DEV_KEY}", "content-type": "application/json"}

    @fuzz_settings(max_examples=40)
    @given(raw=st.one_of(hostile_bodies(surface), valid_bodies(surface).map(encode)))
    def answers(raw):
        response = dev_router.client.post(_ROUTES[surface], content=raw, headers=headers)
        assert response.status_code < 500, response.text
        if response.status_code >= 400:
            body = response.json()
            assert set(body["error"]) == ({"type", "message"} if anthropic else {"message", "type", "param", "code"})

    answers()

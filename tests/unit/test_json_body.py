"""The strict body parser, one attack at a time: each was a 500 (or a body the router read
differently from other parsers) and is now a 400 ``invalid_json`` naming the problem and its path,
in the route's own error shape."""

import json

import pytest

from router_app import router_client
from serve_app import surfaces
from serve_app.errors import APIError
from serve_app.router.json_body import MAX_LOCATE_STEPS
from serve_app.router.request_schema import MAX_JSON_DEPTH, parse_json_object  # nesting: test_request_schema
from tests.unit.auth_support import DEV_KEY, authenticator

CHAT = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4'


def body_with(extra: bytes) -> bytes:
    return b'{"model": "m", ' + extra + b"}"


def refusal(raw: bytes) -> APIError:
    with pytest.raises(APIError) as caught:
        parse_json_object(raw)
    assert (caught.value.status, caught.value.code) == (400, "invalid_json")
    json.dumps(caught.value.body(), ensure_ascii=False).encode("utf-8")  # the refusal itself is sendable
    return caught.value


@pytest.mark.parametrize(
    "extra, param, named",
    [
        (b'"max_tokens": ' + b"9" * 5000, "max_tokens", "integer 999999999999…(5000 characters) is out of range"),
        (b'"seed": 9223372036854775808', "seed", "integers must fit in 64 bits"),
        (b'"stop": [1, -9223372036854775809]', "stop[1]", "integer -9223372036854775809"),
        (b'"top_k": ' + b"1" * 30, "top_k", "out of range"),
        (b'"temperature": NaN', "temperature", "NaN is not a JSON number"),
        (b'"temperature": Infinity', "temperature", "Infinity is not a JSON number"),
        (b'"logit_bias": {"1": -Infinity}', "logit_bias.1", "-Infinity is not a JSON number"),
        (b'"temperature": 1e400', "temperature", "number 1e400 is out of range for a double"),
        (b'"top_p": -' + b"1" * 400 + b".0", "top_p", "out of range for a double"),
        (b'"user": "\\ud800"', "user", "lone surrogate \\ud800"),
        (b'"messages": [{"role": "user", "content": "a\\udfffb"}]', "messages[0].content", "lone surrogate \\udfff"),
        (b'"metadata": {"\\udc00": "v"}', "metadata.\\udc00", "the key holds a lone surrogate"),
        (b'"model": "other"', "model", "duplicate key 'model'"),
        (b'"messages": [{"role": "user", "role": "system"}]', "messages[0].role", "duplicate key 'role'"),
    ],
)
def test_each_offender_is_400_invalid_json_naming_it_and_its_path(extra, param, named):
    refused = refusal(body_with(extra))
    assert refused.param == param
    assert named in refused.message and param in refused.message


@pytest.mark.parametrize(
    "raw, named",
    [
        (b"\xef\xbb\xbf" + CHAT + b"}", "byte order mark"),
        ((CHAT + b"}").decode().encode("utf-16"), "UTF-16 or UTF-32"),
        ((CHAT + b"}").decode().encode("utf-16-le"), "UTF-16 or UTF-32"),
        ((CHAT + b"}").decode().encode("utf-32-be"), "UTF-16 or UTF-32"),
        (b'{"model": "\xff"}', "not UTF-8: byte 0xff at offset 11"),
        (b'{"model": "\xed\xa0\x80"}', "not UTF-8"),  # a surrogate encoded raw: json.loads(bytes) took it
        (b'{"model": "h\xe9"}', "not UTF-8"),  # Latin-1
        (b"NaN", "at its top level: NaN"),
        (b"[1]", "must be a JSON object"),
        (b'{"a": NaN, "b": nope}', "not valid JSON"),  # the fast path stops at NaN, the second parse at nope
        (b'{"a": NaN, "b": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", f"deeper than {MAX_JSON_DEPTH}"),
    ],
)
def test_encodings_and_shapes_other_parsers_read_otherwise_are_refused(raw, named):
    refused = refusal(raw)
    assert named in refused.message and refused.param is None


@pytest.mark.parametrize(
    "raw, expected",
    [
        (b'{"s": "\\ud83d\\ude00", "t": "\\\\ud800"}', {"s": "😀", "t": "\\ud800"}),  # a pair; an escaped backslash
        (b'{"id": "12345678901234567890123", "n": 9223372036854775807, "m": -9223372036854775808}',
         {"id": "12345678901234567890123", "n": 2**63 - 1, "m": -(2**63)}),
        (b'{"f": 1e308, "g": 1e-400, "h": -0.0, "e": 1E+2}', {"f": 1e308, "g": 0.0, "h": -0.0, "e": 100.0}),
        (b'{"nul": "a\\u0000b", "brackets": "[[[[{{{{"}', {"nul": "a\x00b", "brackets": "[[[[{{{{"}),
    ],
)
def test_what_only_looks_like_an_offender_passes_unchanged(raw, expected):
    assert parse_json_object(raw) == expected


def test_an_offender_past_the_walks_budget_is_refused_without_a_path():
    raw = b'{"tokens": [' + b"0, " * (MAX_LOCATE_STEPS + 10) + b'NaN]}'
    refused = refusal(raw)
    assert refused.param is None and "NaN is not a JSON number" in refused.message
    raw = b'{"tokens": [' + b"0, " * (MAX_LOCATE_STEPS + 10) + b'99999999999999999999]}'
    assert "integers must fit in 64 bits" in refusal(raw).message


# --- the route's own error shape ---------------------------------------------------------------
@pytest.fixture
def dev_client(tmp_path):
    """The real router (``router_app.py``) and the dev key, which every route takes."""
    return router_client(authenticator(tmp_path))


DEV = {"Authorization": f"Bearer {DEV_KEY}", "content-type": "application/json"}


@pytest.mark.parametrize("surface", [surfaces.MESSAGES, surfaces.COUNT_TOKENS])
def test_a_parse_error_on_anthropic_routes_is_in_anthropics_shape(dev_client, surface):
    response = dev_client.post(surface.route, content=b'{"model": "m", "max_tokens": ' + b"9" * 5000 + b"}", headers=DEV)
    assert response.status_code == 400
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]


@pytest.mark.parametrize("surface", [surfaces.CHAT, surfaces.COMPLETIONS, surfaces.RESPONSES])
def test_a_parse_error_on_openai_routes_is_in_openais_shape(dev_client, surface):
    response = dev_client.post(surface.route, content=b'{"model": "m", "metadata": {"k": "\\ud800"}}', headers=DEV)
    assert response.status_code == 400
    assert response.json()["error"] | {"message": None} == {
        "message": None, "type": "invalid_request_error", "param": "metadata.k", "code": "invalid_json"
    }


# --- the token endpoint reads its body before any credential is checked -------------------------
@pytest.fixture
def token_client(dev_client):
    return dev_client


@pytest.mark.parametrize(
    "raw, param",
    [
        (b'{"api_key": "\\ud800"}', "api_key"),
        (b'{"api_key": "' + DEV_KEY.encode() + b'", "n": ' + b"9" * 4000 + b"}", "n"),  # the body's 4 KiB
        (b'{"api_key": "x", "api_key": "' + DEV_KEY.encode() + b'"}', "api_key"),
    ],
)
def test_the_token_endpoint_refuses_a_hostile_body_with_400(token_client, raw, param):
    response = token_client.post("/v1/auth/token", content=raw)  # a 500 raises in the test client
    assert response.status_code == 400
    assert (response.json()["error"]["code"], response.json()["error"]["param"]) == ("invalid_json", param)


def test_a_nul_in_an_api_key_is_an_unknown_key_not_a_database_error(token_client):
    for key in ("pgk_0123456789ab_" + "A" * 42 + "\x00", "\x00", DEV_KEY + "\x00"):
        response = token_client.post("/v1/auth/token", content=json.dumps({"api_key": key}))
        assert (response.status_code, response.json()["error"]["code"]) == (401, "invalid_api_key")
    assert token_client.post("/v1/auth/token", json={"api_key": DEV_KEY}).status_code == 200


@pytest.mark.parametrize("declared, length", [("12", 12), ("²", None), ("1³", None), ("", None), ("-1", None),
                                              ("9" * 19, 10**19 - 1), ("9" * 5000, 2**63)])
def test_only_an_ascii_content_length_is_read_as_the_bodys_size(declared, length):
    """Headers are latin-1, whose superscripts ``str.isdigit`` takes and ``int`` refuses: the
    router's size checks take ASCII digits only (no proxy passes others today)."""
    from starlette.requests import Request

    from serve_app.router.body import declared_length

    request = Request({"type": "http", "method": "POST", "path": "/",
                       "headers": [(b"content-length", declared.encode("latin-1"))]})
    assert declared_length(request) == length

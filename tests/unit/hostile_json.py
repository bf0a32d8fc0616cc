"""Hypothesis strategies for hostile request bodies, reusable by any fuzz of the router: the parser's
property tests (test_body_fuzz.py) and a fuzz of the whole router pipeline alike.

A body is built as a tree and written by ``encode`` rather than json.dumps, so it can hold what
json.dumps cannot write: ``Raw`` text spliced in verbatim (a 5,000-digit integer, ``NaN``,
``1e400``, brackets 100 deep) and ``Pairs``, an object whose keys repeat. Strings are written by
json.dumps with ``ensure_ascii``, so a lone surrogate arrives as the ``\\ud800`` escape a client
sends. ``hostile_bodies(surface)`` mixes everything: valid bodies with one field made hostile,
arbitrary JSON, byte-level damage (a BOM, UTF-16, truncation, a flipped byte) and random bytes.
"""

import json
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from serve_app.surfaces import SURFACES as SURFACE_ROWS

MODEL = "qwen-3.6-35b-a3b"
EMBEDDING_MODEL = "qwen-3-embedding-0.6b"
_USER = {"role": "user", "content": "hi"}

# Valid bodies, several fields each, so that mutations have fields to hit. Each passes validate_body.
VALID_BODIES: dict[str, list[dict[str, Any]]] = {
    "chat": [
        {"model": MODEL, "messages": [_USER], "max_tokens": 4},
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"},
            ],
            "max_completion_tokens": 8, "temperature": 0.5, "top_p": 0.9, "n": 2, "seed": 7, "stop": ["\n"],
            "logit_bias": {"50256": -100}, "stream": True, "stream_options": {"include_usage": True},
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}},
            "user": "u1", "top_k": 20, "priority": 3, "chat_template_kwargs": {"enable_thinking": False},
        },
    ],
    "completions": [
        {"model": MODEL, "prompt": "hi", "max_tokens": 4},
        {"model": MODEL, "prompt": [[1, 2], [3]], "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 1.0},
    ],
    "responses": [
        {"model": MODEL, "input": "hi"},
        {
            "model": MODEL,
            "input": [
                {"role": "user", "content": "hi"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "1"},
            ],
            "instructions": "be brief", "max_output_tokens": 16, "metadata": {"k": "v"}, "store": False,
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "text": {"format": {"type": "text"}}, "reasoning": {"effort": "low"}, "top_logprobs": 2,
        },
    ],
    "messages": [
        {"model": MODEL, "max_tokens": 4, "messages": [_USER]},
        {
            "model": MODEL, "max_tokens": 2048, "system": [{"type": "text", "text": "be brief"}],
            "messages": [_USER, {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
                         {"role": "user", "content": [{"type": "text", "text": "more"}]}],
            "metadata": {"user_id": "u"}, "stop_sequences": ["x"], "temperature": 0.5, "top_k": 5,
            "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "auto"},
            "thinking": {"type": "enabled", "budget_tokens": 1024},
        },
    ],
    "count_tokens": [{"model": MODEL, "messages": [_USER], "system": "be brief"}],
    "embeddings": [
        {"model": EMBEDDING_MODEL, "input": "hi", "encoding_format": "float"},
        {"model": EMBEDDING_MODEL, "input": [[1, 2], [3]], "encoding_format": "base64", "dimensions": 32,
         "user": "u1", "priority": 3, "truncate_prompt_tokens": 8},
        {"model": EMBEDDING_MODEL, "input": ["a", "b"]},
    ],
    "tokenize": [
        {"model": MODEL, "prompt": "hi", "add_special_tokens": True},
        {"model": MODEL, "messages": [_USER], "add_generation_prompt": True, "return_token_strs": True},
    ],
    "detokenize": [{"model": MODEL, "tokens": [1, 2, 3]}],
}
SURFACES = tuple(VALID_BODIES)


@dataclass(frozen=True)
class Raw:
    """JSON text written as is: what json.dumps will not write, or writes otherwise."""

    text: str


@dataclass(frozen=True)
class Pairs:
    """An object written pair by pair, so a key may repeat."""

    items: tuple[tuple[str, Any], ...]


def encode(value: Any) -> bytes:
    return _text(value).encode("utf-8")


def _text(value: Any) -> str:
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, Pairs):
        return "{" + ", ".join(f"{json.dumps(key)}: {_text(item)}" for key, item in value.items) + "}"
    if isinstance(value, dict):
        return _text(Pairs(tuple(value.items())))
    if isinstance(value, list):
        return "[" + ", ".join(_text(item) for item in value) + "]"
    return json.dumps(value)  # ensure_ascii: a lone surrogate becomes its \\uXXXX escape


# --- values a parser must refuse wherever they stand, with the path where they stand -----------
LONE_SURROGATES = ("\ud800", "\udbff", "\udc00", "\udfff", "a\ud83d", "\ude00b")
OUT_OF_RANGE_NUMBERS = (
    Raw("9" * 5000), Raw("-" + "9" * 4301), Raw(str(2**63)), Raw(str(-(2**63) - 1)), Raw("1" * 30),
    Raw("1e400"), Raw("-1e400"), Raw("1" * 400 + ".5"), Raw("NaN"), Raw("Infinity"), Raw("-Infinity"),
)
OFFENDERS = st.sampled_from(OUT_OF_RANGE_NUMBERS + LONE_SURROGATES)

# Values that are valid JSON but wrong, or extreme, for a typed field.
_EDGE_VALUES = (
    None, True, False, 0, -1, 2**63 - 1, -(2**63), 2**53 + 1, 0.5, -0.0, 1e308, 1e-320, 1e300, "", "10", "true",
    "\x00", "a\x00b", "\u2028", "😀", [], {}, [None], {"": None}, Raw("[" * 100 + "]" * 100), Raw("1E400"),
)
_SURROGATE_CHARS = st.sampled_from("\ud800\udbff\udc00\udfff")
TEXT = st.one_of(st.text(max_size=12), st.lists(st.one_of(st.characters(), _SURROGATE_CHARS), max_size=6).map("".join))
_FIELD_NAMES = sorted({field.alias or name for row in SURFACE_ROWS for name, field in row.body.model_fields.items()})
KEYS = st.one_of(st.sampled_from(_FIELD_NAMES), TEXT)
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), TEXT, st.sampled_from(_EDGE_VALUES), OFFENDERS
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(KEYS, children, max_size=4),
        st.lists(st.tuples(KEYS, children), max_size=4).map(lambda pairs: Pairs(tuple(pairs))),
    ),
    max_leaves=12,
)


def locations(value: Any, path: tuple = ()) -> list[tuple]:
    """Every path into a body (a tuple of keys and indices), the body itself first."""
    found = [path]
    if isinstance(value, dict):
        for key, child in value.items():
            found += locations(child, (*path, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found += locations(child, (*path, index))
    return found


def param_of(path: tuple) -> str | None:
    """The ``param`` a refusal at ``path`` names: ``messages[0].content``."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else part
    return text or None


def replaced(value: Any, path: tuple, new: Any) -> Any:
    """A copy of ``value`` with ``new`` at ``path``."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {key: replaced(child, rest, new) if key == head else child for key, child in value.items()}
    return [replaced(child, rest, new) if index == head else child for index, child in enumerate(value)]


def valid_bodies(surface: str) -> st.SearchStrategy[dict[str, Any]]:
    return st.sampled_from(VALID_BODIES[surface])


@st.composite
def offender_in_body(draw, surface: str) -> tuple[Any, str | None]:
    """A valid body with one offender at a drawn place (a value, or a repeated key of an object),
    and the ``param`` the refusal must name."""
    body = draw(valid_bodies(surface))
    path = draw(st.sampled_from(locations(body)))
    target = body
    for part in path:
        target = target[part]
    if isinstance(target, dict) and target and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(target)))
        twice = Pairs((*target.items(), (key, target[key])))
        return replaced(body, path, twice), param_of((*path, key))
    return replaced(body, path, draw(OFFENDERS)), param_of(path)


@st.composite
def field_made_hostile(draw, surface: str) -> Any:
    """A valid body with one field (of the schema, or already in the body, at any depth) set to an
    edge value, an offender or arbitrary JSON."""
    body = draw(valid_bodies(surface))
    value = draw(st.one_of(st.sampled_from(_EDGE_VALUES), OFFENDERS, JSON_VALUES))
    if draw(st.booleans()):
        return {**body, draw(st.sampled_from(_FIELD_NAMES)): value}
    path = draw(st.sampled_from(locations(body)[1:]))
    return replaced(body, path, value)


@st.composite
def damaged_bytes(draw, surface: str) -> bytes:
    """A valid body's bytes, damaged as transports and clients damage them."""
    raw = encode(draw(valid_bodies(surface)))
    text = raw.decode()
    damage = draw(st.sampled_from(("bom", "utf-16", "utf-16-le", "utf-32", "latin-1 é", "truncate", "flip", "insert")))
    if damage == "bom":
        return b"\xef\xbb\xbf" + raw
    if damage in ("utf-16", "utf-16-le", "utf-32"):
        return text.encode(damage)
    if damage == "latin-1 é":
        return raw.replace(b'"hi"', '"hé"'.encode("latin-1"))
    at = draw(st.integers(0, len(raw)))
    if damage == "truncate":
        return raw[:at]
    byte = draw(st.binary(min_size=1, max_size=1))
    return raw[:at] + byte + raw[at + (damage == "flip"):]


def hostile_bodies(surface: str) -> st.SearchStrategy[bytes]:
    """Bytes for ``surface``'s route: every kind of bad input above, and some good ones."""
    return st.one_of(
        valid_bodies(surface).map(encode),
        field_made_hostile(surface).map(encode),
        offender_in_body(surface).map(lambda case: encode(case[0])),
        damaged_bytes(surface),
        JSON_VALUES.map(encode),
        st.binary(max_size=64),
    )


def fuzz_settings(max_examples: int) -> settings:
    """Repeatable in CI (derandomize, no example database) and quick: bodies up to ~10 KiB."""
    return settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )

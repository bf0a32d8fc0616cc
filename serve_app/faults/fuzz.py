"""Bad input: schemathesis over the published ``/openapi.json``, then a list of hostile bodies.

What must hold: no 5xx, ever, for a client's mistake; every refusal in the route's error shape
(OpenAI's, or Anthropic's on ``/v1/messages*``). The hostile list holds what contract fuzzers
rarely generate: nesting past the parser's recursion limit, NaN and Infinity, numbers past int64
or a double, lone surrogates, duplicate keys, a BOM and UTF-16/32, oversized bodies, wrong types
the engine would coerce, a million-token request; and the same parser attacks on the token
endpoint (read before any credential is checked), Messages, Responses and /detokenize.
"""

import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from serve_app.client.auth import TOKEN_PATH
from serve_app.faults.traffic import ROUTE_CHAT
from serve_app.surfaces import DETOKENIZE, MESSAGES, RESPONSES

MODEL = "qwen-3.6-35b-a3b"
ROUTE_DETOKENIZE, ROUTE_MESSAGES, ROUTE_RESPONSES = DETOKENIZE.route, MESSAGES.route, RESPONSES.route
_MESSAGES = [{"role": "user", "content": "hi"}]
_ANTHROPIC_ROUTES = (ROUTE_MESSAGES,)


def _chat(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": _MESSAGES, "max_tokens": 4, **fields}).encode()


def _spliced(raw_fields: bytes, **fields: Any) -> bytes:
    """A body with JSON text json.dumps will not write (``NaN``, a 5,000-digit integer, a
    repeated key), spliced in after ``fields``."""
    return json.dumps({"model": MODEL, **fields}).encode()[:-1] + b", " + raw_fields + b"}"


_CHAT_HOSTILE: dict[str, bytes] = {
    "nested 10,000 deep": b'{"model": "m", "messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
    "nested 100 deep in a tool schema": _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": json.loads('{"a":' * 100 + "1" + "}" * 100)}}]),
    "not JSON": b"{nope",
    "invalid UTF-8": b'{"model": "\xff\xfe"}',
    "a surrogate encoded in UTF-8": b'{"model": "\xed\xa0\x80"}',
    "a UTF-8 BOM": b"\xef\xbb\xbf" + _chat(),
    "UTF-16": _chat().decode().encode("utf-16"),
    "UTF-32": _chat().decode().encode("utf-32-le"),
    "a JSON array": b"[1, 2, 3]",
    "empty": b"",
    "NaN temperature": _spliced(b'"temperature": NaN', messages=_MESSAGES, max_tokens=4),
    "-Infinity top_p": _spliced(b'"top_p": -Infinity', messages=_MESSAGES, max_tokens=4),
    "temperature 1e400": _spliced(b'"temperature": 1e400', messages=_MESSAGES, max_tokens=4),
    "max_tokens of 5,000 digits": _spliced(b'"max_tokens": ' + b"9" * 5000, messages=_MESSAGES),
    "seed 2^63": _spliced(b'"seed": 9223372036854775808', messages=_MESSAGES, max_tokens=4),
    "max_tokens 1e300": _chat(max_tokens=1e300),
    "a lone surrogate in content": _chat(messages=[{"role": "user", "content": "hi \ud800"}]),
    "a lone surrogate as a key": _chat(logit_bias={"\udc00": 1}),
    "model twice": _spliced(b'"model": "gpt-5"', messages=_MESSAGES, max_tokens=4),
    "role twice": _spliced(b'"messages": [{"role": "user", "role": "system", "content": "hi"}]', max_tokens=4),
    "a NUL in the model name": _chat(model="qwen\x00"),
    "messages null": _chat(messages=None),
    "messages a string": _chat(messages="hi"),
    "role wizard": _chat(messages=[{"role": "wizard", "content": "hi"}]),
    "max_tokens a string": _chat(max_tokens="10"),
    "stream yes": _chat(stream="yes"),
    "logprobs 'true'": _chat(logprobs="true"),
    "presence_penalty 100": _chat(presence_penalty=100),
    "top_k -5": _chat(top_k=-5),
    "n -1": _chat(n=-1),
    "n 1000": _chat(n=1000),
    "max_tokens 2^70": _chat(max_tokens=2**70),
    "max_tokens past the context": _chat(max_tokens=8193),
    "model an object": _chat(model={"$ne": 1}),
    "model unknown": _chat(model="gpt-5"),
    "tool_choice a missing tool": _chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"type": "function", "function": {"name": "g"}}),
    "json_schema not a schema": _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 12}}}),
    "10,000 messages": _chat(messages=_MESSAGES * 10_000),
    "3 MiB body": _chat(messages=[{"role": "user", "content": "x" * (3 * 2**20)}]),
    "prompt over the context": _chat(messages=[{"role": "user", "content": "word " * 20_000}]),
}
# name → (route, body). The token endpoint takes the key from the body (``api_key``) first.
HOSTILE: dict[str, tuple[str, bytes]] = {
    **{name: (ROUTE_CHAT, raw) for name, raw in _CHAT_HOSTILE.items()},
    "token: a lone surrogate as api_key": (TOKEN_PATH, b'{"api_key": "\\ud800"}'),
    "token: an integer of 5,000 digits": (TOKEN_PATH, b'{"api_key": "x", "n": ' + b"9" * 5000 + b"}"),
    "token: api_key twice": (TOKEN_PATH, b'{"api_key": "x", "api_key": "y"}'),
    "token: a NUL in api_key": (TOKEN_PATH, b'{"api_key": "pgk_\\u0000"}'),
    "messages: max_tokens of 5,000 digits": (
        ROUTE_MESSAGES, _spliced(b'"max_tokens": ' + b"9" * 5000, messages=_MESSAGES)
    ),
    "messages: NaN temperature": (ROUTE_MESSAGES, _spliced(b'"temperature": NaN', messages=_MESSAGES, max_tokens=4)),
    "responses: a lone surrogate in metadata": (
        ROUTE_RESPONSES,
        json.dumps({"model": MODEL, "input": "hi", "max_output_tokens": 4, "metadata": {"k": "\ud800"}}).encode(),
    ),
    "responses: max_output_tokens 2^64": (
        ROUTE_RESPONSES, _spliced(b'"max_output_tokens": 18446744073709551616', input="hi")
    ),
    "detokenize: a token id past int64": (ROUTE_DETOKENIZE, _spliced(b'"tokens": [1, 9223372036854775808]')),
}


def hostile_bodies(url: str, key: str, timeout_s: float = 60) -> dict[str, Any]:
    """Each body once, to its route; its status (``hung`` if no answer in ``timeout_s``) and whether
    the refusal is in the route's error shape. Every body here is refused or bounded: none may run
    the engine long."""
    answers: dict[str, str] = {}
    authorized = {"Authorization": f"Bearer {key}"}
    with httpx.Client(headers={"Content-Type": "application/json"}, timeout=timeout_s) as client:
        for name, (route, raw) in HOSTILE.items():
            try:
                # The token endpoint's body carries the key: a header beside it is a 400 of its own.
                headers = {} if route == TOKEN_PATH else authorized
                response = client.post(url + route, content=raw, headers=headers)
            except httpx.TimeoutException:
                answers[name] = "hung"
                continue
            anthropic = route in _ANTHROPIC_ROUTES
            shaped = _error_shaped(response, anthropic=anthropic) if response.status_code >= 400 else True
            answers[name] = f"{response.status_code}" + ("" if shaped else " (not our error shape)")
    return {
        "bodies": len(answers),
        "by_status": dict(Counter(a.split()[0] for a in answers.values())),
        "server_errors": sorted(name for name, a in answers.items() if a.startswith("5")),
        "hung": sorted(name for name, a in answers.items() if a == "hung"),
        "unshaped": sorted(name for name, a in answers.items() if "not our" in a),
        "answers": answers,
    }


def schemathesis_run(url: str, key: str, *, max_examples: int = 20, max_time_s: int = 120, seed: int = 7) -> dict[str, Any]:
    """Schemathesis (positive and negative cases) over every published operation; the status of
    each response counted. Needs the ``faults`` extra."""
    cli = Path(sys.executable).with_name("schemathesis")
    with tempfile.TemporaryDirectory() as scratch:
        log = Path(scratch) / "statuses.ndjson"
        env = {**os.environ, "SCHEMATHESIS_HOOKS": "serve_app.faults.fuzz_hooks", "SERVE_APP_FUZZ_LOG": str(log)}
        run = subprocess.run(
            [
                str(cli), "run", f"{url}/openapi.json",
                "--checks", "not_a_server_error",
                "--header", f"Authorization: Bearer {key}",
                "--max-examples", str(max_examples), "--max-time", str(max_time_s), "--seed", str(seed),
                "--workers", "1", "--request-timeout", "60", "--no-color", "--generation-database", "none",
                # Each key's rate limit answers 429 quickly; the point is what the app does with
                # the bodies, so the run keeps going.
                "--continue-on-failure",
            ],
            env=env, capture_output=True, text=True, timeout=max_time_s + 120, cwd=scratch,
        )
        statuses = [json.loads(line)["status"] for line in log.read_text().splitlines()] if log.exists() else []
    return {
        "cases": len(statuses),
        "by_status": dict(sorted(Counter(str(s) for s in statuses).items())),
        "server_errors": sum(s >= 500 for s in statuses),
        "schemathesis_exit": run.returncode,
        "schemathesis_tail": run.stdout.strip().splitlines()[-8:],
    }


def _error_shaped(response: httpx.Response, *, anthropic: bool) -> bool:
    """OpenAI's ``{"error": {message, type, param, code}}``, or Anthropic's ``{"type": "error",
    "error": {type, message}}`` on its routes."""
    try:
        body = response.json()
        error = body["error"]
    except (ValueError, KeyError, TypeError):
        return False
    if anthropic:
        return body.get("type") == "error" and isinstance(error, dict) and {"type", "message"} <= set(error)
    return isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error)

"""Bad input: schemathesis over the published ``/openapi.json``, then a list of hostile bodies.

What must hold: no 5xx, ever, for a client's mistake; every refusal in our error shape. The
hostile list holds what contract fuzzers rarely generate: nesting past the parser's recursion
limit, NaN, oversized bodies, wrong types the engine would coerce, a million-token request.
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

from serve_app.faults.traffic import ROUTE_CHAT

MODEL = "qwen-3.6-35b-a3b"
_MESSAGES = [{"role": "user", "content": "hi"}]


def _chat(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": _MESSAGES, "max_tokens": 4, **fields}).encode()


HOSTILE: dict[str, bytes] = {
    "nested 10,000 deep": b'{"model": "m", "messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
    "nested 100 deep in a tool schema": _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": json.loads('{"a":' * 100 + "1" + "}" * 100)}}]),
    "not JSON": b"{nope",
    "invalid UTF-8": b'{"model": "\xff\xfe"}',
    "a JSON array": b"[1, 2, 3]",
    "empty": b"",
    "NaN temperature": b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}' % MODEL.encode(),
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


def hostile_bodies(url: str, key: str, timeout_s: float = 60) -> dict[str, Any]:
    """Each body once; its status (``hung`` if no answer in ``timeout_s``) and whether the refusal
    is in our error shape. Every body here is refused or bounded: none may run the engine long."""
    answers: dict[str, str] = {}
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    with httpx.Client(headers=headers, timeout=timeout_s) as client:
        for name, raw in HOSTILE.items():
            try:
                response = client.post(url + ROUTE_CHAT, content=raw)
            except httpx.TimeoutException:
                answers[name] = "hung"
                continue
            shaped = _our_error_shape(response) if response.status_code >= 400 else True
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


def _our_error_shape(response: httpx.Response) -> bool:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error)

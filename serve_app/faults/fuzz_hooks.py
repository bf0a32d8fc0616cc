"""Schemathesis hooks for ``serve-app faults`` (loaded through ``SCHEMATHESIS_HOOKS``).

Valid generated bodies reach the engine, so each is bounded: at most 8 completion tokens and 2
choices, or fuzzing a CPU engine would run for hours. Every response's status is appended to the
file ``SERVE_APP_FUZZ_LOG`` names, so the suite counts them (schemathesis reports failures only).
"""

import json
import os

import schemathesis

MAX_TOKENS = 8
MAX_CHOICES = 2


@schemathesis.hook
def before_call(ctx, case, **kwargs):
    body = case.body
    if isinstance(body, dict):
        for field in ("max_tokens", "max_completion_tokens", "min_tokens"):
            value = body.get(field)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
                body[field] = MAX_TOKENS
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = MAX_TOKENS
        if isinstance(body.get("n"), int) and not isinstance(body["n"], bool) and body["n"] > MAX_CHOICES:
            body["n"] = MAX_CHOICES


@schemathesis.hook
def after_call(ctx, case, response):
    path = os.environ.get("SERVE_APP_FUZZ_LOG")
    if path:
        with open(path, "a") as log:
            log.write(json.dumps({"op": f"{case.method} {case.path}", "status": response.status_code}) + "\n")

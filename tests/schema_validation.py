"""Check a body against a vendor's published response schema (tests/data/schemas/, see its README).

``validate("openai", "Response", body)`` raises an ``AssertionError`` that lists every schema error
(path and message), so one failing test shows everything that is wrong, not just the first thing.
``errors(...)`` returns the same list for tests that assert on it. ``validate_responses(body)``
checks a Responses body or stream event against both OpenAI's spec and Open Responses, knowing the
few places where they disagree (``SPEC_CONFLICTS``, ``OPENAI_ONLY_EVENTS``; data/schemas/README.md).

The vendored files are one JSON Schema 2020-12 resource each, with every component under
``#/components/``; a validator for a component is that document with a root ``$ref`` to it, built
once per component (building one compiles nothing, but the document is large and tests validate
thousands of stream events).

A union (``oneOf``/``anyOf``, e.g. ``ResponseStreamEvent`` with ~60 event types) that fails says
only "is not valid under any of the given schemas". Here such an error is replaced by the errors of
the one branch the body was meant for: the branches that fail on the body's ``type`` discriminator,
or on the body's JSON type (``null`` in ``X | null``), are not it. When no branch or more than one
is left, the union error itself is reported.
"""

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError

SCHEMAS = Path(__file__).resolve().parent / "data" / "schemas"
VENDORS = ("openai", "openresponses", "anthropic")
# Response fields Open Responses requires, null when not known, that OpenAI's spec types as non-null
# (OpenAI's API sends null; its SDK types them Optional): null passes the OpenAI check here only.
SPEC_CONFLICTS = frozenset({"usage", "safety_identifier", "prompt_cache_key", "description"})
# Events the two name differently; OpenAI's names are the ones sent, checked against OpenAI's spec.
OPENAI_ONLY_EVENTS = frozenset({"response.reasoning_text.delta", "response.reasoning_text.done"})
# A defect of the published Open Responses 2026-04-24 document: its JsonSchemaResponseFormat.schema
# admits only null, where the spec's own source schema (schema/components/schemas/
# JsonSchemaResponseFormat.json) says an object or null. An object there is not an error.
_OPEN_RESPONSES_DEFECT = ".text.format.schema: "
_MAX_MESSAGE = 300  # jsonschema quotes the instance in its messages; a whole Response is unreadable


@functools.cache
def _document(vendor: str) -> dict[str, Any]:
    if vendor not in VENDORS:
        raise ValueError(f"unknown vendor {vendor!r}; one of {VENDORS}")
    return json.loads((SCHEMAS / f"{vendor}.json").read_text())


@functools.cache
def _validator(vendor: str, component: str) -> Draft202012Validator:
    document = _document(vendor)
    if component not in document["components"]:
        raise KeyError(f"{vendor}.json has no component {component!r}")
    return Draft202012Validator({**document, "$ref": f"#/components/{component}"})


def _path(error: ValidationError) -> str:
    return "$" + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error.absolute_path)


def _misses(error: ValidationError) -> bool:
    """Whether a branch error says the body is not this branch's kind at all."""
    where = list(error.relative_path)
    if not where:
        return error.validator == "type"
    return where == ["type"] and error.validator in ("const", "enum")


def _leaves(error: ValidationError) -> Iterator[ValidationError]:
    if not error.context:
        yield error
        return
    branches: dict[Any, list[ValidationError]] = {}
    for sub in error.context:
        branches.setdefault(sub.relative_schema_path[0], []).append(sub)
    meant = [subs for subs in branches.values() if not any(_misses(sub) for sub in subs)]
    if len(meant) != 1:
        yield error
        return
    for sub in meant[0]:
        yield from _leaves(sub)


def errors(vendor: str, component: str, body: Any, *, null_allowed: frozenset[str] = frozenset()) -> list[str]:
    """Every schema error of ``body`` as ``"<path>: <message>"``, in document order; a ``null``
    under a key named in ``null_allowed`` is not one."""
    found = []
    for error in _validator(vendor, component).iter_errors(body):
        for leaf in _leaves(error):
            if leaf.instance is None and leaf.absolute_path and leaf.absolute_path[-1] in null_allowed:
                continue
            message = leaf.message if len(leaf.message) <= _MAX_MESSAGE else leaf.message[:_MAX_MESSAGE] + "…"
            found.append(f"{_path(leaf)}: {message}")
    return sorted(set(found), key=found.index)


def validate(vendor: str, component: str, body: Any) -> None:
    """Raise ``AssertionError`` listing every error of ``body`` against ``vendor``'s ``component``."""
    if problems := errors(vendor, component, body):
        listing = "\n  ".join(problems)
        raise AssertionError(f"{vendor} {component}: {len(problems)} schema error(s)\n  {listing}")


def responses_errors(body: Any, *, event: bool = False) -> list[str]:
    """The errors of a Responses body (``event``: a stream event) against OpenAI's spec and Open
    Responses, each prefixed by the spec it breaks."""
    if event:
        found = [f"openai: {e}" for e in errors("openai", "ResponseStreamEvent", body, null_allowed=SPEC_CONFLICTS)]
        if not (isinstance(body, dict) and body.get("type") in OPENAI_ONLY_EVENTS):
            found += [f"openresponses: {e}" for e in errors("openresponses", "ResponseStreamingEvent", body)
                      if _OPEN_RESPONSES_DEFECT not in e]
        return found
    return [f"openai: {e}" for e in errors("openai", "Response", body, null_allowed=SPEC_CONFLICTS)] + [
        f"openresponses: {e}" for e in errors("openresponses", "ResponseResource", body) if _OPEN_RESPONSES_DEFECT not in e
    ]


def validate_responses(body: Any, *, event: bool = False) -> None:
    """Raise ``AssertionError`` listing every error of ``responses_errors``."""
    if problems := responses_errors(body, event=event):
        listing = "\n  ".join(problems)
        raise AssertionError(f"Responses {'event' if event else 'body'}: {len(problems)} schema error(s)\n  {listing}")

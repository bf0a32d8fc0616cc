"""Which conversation a request continues, as the caller says it (no guessing: that is the prefix
index's job, ``index.py``).

``session_key`` is computed once per request by the router's pipeline and travels in
``wire.Call.session``; the model deployment's request router keeps a session on the replica that
served it while that replica is healthy and not saturated (``policy.py``). Precedence, first
present wins:

1. the ``x-session-id`` header: the caller's explicit statement, on every surface;
2. ``prompt_cache_key`` (OpenAI chat and Responses): OpenAI's own field for "route these
   together for the cache";
3. ``previous_response_id`` (Responses): the conversation exactly; each turn continues the last
   turn's id, so the router also pins the id its answer will have (``response_id``);
4. ``metadata.user_id`` (Anthropic Messages);
5. ``user`` (OpenAI chat, completions, Responses): an end user, who may hold several
   conversations, hence last.

The last two name a person, not a conversation, and often not even that (one value for a whole
app): such a pin holds only within the load imbalance a prefix is allowed (``loose``,
``policy.py``), or one tenant's traffic would all go to one replica until it saturated.

A key is opaque, tagged by where it came from (two sources never collide) and, in the request
router, hashed together with the owner's ``cache_salt``: two tenants' equal keys are different
sessions.
"""

import hashlib
from collections.abc import Mapping
from typing import Any

SESSION_HEADER = "x-session-id"
# Longest key kept as given; a longer one is replaced by its digest (the pin table stores hashes
# anyway; this bounds what the wire carries).
MAX_KEY_CHARS = 256
_LOOSE = ("a:", "u:")  # Anthropic's metadata.user_id, OpenAI's user


def session_key(headers: Mapping[str, str], body: Mapping[str, Any], previous_response_id: str | None = None) -> str | None:
    """The request's session, or None. ``previous_response_id``: the Responses id it continues
    (the pipeline's ``recall`` has taken it off the body)."""
    if value := headers.get(SESSION_HEADER):
        return _tagged("h", value)
    if isinstance(value := body.get("prompt_cache_key"), str) and value:
        return _tagged("k", value)
    if previous_response_id:
        return response_session(previous_response_id)
    metadata = body.get("metadata")
    if isinstance(metadata, Mapping) and isinstance(value := metadata.get("user_id"), str) and value:
        return _tagged("a", value)
    if isinstance(value := body.get("user"), str) and value:
        return _tagged("u", value)
    return None


def loose(key: str) -> bool:
    """Whether ``session_key``'s ``key`` names an end user rather than a conversation."""
    return key.startswith(_LOOSE)


def response_id(request_id: str) -> str:
    """The Responses id the engine gives the answer to router request ``request_id``."""
    return f"resp_{request_id}"


def response_session(response_id_: str) -> str:
    """The session of a conversation whose last answer is ``response_id_``."""
    return _tagged("r", response_id_)


def compare_arm(session: str | None) -> str:
    """With ``compare_with_default`` on (a benchmark's deployment), which policy routes this
    session: ``prefix`` (ours) or ``default`` (Serve's power of two choices). Deterministic, so a
    client can pick sessions for either arm; a request with no session is ours."""
    if session is None:
        return "prefix"
    return "default" if hashlib.blake2b(session.encode(), digest_size=1).digest()[0] & 1 else "prefix"


def _tagged(source: str, value: str) -> str:
    if len(value) > MAX_KEY_CHARS:
        value = "#" + hashlib.blake2b(value.encode(), digest_size=16).hexdigest()
    return f"{source}:{value}"

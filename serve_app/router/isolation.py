"""Prefix-cache isolation between owners: the ``cache_salt`` the router puts on every request
that runs the model.

vLLM's prefix cache (on in every region) reuses the KV blocks of an earlier prompt that starts
with the same tokens, whoever sent it. A request served from it says so (``cached_tokens`` in
its usage and in ``GET /v1/usage``) and shows it (a short prefill:
``pg_metadata.inference_ttft_ms``, ``Server-Timing``), so on a replica that tenants share those
numbers are an oracle: one owner could guess another's system prompt or document a block (16
tokens) at a time and read each guess's hit or miss off the answer.
vLLM hashes a request's ``cache_salt`` into its first block, from which every later block's hash
chains, so two requests share cached blocks only when they carry the same salt.

The salt is the owner's: every key of one owner shares its cache (one customer's services reuse
each other's system prompts, as its keys already share its stored responses and budget), no two
owners share one. Clients cannot send ``cache_salt`` (the strict schemas refuse it: 400, param
``cache_salt``), so the router is its only writer, and the salt needs no secret: knowing another
owner's salt gains nothing without a way to send it. A digest stands for the owner id because
vLLM takes at most 128 characters and no ``@``, ``/``, ``\\`` or NUL (an owner id may be an
e-mail address), and the engine's logs need not carry owner ids. Deterministic, so every router
replica and region salts an owner alike (each replica's cache is its own; a salt that changed
would only cost a cold cache).

Where it is set: in the router's call to the replica (``wire.Call.cache_salt``) for the surfaces
that run the model (chat, completions, Responses, Messages; vLLM converts a Messages request to a
chat request and copies the salt onto it), which puts it on the body vLLM's request model gets;
never on the body itself, which is also what a failover forwards: a peer's router refuses the
field like any client's, and salts the request itself.

Nothing here imports vLLM.
"""

import hashlib

# Changing the tag re-salts every owner: all prefix caches start cold, nothing else changes.
_TAG = b"serve_app cache_salt v1\x00"


def cache_salt(owner: str) -> str:
    """The prefix-cache salt of ``owner``: 67 characters, ``o1-`` and a SHA-256 in hex."""
    return "o1-" + hashlib.sha256(_TAG + owner.encode("utf-8", "surrogatepass")).hexdigest()

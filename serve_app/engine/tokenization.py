"""The replica's small rules for ``/tokenize`` and ``/detokenize`` around vLLM's own serving object.

Pure functions, so they are unit-tested without an engine; ``vllm_engine.VLLMEngine`` applies them.
"""

from typing import Any


def never_stream(body: dict[str, Any]) -> None:
    """Tokenization answers one JSON body. vLLM's tokenize models accept unknown fields, so a
    ``stream`` the router let through would otherwise make the replica try to stream it."""
    body.pop("stream", None)
    body.pop("stream_options", None)


def first_unknown_token(tokens: list[int], vocab_size: int) -> int | None:
    """The index of the first id the tokenizer does not have (0 ≤ id < ``vocab_size``), or None."""
    if not tokens or max(tokens) < vocab_size:  # the common case: one C-level pass
        return None
    return next(index for index, token in enumerate(tokens) if token >= vocab_size)


def unknown_token_message(token: int, vocab_size: int) -> str:
    return f"token id {token} is not in the model's vocabulary (ids 0 to {vocab_size - 1})"

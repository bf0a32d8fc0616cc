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


def unknown_prompt_token(prompt: Any, vocab_size: int) -> tuple[str, str] | None:
    """A completions ``prompt`` of token ids (one list, or a list of them) with an id the
    tokenizer does not have: the field's path and the message, or None.

    vLLM refuses such an id as the engine takes the request, naming no field; for a stream of
    several prompts it does so after merging their streams, so the client got a 200 and an error
    event for its own mistake."""
    if not isinstance(prompt, list) or not prompt:
        return None
    prompts = [("prompt", prompt)] if isinstance(prompt[0], int) else [
        (f"prompt[{i}]", ids) for i, ids in enumerate(prompt) if isinstance(ids, list)]
    for field, ids in prompts:
        if (index := first_unknown_token(ids, vocab_size)) is not None:
            return f"{field}[{index}]", unknown_token_message(ids[index], vocab_size)
    return None

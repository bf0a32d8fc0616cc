"""A request's prompt as a chain of block hashes: what the prefix index matches.

The engine caches a prompt's KV in fixed-size token blocks, each keyed by the hash of its tokens
and of every block before it (vLLM's prefix cache), partitioned by the owner's ``cache_salt``.
The router cannot tokenize cheaply, so it does the same on characters: the request's
prompt-bearing fields, in the order the chat template renders them (tools, system /
instructions, then each message or input item), serialized one part at a time and cut into
``block_chars`` blocks, each hash chained on the one before and seeded by the salt. Turn N+1 of
a conversation repeats turn N's parts and appends to them, so its first blocks are turn N's
blocks exactly; a different system prompt, tool schema or owner changes the chain from its first
differing block on.

Cost: per request, one small ``json.dumps`` per part (text content is taken as it is) and one
hash per block; nothing per token.
"""

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_BLOCK_CHARS = 256  # ≈ 64 tokens of English: vLLM's 16-token blocks × 4, to keep the index small
_PART_END = "\x1e"  # between parts: "ab" + "c" must not chain like "a" + "bc"


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    hashes: tuple[int, ...]  # one per whole block, each chained on the ones before
    chars: int  # the serialized prompt's length (its last partial block is not hashed)
    block_chars: int

    def chars_of(self, blocks: int) -> int:
        return blocks * self.block_chars


def prompt_blocks(body: Mapping[str, Any], salt: str | None, block_chars: int = DEFAULT_BLOCK_CHARS) -> PromptBlocks:
    """The block chain of a router-normalised request body (chat, completions, Responses,
    Messages; any other body is its own serialization)."""
    text = "".join(_parts(body))
    previous = hash(salt or "")
    hashes = []
    for start in range(0, len(text) - block_chars + 1, block_chars):
        previous = hash((previous, text[start:start + block_chars]))
        hashes.append(previous)
    return PromptBlocks(tuple(hashes), len(text), block_chars)


def _parts(body: Mapping[str, Any]) -> Iterator[str]:
    for header in ("tools", "system", "instructions"):
        if body.get(header) is not None:
            yield _dumped(body[header])
    found = False
    for field in ("messages", "input"):  # chat and Messages; Responses (a list after the router's recall)
        value = body.get(field)
        if isinstance(value, list):
            found = True
            yield from map(_item, value)
        elif isinstance(value, str):
            found = True
            yield value + _PART_END
    if isinstance(prompt := body.get("prompt"), str):  # completions
        yield prompt
    elif prompt is not None:
        yield _dumped(prompt)
    elif not found:
        yield _dumped(body)


def _item(value: Any) -> str:
    """A message or input item; its text content as it is (most of a prompt: escaping it for JSON
    would double the cost), the rest serialized."""
    if isinstance(value, Mapping) and isinstance(content := value.get("content"), str):
        return _dumped({key: part for key, part in value.items() if key != "content"}) + content + _PART_END
    return _dumped(value)


def _dumped(value: Any) -> str:
    if isinstance(value, str):
        return value + _PART_END
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str) + _PART_END

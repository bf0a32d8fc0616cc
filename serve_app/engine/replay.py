"""A resumed stream's answer so far, replayed through this replica's serving layer before its
engine goes on.

vLLM's serving layer keeps state per stream — the detokenizer, the reasoning parser (inside
``<think>`` or past it), the tool parser (inside which call's arguments), the Anthropic converter
(which content block is open) — and begins every request at the start of an answer. Prefilling the
tokens generated before the seam (``rendered.py``) makes the *engine* go on where the first one
stopped; replaying them first, as outputs of this request, makes the *serving layer* stand where
the first one stood, so what follows is parsed as the uninterrupted stream's would have been: a
tool call's arguments go on in the same call, reasoning stays reasoning. What the replay emits
that the client already has is cut on the way out (``surfaces/seam.py``); the rest is what the
first stream still owed its client.

The replayed outputs go token by token, with vLLM's own incremental detokenizer, and carry the
client's prompt (without the tail) as the prompt; the engine's outputs that follow are given the
same prompt. So the stream's usage is the client's one request: its prompt, and every token of the
answer as completion. The billing count (``token_count.py``) sits under this wrapper and counts
what this engine did: the tail as prompt (a resume's prefill), the new tokens as completion.

The engine request starts before the replay runs: its queue and prefill overlap the replay.
A ``stop`` string whose first characters came before the seam is matched across it
(``seam_stops.py``).
"""

import contextvars
from collections.abc import AsyncIterator, Callable
from typing import Any

from serve_app.engine import token_count
from serve_app.engine.prefetch import Prefetched
from serve_app.engine.seam_stops import SeamStops

_CURRENT: contextvars.ContextVar["Replay | None"] = contextvars.ContextVar("serve_app_replay", default=None)


class Replay:
    """One resumed request's replay: the tokens before the seam, and whether the stream is past it."""

    def __init__(self, tail: tuple[int, ...], cached_tokens: int | None = None):
        self.tail = tail
        self.cached_tokens = cached_tokens  # the first call's, which every output reports (None: the engine's)
        self.started = False
        # True once the engine's second output is asked for: every event of the replay and of the
        # engine's first output (chat's opening, for an empty tail) has gone out by then.
        self.past_seam = False

    def is_past_seam(self) -> bool:
        return self.past_seam


def current() -> Replay | None:
    return _CURRENT.get()


def start(tail: tuple[int, ...], cached_tokens: int | None = None) -> Replay:
    """The replay of the request this task serves (a ``wire.Resume``'s tokens, maybe none, as
    ``whole_characters`` keeps them): the deployment reads its ``tail`` as what the stream's
    answer holds before this engine's tokens."""
    replay = Replay(tuple(tail), cached_tokens)
    _CURRENT.set(replay)
    return replay


# A character of UTF-8 is at most 4 bytes, so at most 4 byte-level tokens: a window of twice that
# decodes the last character whole wherever the window starts.
_WINDOW = 8


def whole_characters(tokenizer: Any, tail: tuple[int, ...]) -> tuple[int, ...]:
    """``tail`` without the tokens of a character it ends in the middle of (an emoji, a rarer CJK
    character: byte-level tokens that decode to U+FFFD until the last one).

    The client has none of that character (vLLM's detokenizer holds a partial one back), and a
    prompt ending in the middle of one breaks vLLM's incremental detokenizer for the continuation:
    tokenizers' ``DecodeStream`` built on such a prompt keeps no prefix, so the step completing
    the character returns the whole decoded prompt with it, and the cut, spent by the replay, would
    pass the system prompt and the conversation to the client. A prompt ending in U+FFFD itself
    (the model wrote the replacement character, or a stray byte) does the same, so every trailing
    token that decodes to it goes: vLLM holds such text back, so the client has none of it either.
    The engine generates the dropped tokens again (``vllm_engine._with_room_for``)."""
    end = len(tail)
    while end > 0 and tokenizer.decode(list(tail[max(0, end - _WINDOW) : end])).endswith("\ufffd"):
        end -= 1
    return tail[:end]


def install(engine: Any, tokenizer: Callable[[], Any]) -> None:
    """Wrap ``engine.generate`` (after ``token_count.install``: the count stays under it)."""
    engine.generate = replaying(engine.generate, tokenizer)


def replaying(generate: Callable[..., AsyncIterator[Any]], tokenizer: Callable[[], Any]):
    def replayed_generate(prompt, sampling_params, request_id, *args, **kwargs):
        outputs = generate(prompt, sampling_params, request_id, *args, **kwargs)
        replay = _CURRENT.get()
        if replay is None or replay.started:  # not resumed, or a second call of the request
            return outputs
        replay.started = True
        ids = list(prompt["prompt_token_ids"])
        original = ids[: len(ids) - len(replay.tail)]
        return _replayed(outputs, replay, original, sampling_params, request_id, tokenizer())

    return replayed_generate


async def _replayed(outputs, replay: Replay, prompt_ids: list[int], params, request_id: str, tokenizer):
    from vllm.outputs import CompletionOutput, RequestOutput

    engine = Prefetched(outputs)  # vLLM submits the request on its first step: under way during the replay
    try:
        detokenizer = _Detokenizer(tokenizer, prompt_ids, params)
        texts = [(token, detokenizer.next(token)) for token in replay.tail]
        stops = SeamStops.of(params, "".join(text for _, text in texts), detokenizer.next)
        # What the replay may send: the tail's text but for what a stop string may begin in.
        left = sum(len(text) for _, text in texts) - (stops.held if stops else 0)
        for token, text in texts:
            text, left = text[: max(0, left)], left - len(text)
            step = CompletionOutput(index=0, text=text, token_ids=[token], cumulative_logprob=None, logprobs=None)
            yield RequestOutput(request_id, None, prompt_ids, None, [step], finished=False,
                                num_cached_tokens=replay.cached_tokens)
        async for output in engine:
            output.prompt_token_ids = prompt_ids
            if replay.cached_tokens is not None:
                output.num_cached_tokens = replay.cached_tokens
            stopped = stops is not None and stops.see(output)
            if stopped and (count := token_count.current()) is not None:
                # Counted beneath this replay as the engine made them: this output's tokens past
                # the stop, and what the engine makes until the abort takes. The bill is the
                # answer's, as its usage is.
                count.cut_at(stops.tokens)
            yield output
            replay.past_seam = True  # the next output is asked for: this one's events are out
            if stopped:  # a stop string across the seam ended the answer: the engine request is aborted
                return
    finally:
        replay.past_seam = True
        await engine.aclose()  # the engine aborts an unfinished request


class _Detokenizer:
    """The text vLLM's incremental detokenizer gives each token of an answer after ``prompt_ids``."""

    def __init__(self, tokenizer, prompt_ids: list[int], params):
        from vllm.tokenizers.detokenizer_utils import convert_prompt_ids_to_tokens

        self.tokenizer, self.ids = tokenizer, list(prompt_ids)
        self.skip = getattr(params, "skip_special_tokens", True)
        self.spaces = getattr(params, "spaces_between_special_tokens", True)
        self.tokens, self.prefix, self.read = convert_prompt_ids_to_tokens(
            tokenizer, self.ids, skip_special_tokens=self.skip)

    def next(self, token: int) -> str:
        from vllm.tokenizers.detokenizer_utils import detokenize_incrementally

        self.ids.append(token)
        new, text, self.prefix, self.read = detokenize_incrementally(
            self.tokenizer, self.ids, self.tokens, self.prefix, self.read, self.skip, self.spaces)
        self.tokens.extend(new)
        return text

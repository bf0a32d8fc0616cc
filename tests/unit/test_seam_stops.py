"""A stop string across a resumed stream's seam (``engine/seam_stops.py``, through
``replay._replayed``): for every seam in an answer, the client gets what the uninterrupted stream
would have sent — the same text, cut where vLLM cuts it, and the same finish.

The oracle is vLLM's own incremental detokenizer (what its output processor runs per request) on
the tiny model's byte-level tokenizer: the uninterrupted stream is one detokenizer over every
token; the continuation's engine is another, primed with the prompt plus the tail, as the
replica's resume renders it."""

import asyncio
from types import SimpleNamespace

import pytest

import fake_vllm

ANSWER = "alpha ENDbeta and STOP gamma, then the END of it"
CASES = [  # (stop, include the stop string in the output, min_tokens)
    (["END"], False, 0),
    (["ND b", "STOP"], False, 0),
    (["a and ST"], False, 0),
    (["END"], True, 0),
    (["TOP g", "beta and"], True, 0),
    (["END"], False, 6),
    (["zzz"], False, 0),
]


@pytest.fixture(scope="module")
def tokenizer():
    fake_vllm.import_vllm()
    from vllm.tokenizers import get_tokenizer

    from serve_app.devtools.tiny_model import ensure_tiny_model

    return get_tokenizer(str(ensure_tiny_model()))


def _params(stop, include, min_tokens):
    from vllm import SamplingParams

    return SamplingParams(stop=stop, include_stop_str_in_output=include, min_tokens=min_tokens, max_tokens=100)


def _detokenizer(tokenizer, prompt_ids, params):
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    request = SimpleNamespace(request_id="r", prompt_token_ids=list(prompt_ids), sampling_params=params)
    return IncrementalDetokenizer.from_new_request(tokenizer, request)


def _engine(tokenizer, prompt_ids, params, tokens):
    """vLLM's stream outputs of ``tokens`` after ``prompt_ids``, one engine step a token:
    (delta text, token, finish reason, stop string), ending where it stops."""
    detokenizer = _detokenizer(tokenizer, prompt_ids, params)
    for i, token in enumerate(tokens):
        stop = detokenizer.update([token], False)
        last = stop is not None or i == len(tokens) - 1
        finish = ("stop" if stop else "length") if last else None
        yield detokenizer.get_next_output_text(last, True) or "", token, finish, stop
        if last:
            return


async def _continuation(steps, per: int = 1):
    """The engine's outputs, ``per`` steps merged into one (as vLLM merges a lagging consumer's)."""
    from vllm.outputs import CompletionOutput, RequestOutput

    for i in range(0, len(steps), per):
        merged = steps[i : i + per]
        text, tokens = "".join(step[0] for step in merged), [step[1] for step in merged]
        finish, stop = merged[-1][2:]
        choice = CompletionOutput(0, text, tokens, None, None, finish_reason=finish, stop_reason=stop)
        yield RequestOutput("r", None, [], None, [choice], finished=finish is not None)


async def _replica(tokenizer, prompt_ids, params, tail, continuation, per=1):
    from serve_app.engine import replay

    texts, finish = [], (None, None)
    async for output in replay._replayed(_continuation(continuation, per), replay.Replay(tuple(tail)), prompt_ids,
                                         params, "r", tokenizer):
        choice = output.outputs[0]
        texts.append(choice.text)
        if output.finished:
            finish = (choice.finish_reason, choice.stop_reason)
    return "".join(texts), finish


def _tail_texts(tokenizer, prompt_ids, tail, params):
    from serve_app.engine import replay

    detokenizer = replay._Detokenizer(tokenizer, prompt_ids, params)
    return [detokenizer.next(token) for token in tail]


@pytest.mark.parametrize("per", [1, 3])
@pytest.mark.parametrize("stop, include, min_tokens", CASES)
def test_every_seam_gives_the_client_what_the_uninterrupted_stream_would(tokenizer, stop, include, min_tokens, per):
    prompt_ids = tokenizer.encode("the prompt:")
    answer = tokenizer.encode(ANSWER, add_special_tokens=False)
    params = _params(stop, include, min_tokens)
    whole = list(_engine(tokenizer, prompt_ids, params, answer))
    expected = ("".join(text for text, *_ in whole), whole[-1][2:])
    spanned = 0
    for seam in range(1, len(whole)):  # the first engine dies after `seam` tokens, before it stopped
        has = "".join(text for text, *_ in whole[:seam])  # what the client received before the seam
        tail, rest = answer[:seam], answer[seam:]
        left = _params(stop, include, max(0, min_tokens - seam))
        continuation = list(_engine(tokenizer, prompt_ids + tail, left, rest))
        # The replica's engine request, and so its replay, has the continuation's parameters.
        sent, finish = asyncio.run(_replica(tokenizer, prompt_ids, left, tail, continuation, per))
        assert sent.startswith(has), seam  # the replay holds back what the first stream did
        assert (has + sent[len(has):], finish) == expected, seam  # the router cuts what the client has
        # Without the watch: the replay's whole text, then the engine's own outputs.
        before = "".join(replay_text for replay_text in _tail_texts(tokenizer, prompt_ids, tail, params))
        unwatched = before + "".join(text for text, *_ in continuation)
        spanned += (has + unwatched[len(has):], continuation[-1][2:]) != expected
    # The cases' stop strings do span seams: without the watch those streams went wrong there.
    assert (spanned > 0) == (stop != ["zzz"])


def test_no_stop_string_leaves_the_replay_and_the_engine_untouched(tokenizer):
    prompt_ids = tokenizer.encode("the prompt:")
    answer = tokenizer.encode(ANSWER, add_special_tokens=False)
    params = _params(None, False, 0)
    tail, rest = answer[:5], answer[5:]
    continuation = list(_engine(tokenizer, prompt_ids + tail, params, rest))
    sent, finish = asyncio.run(_replica(tokenizer, prompt_ids, params, tail, continuation))
    assert sent == tokenizer.decode(answer) and finish == ("length", None)

"""A stop string across a resumed stream's seam (``engine/seam_stops.py``, through
``replay._replayed``): for every seam in an answer, the client gets what the uninterrupted stream
would have sent — the same text, cut where vLLM cuts it, the same finish, the same tokens.

The oracle is vLLM's own incremental detokenizer (what its output processor runs per request) on
the tiny model's byte-level tokenizer: the uninterrupted stream is one detokenizer over every
token; the continuation's engine is another, primed with the prompt plus the tail, as the
replica's resume renders it. What is checked here is the replica's engine-output level; the
router's cut of what the client already has is modelled as a cut of as many characters."""

import asyncio
from types import SimpleNamespace

import pytest

import fake_vllm
from serve_app.engine import replay

ASCII = "alpha ENDbeta and STOP gamma, then the END of it"
WIDE = "Hi\n\nUser: ünïcødé 🤖 said «ÉND» then END."
CASES = [  # (answer, stop, include the stop string, min_tokens, skip special tokens, spans a seam)
    (ASCII, ["END"], False, 0, True, True),
    (ASCII, ["ND b", "STOP"], False, 0, True, True),
    (ASCII, ["a and ST"], False, 0, True, True),
    (ASCII, ["END"], True, 0, True, True),
    (ASCII, ["TOP g", "beta and"], True, 0, True, True),
    (ASCII, ["END"], False, 6, True, True),
    (WIDE, ["\n\nUser:"], False, 0, True, True),  # a stop that may begin in a tail shorter than it
    (WIDE, ["User:", "\nUser:"], False, 0, True, True),  # competing: the one completing first wins
    (WIDE, ["🤖 s", "«É"], False, 0, True, True),  # multi-byte characters, cut mid-character by seams
    (WIDE, ["ND»", "zzz"], True, 2, False, True),
    # The EOS token's text, which vLLM does not decode: no stop string completes with it.
    (WIDE, ["D.<|im_end|>"], False, 0, False, False),
    (ASCII, ["zzz"], False, 0, True, False),  # never matched: nothing to hold for long
]


@pytest.fixture(scope="module")
def tokenizer():
    fake_vllm.import_vllm()
    from vllm.tokenizers import get_tokenizer

    from serve_app.devtools.tiny_model import ensure_tiny_model

    return get_tokenizer(str(ensure_tiny_model()))


def _params(stop, include, min_tokens, skip=True):
    from vllm import SamplingParams

    return SamplingParams(stop=stop, include_stop_str_in_output=include, min_tokens=min_tokens, max_tokens=100,
                          skip_special_tokens=skip)


def _engine(tokenizer, prompt_ids, params, tokens):
    """vLLM's stream outputs of ``tokens`` after ``prompt_ids``, one engine step a token:
    (delta text, token, finish reason, stop string), ending where it stops (a stop string, the
    EOS token the engine core stops on, or the last token)."""
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    request = SimpleNamespace(request_id="r", prompt_token_ids=list(prompt_ids), sampling_params=params)
    detokenizer = IncrementalDetokenizer.from_new_request(tokenizer, request)
    for i, token in enumerate(tokens):
        eos = token == tokenizer.eos_token_id
        stop = detokenizer.update([token], eos)
        last = stop is not None or eos or i == len(tokens) - 1
        finish = ("stop" if stop is not None or eos else "length") if last else None
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
    """What the replica's serving layer gets: the text, the finish and the number of tokens."""
    from serve_app.engine import replay

    texts, finish, tokens = [], (None, None), 0
    async for output in replay._replayed(_continuation(continuation, per), replay.Replay(tuple(tail)), prompt_ids,
                                         params, "r", tokenizer):
        choice = output.outputs[0]
        texts.append(choice.text)
        tokens += len(choice.token_ids)
        if output.finished:
            finish = (choice.finish_reason, choice.stop_reason)
    return "".join(texts), finish, tokens


def _tail_texts(tokenizer, prompt_ids, tail, params):
    from serve_app.engine import replay

    detokenizer = replay._Detokenizer(tokenizer, prompt_ids, params)
    return [detokenizer.next(token) for token in tail]


@pytest.mark.parametrize("per", [1, 3])
@pytest.mark.parametrize("answer, stop, include, min_tokens, skip, spans", CASES)
def test_every_seam_gives_the_client_what_the_uninterrupted_stream_would(
        tokenizer, answer, stop, include, min_tokens, skip, spans, per):
    prompt_ids = tokenizer.encode("the prompt:")
    answer_ids = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    params = _params(stop, include, min_tokens, skip)
    whole = list(_engine(tokenizer, prompt_ids, params, answer_ids))
    expected = ("".join(text for text, *_ in whole), whole[-1][2:], len(whole))
    went_wrong = 0
    for seam in range(1, len(whole)):  # the first engine dies after `seam` tokens, before it stopped
        has = "".join(text for text, *_ in whole[:seam])  # what the client received before the seam
        # As the replica: a tail cut inside a character goes back to before it (its tokens are
        # generated again, min_tokens raised by as many); the continuation's parameters are its
        # engine request's, and so its replay's.
        tail = list(replay.whole_characters(tokenizer, tuple(answer_ids[:seam])))
        rest = answer_ids[len(tail):]
        left = _params(stop, include, max(0, min_tokens - len(tail)), skip)
        continuation = list(_engine(tokenizer, prompt_ids + tail, left, rest))
        sent, finish, tokens = asyncio.run(_replica(tokenizer, prompt_ids, left, tail, continuation, per))
        assert sent.startswith(has), seam  # the replay holds back what the first stream did
        assert (has + sent[len(has):], finish, tokens) == expected, seam
        # Without the watch: the replay's whole text, then the engine's own outputs.
        unwatched = "".join(_tail_texts(tokenizer, prompt_ids, tail, left)) + "".join(t for t, *_ in continuation)
        went_wrong += (has + unwatched[len(has):], continuation[-1][2:], len(tail) + len(continuation)) != expected
    # Where the case's stop strings span seams, the streams went wrong there without the watch.
    assert (went_wrong > 0) == spans


def test_no_stop_string_leaves_the_replay_and_the_engine_untouched(tokenizer):
    prompt_ids = tokenizer.encode("the prompt:")
    answer = tokenizer.encode(ASCII, add_special_tokens=False)
    params = _params(None, False, 0)
    tail, rest = answer[:5], answer[5:]
    continuation = list(_engine(tokenizer, prompt_ids + tail, params, rest))
    sent, finish, tokens = asyncio.run(_replica(tokenizer, prompt_ids, params, tail, continuation))
    assert (sent, finish, tokens) == (tokenizer.decode(answer), ("length", None), len(answer))


@pytest.mark.parametrize("per", [1, 3])
def test_a_stop_across_the_seam_bills_the_tokens_up_to_it_not_what_the_engine_made_past_it(tokenizer, per):
    """The count sits beneath the replay: it saw whole engine outputs (merged steps past the stop)
    and, once the request was aborted, what the engine had made meanwhile. The bill must be the
    tokens up to the stop, as an uninterrupted stream's usage is."""
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.sampling_params import RequestOutputKind

    from serve_app.engine import token_count

    prompt_ids = tokenizer.encode("the prompt:")
    answer_ids = tokenizer.encode(ASCII, add_special_tokens=False)
    seam = next(k for k in range(1, len(answer_ids))  # "END" begins before the seam, completes after it
                if tokenizer.decode(answer_ids[:k]).endswith(("E", "EN")))
    tail, rest = answer_ids[:seam], answer_ids[seam:]
    left = _params(["END"], False, 0)
    left.output_kind = RequestOutputKind.DELTA
    aborted = []

    async def engine(prompt, sampling_params, request_id):
        """Never stops on "END" itself (its detokenizer starts at the seam): it goes on until aborted."""
        for i in range(0, len(rest), per):
            if aborted:
                break
            tokens = rest[i : i + per]
            yield RequestOutput(request_id, None, prompt, None, [CompletionOutput(0, "", tokens, None, None)], False)
            await asyncio.sleep(0)
        yield RequestOutput(request_id, None, prompt, None,  # what it made before the abort took
                            [CompletionOutput(0, "", rest[:2], None, None, finish_reason="abort")], True)

    async def abort(request_id):
        aborted.append(request_id)

    async def scenario():
        count = token_count.start()
        outputs = token_count.counting(engine, abort=abort)(prompt_ids + tail, left, "r")
        seen = 0
        async for output in replay._replayed(outputs, replay.Replay(tuple(tail)), prompt_ids, left, "r", tokenizer):
            seen += len(output.outputs[0].token_ids)
            if output.finished:
                assert output.outputs[0].stop_reason == "END"
                break
        await count.settled(5)
        return seen - len(tail), count.completion_tokens, len(count.token_ids)

    after_seam, billed, ids = asyncio.run(scenario())
    assert after_seam == billed == ids  # the tokens the client's usage counts past the seam, no more

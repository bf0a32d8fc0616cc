"""The replica's own count of what the engine generated (serve_app/engine/token_count.py), on a
stand-in for vLLM's ``AsyncLLM.generate``: the count billing uses when no usage ever arrives."""

import asyncio
from enum import Enum
from types import SimpleNamespace

from serve_app.engine import token_count
from serve_app.wire.messages import Generated


class Kind(Enum):  # vLLM's RequestOutputKind, by name
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _output(tokens_per_choice, *, prompt=5, cached=3):
    choices = [SimpleNamespace(index=i, token_ids=list(range(n))) for i, n in enumerate(tokens_per_choice)]
    return SimpleNamespace(prompt_token_ids=list(range(prompt)), num_cached_tokens=cached, outputs=choices)


class FakeEngine:
    """``generate`` yields the outputs it is given; remembers whether it was closed early."""

    def __init__(self, outputs):
        self.outputs, self.closed = outputs, False

    def generate(self, prompt, sampling_params, request_id, **kwargs):
        async def stream():
            try:
                for output in self.outputs:
                    yield output
                    await asyncio.sleep(0)
            finally:
                self.closed = True

        return stream()


def _run(engine, kind, *, take=None, counted=True):
    token_count.install(engine)

    async def request():
        count = token_count.start() if counted else None
        seen = 0
        stream = engine.generate("p", SimpleNamespace(output_kind=kind), "req-1")
        async for _ in stream:
            seen += 1
            if take is not None and seen == take:
                break
        await stream.aclose()
        return count

    return asyncio.run(request())


def test_deltas_are_summed_per_step_across_choices():
    engine = FakeEngine([_output([1, 2]), _output([1, 1]), _output([3, 0])])
    count = _run(engine, Kind.DELTA)
    assert count.snapshot() == Generated(prompt_tokens=5, completion_tokens=8, cached_tokens=3)


def test_cumulative_and_final_outputs_are_counted_once():
    cumulative = _run(FakeEngine([_output([1]), _output([2]), _output([4])]), Kind.CUMULATIVE)
    assert cumulative.completion_tokens == 4
    final = _run(FakeEngine([_output([6, 2])]), Kind.FINAL_ONLY)
    assert final.completion_tokens == 8 and final.prompt_tokens == 5


def test_a_stream_closed_early_counts_what_was_generated_and_closes_the_engine_stream():
    engine = FakeEngine([_output([1]) for _ in range(10)])
    count = _run(engine, Kind.DELTA, take=3)
    assert count.completion_tokens == 3
    assert engine.closed  # closed now (vLLM aborts the request), not when collected


def test_a_call_outside_a_request_passes_through_uncounted():
    engine = FakeEngine([_output([2])])
    assert _run(engine, Kind.DELTA, counted=False) is None
    assert engine.closed


def test_each_request_has_its_own_count():
    engine = FakeEngine([_output([2])])
    token_count.install(engine)

    async def request():
        count = token_count.start()
        async for _ in engine.generate("p", SimpleNamespace(output_kind=Kind.DELTA), "r"):
            pass
        return count

    async def both():
        return await asyncio.gather(request(), request())

    first, second = asyncio.run(both())
    assert first is not second
    assert first.completion_tokens == second.completion_tokens == 2


def test_embeddings_count_each_finished_inputs_prompt_and_close_vllms_stream_early():
    """vLLM's pooling call (``encode``, arguments by keyword, as its serving layer passes them):
    an input is counted once its output is finished; a request left early closes the stream."""
    closed = []

    def encode(*, prompt, request_id, **_):
        async def outputs():
            try:
                if request_id == "left":  # a chunked prefill's progress, then the end
                    yield SimpleNamespace(prompt_token_ids=prompt, num_cached_tokens=0, finished=False)
                yield SimpleNamespace(prompt_token_ids=prompt, num_cached_tokens=1, finished=True)
            finally:
                closed.append(request_id)

        return outputs()

    engine = SimpleNamespace(generate=lambda *a, **k: None, encode=encode)
    token_count.install(engine)

    async def request():
        count = token_count.start()
        for index in range(3):
            async for _ in engine.encode(prompt=[1] * (index + 2), request_id=f"r-{index}"):
                pass
        stream = engine.encode(prompt=[9] * 100, request_id="left")
        await anext(stream)
        await stream.aclose()  # the client left before this input's forward pass was done
        return count

    count = asyncio.run(request())
    assert count.snapshot() == Generated(prompt_tokens=2 + 3 + 4, completion_tokens=0, cached_tokens=3)
    assert closed == ["r-0", "r-1", "r-2", "left"]

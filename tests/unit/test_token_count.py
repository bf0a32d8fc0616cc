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


class StreamingEngine:
    """As vLLM's ``AsyncLLM`` runs a stream: the engine core generates at its own pace, whoever
    reads; the steps nobody has read yet are merged into one output (``RequestOutputCollector``);
    ``abort`` ends the request and puts its last output after them (finish ``abort``)."""

    def __init__(self):
        self.generated, self.unread, self.aborted = 0, [], []
        self.finished, self.ready = False, asyncio.Event()

    async def run(self, steps):  # the engine core
        for _ in range(steps):
            await asyncio.sleep(0.001)
            if self.finished:
                return
            self.generated += 1
            self.unread.append(self.generated)
            self.ready.set()

    async def abort(self, request_id):
        self.aborted.append(request_id)
        self.finished = True
        self.ready.set()

    def generate(self, prompt, sampling_params, request_id, **kwargs):
        async def stream():
            while True:
                await self.ready.wait()
                self.ready.clear()
                tokens, self.unread, finished = self.unread, [], self.finished
                yield SimpleNamespace(prompt_token_ids=[0] * 7, num_cached_tokens=0, finished=finished,
                                      outputs=[SimpleNamespace(index=0, token_ids=tokens)])
                if finished:  # as vLLM's loop: the output's own flag, read before it went out
                    return

        return stream()


def test_a_stream_whose_reader_stopped_counts_what_the_engine_made_meanwhile_when_closed():
    """The client stops reading (its socket's buffers full, the replica's pump waits); the engine
    goes on. Closed then, the stream counts every token the engine made, not only those read —
    by the time the count settles, since vLLM's serving layer (as ``serving`` here) never closes
    the engine's generator itself: asyncio does, once it is dropped."""
    engine = StreamingEngine()
    token_count.install(engine)

    async def serving(results):
        async for result in results:
            yield result

    async def request():
        count = token_count.start()
        stream = serving(engine.generate("p", SimpleNamespace(output_kind=Kind.DELTA), "req-1"))
        core = asyncio.ensure_future(engine.run(1000))
        read = 0
        async for output in stream:
            read += len(output.outputs[0].token_ids)
            if read >= 3:
                break  # the pump blocks on the client's socket: nothing more is asked for
        while engine.generated < 50:
            await asyncio.sleep(0.001)
        await stream.aclose()  # the stall's limit, or the client hangs up
        await count.settled(1.0)  # as the replica, before its trailer
        snapshot = count.snapshot()
        await core
        return snapshot, read

    counted, read = asyncio.run(request())
    assert engine.aborted == ["req-1"] and read < 50 <= engine.generated < 1000
    assert counted == Generated(prompt_tokens=7, completion_tokens=engine.generated, cached_tokens=0)


def test_a_stream_still_held_somewhere_is_closed_and_counted_as_the_count_settles():
    """An exception's traceback (or any reference) can keep the engine's generator from being
    collected, so asyncio never closes it: ``settled`` closes a stream nothing iterates itself."""
    engine = StreamingEngine()
    token_count.install(engine)

    async def request():
        count = token_count.start()
        held = engine.generate("p", SimpleNamespace(output_kind=Kind.DELTA), "req-1")  # never dropped
        core = asyncio.ensure_future(engine.run(1000))
        await anext(held)
        while engine.generated < 20:
            await asyncio.sleep(0.001)
        await count.settled(1.0)
        counted = count.snapshot()
        await core
        return counted

    counted = asyncio.run(request())
    assert engine.aborted == ["req-1"] and counted.completion_tokens == engine.generated >= 20


def test_an_engines_refusal_leaves_a_counted_stream_at_once_with_no_abort():
    """vLLM refuses a request as its generator first runs (a grammar it cannot compile): the
    error must reach the serving layer in that same step, so that the replica can still answer
    the stream with a 4xx before its head."""
    class RefusingEngine(StreamingEngine):
        def generate(self, prompt, sampling_params, request_id, **kwargs):
            async def stream():
                raise ValueError("Grammar error")
                yield  # an async generator

            return stream()

    engine = RefusingEngine()
    token_count.install(engine)

    async def request():
        token_count.start()
        first = asyncio.ensure_future(anext(engine.generate("p", SimpleNamespace(output_kind=Kind.DELTA), "r")))
        await asyncio.sleep(0)
        return first

    first = asyncio.run(request())
    assert isinstance(first.exception(), ValueError) and engine.aborted == []


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


class FinalOnlyEngine:
    """As vLLM's ``AsyncLLM`` runs a final-only request: ``generate`` yields one output, when the
    request ends; ``abort`` ends it at once, and the generator then yields what it had."""

    def __init__(self, *, answers_abort=True, queued=False, abort_takes_s=0.0):
        self.generated, self.aborted, self.closed = 0, [], False
        self.answers_abort, self.queued = answers_abort, queued  # queued: never scheduled
        self.abort_takes_s = abort_takes_s  # the abort's trip to the engine core
        self._stop = asyncio.Event()

    async def abort(self, request_id):
        self.aborted.append(request_id)
        await asyncio.sleep(self.abort_takes_s)
        if self.answers_abort:
            self._stop.set()

    def generate(self, prompt, sampling_params, request_id, **kwargs):
        async def final_only():
            try:
                while not self._stop.is_set() and self.generated < 1000:
                    await asyncio.sleep(0.001)
                    self.generated += 0 if self.queued else 1
                yield _output([self.generated], prompt=7, cached=2)
            finally:
                self.closed = True

        return final_only()


def _leave_a_final_only_request(engine, after_tokens, cancels=1):
    token_count.install(engine)

    async def request():
        count = token_count.start()

        async def consume():  # vLLM's non-stream serving layer: the last output is the answer
            async for _ in engine.generate("p", SimpleNamespace(output_kind=Kind.FINAL_ONLY), "req-1"):
                pass

        served = asyncio.ensure_future(consume())
        await asyncio.sleep(0.005)  # the request is in the engine
        while engine.generated < after_tokens:
            await asyncio.sleep(0.001)
        served.cancel()  # the client left: Serve cancels the request's task
        for _ in range(cancels - 1):  # and again, while the abort is on its way
            await asyncio.sleep(0.002)
            served.cancel()
        try:
            await served
        except asyncio.CancelledError:
            pass
        return count

    return asyncio.run(request())


def test_a_final_only_request_cancelled_mid_generation_is_aborted_and_counts_what_it_had():
    engine = FinalOnlyEngine()
    count = _leave_a_final_only_request(engine, after_tokens=20)
    assert engine.aborted == ["req-1"] and engine.closed
    assert count.prompt_tokens == 7 and count.cached_tokens == 2
    assert 20 <= count.completion_tokens == engine.generated < 1000


def test_a_final_only_request_cancelled_again_while_it_is_aborted_still_counts_what_it_had():
    engine = FinalOnlyEngine(abort_takes_s=0.02)
    count = _leave_a_final_only_request(engine, after_tokens=20, cancels=3)
    assert engine.aborted == ["req-1"] and engine.closed
    assert count.prompt_tokens == 7 and 20 <= count.completion_tokens == engine.generated < 1000


def test_an_engine_that_yields_nothing_after_the_abort_costs_a_bounded_wait_and_counts_nothing(monkeypatch):
    monkeypatch.setattr(token_count, "ABORTED_OUTPUT_WAIT_S", 0.05)
    engine = FinalOnlyEngine(answers_abort=False)
    count = _leave_a_final_only_request(engine, after_tokens=5)
    assert engine.aborted == ["req-1"] and engine.closed  # closed after the wait: vLLM aborts it itself
    assert count.snapshot() == Generated()


def test_final_only_generations_vllm_merges_are_each_counted_before_the_count_settles():
    """A completions ``prompt`` list: vLLM merges one generation per prompt, each driven by a
    task of its own that its cancellation reaches only after the request's task has ended."""
    from vllm.utils.async_utils import merge_async_iterators

    engines = [FinalOnlyEngine(), FinalOnlyEngine()]
    for engine in engines:
        token_count.install(engine)

    async def request():
        count = token_count.start()

        async def consume():
            params = SimpleNamespace(output_kind=Kind.FINAL_ONLY)
            generations = [engine.generate("p", params, f"req-{i}") for i, engine in enumerate(engines)]
            async for _ in merge_async_iterators(*generations):
                pass

        served = asyncio.ensure_future(consume())
        while min(engine.generated for engine in engines) < 10:
            await asyncio.sleep(0.001)
        served.cancel()
        try:
            await served
        except asyncio.CancelledError:
            pass
        await count.settled(1.0)
        return count

    count = asyncio.run(request())
    assert all(engine.aborted and engine.closed for engine in engines)
    assert count.prompt_tokens == 14  # both prompts
    assert count.completion_tokens == sum(engine.generated for engine in engines) >= 20


def test_a_final_only_request_given_up_in_the_engines_queue_costs_nothing():
    """vLLM's abort output carries the prompt whether or not it was ever computed."""
    engine = FinalOnlyEngine(queued=True)
    count = _leave_a_final_only_request(engine, after_tokens=0)
    assert engine.aborted == ["req-1"] and engine.closed
    assert count.snapshot() == Generated()

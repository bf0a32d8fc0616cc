"""How many tokens the engine really handled for one request, whatever became of its answer.

Billing needs the tokens a request cost even when nobody saw its usage: a stream the client
abandoned, a stream cut by an engine fault. vLLM reports usage only at the end of a finished
answer, so the replica counts at the one place every API surface passes through — the engine's
``generate`` — by wrapping it once per replica (``install``). Each request sets its own
``TokenCount`` (``start``) in its task's context before calling vLLM's serving layer; every
``generate`` call made for it (one per choice set, several for a Responses turn that calls tools)
adds what its ``RequestOutput``s carry. Counting ``token_ids`` is exact with multi-token steps
(speculative decoding, MTP), where counting SSE chunks is not.

Cost: one async-generator hop and a ``len`` per engine step per request (~1 µs), against the
tens of microseconds vLLM's serving layer spends on the same step.

Embeddings pass through the engine's ``encode`` instead (one engine request per input): each
finished ``PoolingRequestOutput`` adds its prompt tokens, so an embedding whose client left is
billed the inputs the engine finished (``counting_encode``).
"""

import asyncio
import contextlib
import contextvars
import functools
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from serve_app.wire.messages import Generated
from serve_app.wire.socket import until_done

_CURRENT: contextvars.ContextVar["TokenCount | None"] = contextvars.ContextVar("serve_app_token_count", default=None)


class TokenCount:
    """Tokens of one request: prompt (per generate call), completion, and prompt tokens served
    from the prefix cache."""

    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "token_ids", "_counting", "_settled",
                 "_streams", "_ends_at")

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        # The completion's token ids in order, for a stream of one choice (what a resume of it
        # continues from); None when there is more than one choice.
        self.token_ids: list[int] | None = []
        self._counting = 0  # final-only or stream generations of this request not closed yet
        self._settled: asyncio.Event | None = None
        self._streams: weakref.WeakSet = weakref.WeakSet()  # its stream generations (``_counted``)
        self._ends_at: int | None = None  # where the completion ended, once the replica stopped it (``cut_at``)

    def cut_at(self, completion_tokens: int) -> None:
        """The completion ends at ``completion_tokens`` (a stop the replica matched itself: a stop
        string across a resumed stream's seam): what the engine made past it is not the answer's,
        as past a stop vLLM matches, whose usage counts none of it."""
        self._ends_at = completion_tokens
        self._clamp()

    def _clamp(self) -> None:
        # Also for what is counted later: the engine's outputs read after the abort (``settled``).
        if self._ends_at is not None:
            self.completion_tokens = min(self.completion_tokens, self._ends_at)
            if self.token_ids is not None:
                del self.token_ids[self._ends_at:]

    def snapshot(self) -> Generated:
        """The count so far, as the trailer carries it."""
        return Generated(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    async def settled(self, timeout_s: float) -> None:
        """Until every final-only or stream generation of the request has closed, at most
        ``timeout_s``. A request cancelled while vLLM merges several generations (a completions
        ``prompt`` list) leaves each to be cancelled in a task of its own, later: what they had
        when aborted is counted there (``_counted_final``), after the request's own task has
        ended; a stream's is closed here if nothing is iterating it (vLLM's serving layer never
        closes it: dropped, asyncio would, a turn later — or, held by an exception's traceback,
        only when the cycle collector runs)."""
        if self._counting == 0:
            return
        for stream in list(self._streams):
            if stream.ag_frame is not None and not stream.ag_running:
                await stream.aclose()
        if self._counting == 0:
            return
        self._settled = self._settled or asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._settled.wait(), timeout_s)

    def _opened(self) -> None:
        self._counting += 1

    def _closed(self) -> None:
        self._counting -= 1
        if self._counting == 0 and self._settled is not None:
            self._settled.set()


def current() -> TokenCount | None:
    """The count of the request this task serves, if one was started."""
    return _CURRENT.get()


def start() -> TokenCount:
    """A fresh count for the request this task serves; ``generate`` calls made from this task
    (or tasks it starts from now on) add to it."""
    count = TokenCount()
    _CURRENT.set(count)
    return count


def install(engine: Any) -> None:
    """Wrap ``engine.generate`` and ``engine.encode`` (vLLM's ``AsyncLLM``; every serving object
    calls one of them) so calls made under a ``TokenCount`` are counted. Calls outside one pass
    through untouched."""
    engine.generate = counting(engine.generate, abort=getattr(engine, "abort", None))
    if hasattr(engine, "encode"):
        engine.encode = counting_encode(engine.encode)


def counting(generate: Callable[..., AsyncIterator[Any]],
             abort: Callable[[str], Awaitable[Any]] | None = None) -> Callable[..., AsyncIterator[Any]]:
    """``abort``: the engine's (``AsyncLLM.abort``, by the request id ``generate`` was given),
    which a final-only request is stopped with when its caller stops waiting (``_counted_final``)."""

    def counted_generate(prompt, sampling_params, request_id, *args, **kwargs):
        outputs = generate(prompt, sampling_params, request_id, *args, **kwargs)
        count = _CURRENT.get()
        if count is None:
            return outputs
        kind = getattr(getattr(sampling_params, "output_kind", None), "name", None)
        stop = functools.partial(abort, request_id) if abort is not None else None
        if kind == "FINAL_ONLY" and stop is not None:
            return _counted_final(outputs, count, stop)
        if kind != "DELTA" or stop is None:
            return _counted(outputs, count, deltas=kind == "DELTA")
        stream = _counted(outputs, count, deltas=True, abort=stop)
        count._streams.add(stream)
        return stream

    return counted_generate


class _Seen:
    """What one ``generate`` call has been counted for: its prompt (with its first output), and
    its choices' tokens so far (cumulative outputs)."""

    __slots__ = ("prompt", "tokens")

    def __init__(self) -> None:
        self.prompt = False
        self.tokens: dict[int, int] = {}


async def _counted(outputs: AsyncIterator[Any], count: TokenCount, *, deltas: bool,
                   abort: Callable[[], Awaitable[Any]] | None = None) -> AsyncIterator[Any]:
    """``outputs`` unchanged, counted on the way. ``deltas``: each output carries only its new
    tokens (streams); otherwise each carries all so far (cumulative, or final only). ``abort``: a
    stream's, to count what the engine made that nobody read when it is closed early."""
    seen = _Seen()
    finished = False
    # vLLM's serving layer never closes this generator itself: closed early, it drops it, and
    # asyncio closes it in a task of its own a turn later. The replica's trailer waits for that
    # (``settled``), so that what is counted below is in it; once the last output has passed,
    # nothing is left to count and nothing to wait for.
    settling = abort is not None
    if settling:
        count._opened()
    suspended = False  # closed at its yield: the engine may have made outputs nobody has read
    try:
        async for output in outputs:
            _add(count, output, seen, deltas=deltas)
            finished = bool(getattr(output, "finished", False))
            if finished and settling:
                settling = False
                count._closed()
            suspended = True
            yield output
            suspended = False
    finally:
        try:
            # Not after vLLM's own error or refusal (raised from its generator, now closed): that
            # must reach the serving layer at once (a refusal before the stream's head is a 4xx).
            if suspended and not finished and abort is not None:
                await until_done(asyncio.ensure_future(_count_the_unread(outputs, count, seen, abort)))
        finally:
            try:
                # Closed early (the client left, the stream broke): close vLLM's generator now, which
                # aborts the engine request and frees its KV cache, not whenever it is collected.
                await outputs.aclose()
            finally:
                if settling:
                    count._closed()


async def _count_the_unread(outputs: AsyncIterator[Any], count: TokenCount, seen: _Seen,
                            abort: Callable[[], Awaitable[Any]]) -> None:
    """A stream closed early: vLLM does not wait for its reader, it merges the steps nobody has
    read into one output (``RequestOutputCollector``), which closing the generator throws away.
    A client that stops reading while the engine goes on to the limit would be billed what fit in
    the sockets' buffers. Aborted first, vLLM puts its last output (finish ``abort``) after the
    merged steps, and the generator, still at its ``yield``, gives them as one output, counted.
    Nothing comes when the generator was not at its ``yield`` (cancelled while it waited: nothing
    was unread) or the engine died; the wait is a bound, not a delay."""
    try:
        output = await asyncio.wait_for(_after_abort(abort, outputs.__anext__()), ABORTED_OUTPUT_WAIT_S)
    except Exception:  # StopAsyncIteration, the engine's own error, no output in time: nothing to add
        return
    if seen.prompt or any(choice.token_ids for choice in output.outputs):  # as a stream's prompt: once it generated
        _add(count, output, seen, deltas=True)


async def _counted_final(outputs: AsyncIterator[Any], count: TokenCount,
                         abort: Callable[[], Awaitable[Any]]) -> AsyncIterator[Any]:
    """A non-stream request's ``outputs``: vLLM yields one, when the request finishes, so a
    request cancelled before that (its client left) would count nothing, not even its prompt.
    Cancelled, this aborts the request through the engine while vLLM's generator still waits:
    vLLM then hands that generator a last output, what the request had when aborted (finish
    reason ``abort``), which is counted before the cancellation goes on."""
    seen = _Seen()
    pending: asyncio.Future | None = None
    count._opened()
    try:
        while True:
            pending = asyncio.ensure_future(outputs.__anext__())
            try:
                output = await asyncio.shield(pending)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                # In a task of its own, waited for however often this is cancelled meanwhile (Serve
                # cancelling again, a replica stopping): what the request had is its bill.
                await until_done(asyncio.ensure_future(_count_the_aborted(pending, count, seen, abort)))
                raise
            pending = None
            _add(count, output, seen, deltas=False)
            yield output
    finally:
        try:
            if pending is not None and not pending.done():
                pending.cancel()  # vLLM's generator, cancelled, aborts the request itself
                await asyncio.wait({pending})  # before aclose: a generator still running cannot be closed
            if pending is not None and not pending.cancelled():
                pending.exception()  # read (a dead engine's error, logged by the replica): not "never retrieved"
            await outputs.aclose()
        finally:
            count._closed()


async def _count_the_aborted(pending: asyncio.Future, count: TokenCount, seen: _Seen,
                             abort: Callable[[], Awaitable[Any]]) -> None:
    """vLLM builds the aborted request's output from its state, prompt included, whether or not
    the engine ever scheduled it: counted only once it generated (its prompt was computed), as a
    stream is, so a request given up while it waited in the engine's queue costs nothing."""
    try:
        output = await asyncio.wait_for(_after_abort(abort, asyncio.shield(pending)), ABORTED_OUTPUT_WAIT_S)
    except Exception:  # StopAsyncIteration, the engine's own error, no output in time: nothing to add
        return
    if any(choice.token_ids for choice in output.outputs):
        _add(count, output, seen, deltas=False)


# How long a cancelled final-only request (or a stream closed early) waits for the abort and vLLM's
# output of what it had then (put on its queue at once by the abort; the wait is a bound, not a
# delay: an engine core that died answers neither).
ABORTED_OUTPUT_WAIT_S = 1.0


async def _after_abort(abort: Callable[[], Awaitable[Any]], output: Awaitable[Any]) -> Any:
    """``output`` (the request's next output), once the engine request is aborted."""
    await abort()
    return await output


def _add(count: TokenCount, output: Any, seen: _Seen, *, deltas: bool) -> None:
    """One ``RequestOutput`` of a ``generate`` call into ``count``."""
    if not seen.prompt:
        seen.prompt = True
        count.prompt_tokens += len(output.prompt_token_ids or ())
        count.cached_tokens += output.num_cached_tokens or 0
    for choice in output.outputs:
        tokens = len(choice.token_ids)
        if deltas:
            count.completion_tokens += tokens
        else:
            count.completion_tokens += tokens - seen.tokens.get(choice.index, 0)
            seen.tokens[choice.index] = tokens
        if count.token_ids is not None:
            if choice.index:  # a second choice: nothing to resume from
                count.token_ids = None
            elif deltas:
                count.token_ids.extend(choice.token_ids)
            else:
                count.token_ids[:] = choice.token_ids
    count._clamp()


def counting_encode(encode: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    """``encode`` (vLLM's pooling call: its serving layer passes every argument by keyword), with
    each finished output's prompt tokens added to the request's count."""

    def counted_encode(*args, **kwargs):
        outputs = encode(*args, **kwargs)
        count = _CURRENT.get()
        return outputs if count is None else _counted_pooling(outputs, count)

    return counted_encode


async def _counted_pooling(outputs: AsyncIterator[Any], count: TokenCount) -> AsyncIterator[Any]:
    try:
        async for output in outputs:
            if output.finished:  # its one forward pass is done: its prompt was computed
                count.prompt_tokens += len(output.prompt_token_ids or ())
                count.cached_tokens += output.num_cached_tokens or 0
            yield output
    finally:
        await outputs.aclose()  # closed early (the client left): vLLM aborts the engine request

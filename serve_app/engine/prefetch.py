"""``Prefetched``: the engine's first output already being produced while the replica's first
item travels to the router."""

import asyncio
from collections import deque
from typing import Any

from serve_app.wire.socket import until_done

# What a fresh stream's source makes before it waits for the engine is framing (a Responses
# stream's two opening events): at most this many items run through before the head.
AHEAD = 8
# Turns of the loop a source that merges several engine requests (vLLM's ``merge_async_iterators``
# for a completions request's prompts: one task each) may take before its first item: its own, the
# tasks' (each submits its request, or is refused), ``asyncio.wait``'s wake-up and the merge's (4,
# tests/unit/test_byte_stream.py), and two to spare. A stream that waits spins them (~µs each).
MERGED_TURNS = 6


class Prefetched:
    """An async iterator whose first item is already being produced when it is made.

    vLLM's stream generator submits the request to the engine only when first iterated. Its first
    steps run before the head is yielded (``started``), the engine's queue and prefill overlap the
    head's trip to the router and the router's connect, instead of waiting for both.
    """

    def __init__(self, source):
        self._source = source
        self._made: deque = deque()  # items the source yielded before its first wait, not yet taken
        self._first: asyncio.Future | None = asyncio.ensure_future(source.__anext__())

    @classmethod
    async def started(cls, source, ahead: int = 0, turns: int = 1) -> "Prefetched":
        """Made, and run up to the source's first wait before this returns (through ``ahead``
        items it makes without waiting).

        A task made with ``ensure_future`` runs only when its maker next waits; the replica's
        next wait came after it had written the head, so vLLM sent the request to the engine core
        after the head (≈ 1 ms later at one stream, strace). Turns of the loop let vLLM's
        generator run to its first real wait — for the engine core's output, the request sent —
        so the head's trip and the router's connect overlap the prefill. What the source yields
        before that wait (a Responses stream's ``response.created`` and ``response.in_progress``)
        is kept for its reader; an engine that refuses the request has said so by then
        (``made_first``, ``raise_early``), before the head.

        A resumed stream runs no items ahead (``ahead`` 0): its replayed tokens come without a
        wait, and the seam (``replay.py``) takes an item asked for as one whose events are out.
        ``turns``: how many turns of the loop the source may take to make its first item (or
        raise) before it is taken to wait for the engine (``MERGED_TURNS``: a merge of several).
        """
        prefetched = cls(source)
        try:
            for _ in range(turns):
                await asyncio.sleep(0)
                if prefetched._settled() is not None:
                    break
            while prefetched._ran_through(ahead):
                await asyncio.sleep(0)
        except BaseException:  # cancelled here, no caller holds it to close: the engine request is ours to abort
            await until_done(asyncio.ensure_future(prefetched.aclose()))
            raise
        return prefetched

    def _settled(self) -> asyncio.Future | None:
        """The pending item's production, if it has ended (made the item, or raised) without a wait."""
        first = self._first
        return first if first is not None and first.done() and not first.cancelled() else None

    def _ran_through(self, ahead: int) -> bool:
        """Keep the item the source made without waiting and ask for the next: False once the
        source waits, ends or raises, or ``ahead`` items came."""
        first = self._settled()
        if len(self._made) >= ahead or first is None or first.exception() is not None:
            return False
        self._made.append(first.result())
        self._first = asyncio.ensure_future(self._source.__anext__())
        return True

    @property
    def made_first(self) -> Any:
        """The source's first item, if it made it before the head (else None)."""
        if self._made:
            return self._made[0]
        first = self._settled()
        return first.result() if first is not None and first.exception() is None else None

    async def raise_early(self) -> None:
        """Raise what the source raised before the head, closed first (its end is no error)."""
        first = self._settled()
        raised = first.exception() if first is not None else None
        if raised is None or isinstance(raised, StopAsyncIteration):
            return
        await self.aclose()
        raise raised

    def __aiter__(self) -> "Prefetched":
        return self

    async def __anext__(self):
        if self._made:
            return self._made.popleft()
        if self._first is not None:
            first, self._first = self._first, None
            return await first
        return await self._source.__anext__()

    async def aclose(self) -> None:
        """Stop the source (vLLM aborts the engine request), also while its next item is pending."""
        self._made.clear()
        try:
            if self._first is not None:
                self._first.cancel()
                await until_done(self._first)  # the source must not be running when it is closed
                if not self._first.cancelled():
                    self._first.exception()  # read: a failure nobody awaited is not logged as lost
                self._first = None
        finally:  # cancelled again while it waited: the source is still closed (the engine aborts)
            await self._source.aclose()

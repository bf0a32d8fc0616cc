"""``Prefetched``: the engine's first output already being produced while the replica's first
item travels to the router."""

import asyncio

from serve_app.wire.socket import until_done


class Prefetched:
    """An async iterator whose first item is already being produced when it is made.

    vLLM's stream generator submits the request to the engine only when first iterated. Its first
    step run before the head is yielded (``started``), the engine's queue and prefill overlap the
    head's trip to the router and the router's connect, instead of waiting for both.
    """

    def __init__(self, source):
        self._source = source
        self._first: asyncio.Future | None = asyncio.ensure_future(source.__anext__())

    @classmethod
    async def started(cls, source) -> "Prefetched":
        """Made, and its first item's production run up to its first wait before this returns.

        A task made with ``ensure_future`` runs only when its maker next waits; the replica's
        next wait came after it had written the head, so vLLM sent the request to the engine core
        after the head (≈ 1 ms later at one stream, strace). One turn of the loop lets vLLM's
        generator run to its first real wait — for the engine core's output, the request sent —
        so the head's trip and the router's connect overlap the prefill. Where the source yields
        items before it touches the engine (a Responses stream's ``response.created`` and
        ``response.in_progress``; a resumed stream's replayed tokens), its first wait comes later,
        and the request still goes out after the head.
        """
        prefetched = cls(source)
        try:
            await asyncio.sleep(0)
        except BaseException:  # cancelled here, no caller holds it to close: the engine request is ours to abort
            await until_done(asyncio.ensure_future(prefetched.aclose()))
            raise
        return prefetched

    def __aiter__(self) -> "Prefetched":
        return self

    async def __anext__(self):
        if self._first is not None:
            first, self._first = self._first, None
            return await first
        return await self._source.__anext__()

    async def aclose(self) -> None:
        """Stop the source (vLLM aborts the engine request), also while its first item is pending."""
        if self._first is not None:
            self._first.cancel()
            await until_done(self._first)  # the source must not be running when it is closed
            self._first = None
        await self._source.aclose()

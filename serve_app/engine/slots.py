"""A model replica's slots: at most ``limit()`` calls hold one at once, the rest wait first come
first served. The limit is read whenever a call arrives or ends, not fixed at start, because it is
the deployment's ``max_ongoing_requests`` as Serve holds it now: a deploy that changes it
reconfigures the replica in place (no restart), and a fixed semaphore kept the old number (or,
worse, its default: a region's replicas admitted 32 while Serve sent them 96).

A raised limit lets waiting calls in on the next arrival or end (every engine step ends some when
a replica is that busy); a lowered one admits nothing new until the calls holding slots are
below it, and cuts none.
"""

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable


class Slots:
    def __init__(self, limit: Callable[[], int]):
        self._limit = limit
        self.taken = 0
        self._waiting: deque[asyncio.Future[None]] = deque()

    async def __aenter__(self) -> None:
        self._admit()
        if self.taken < self._limit() and not self._waiting:
            self.taken += 1
            return
        turn = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.cancelled():
                with contextlib.suppress(ValueError):  # ``_admit`` may have dropped it already
                    self._waiting.remove(turn)
            else:  # given a slot as it was cancelled: hand it on
                self._release()
            raise

    async def __aexit__(self, *exc_info: object) -> None:
        self._release()

    def _release(self) -> None:
        self.taken -= 1
        self._admit()

    def _admit(self) -> None:
        """The waiting calls, in order, while the limit has room for them."""
        while self._waiting and self.taken < self._limit():
            turn = self._waiting.popleft()
            if not turn.done():  # a cancelled wait leaves its turn done
                self.taken += 1
                turn.set_result(None)

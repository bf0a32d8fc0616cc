"""An owner's share of a pool of threads on one router: at most ``per_owner`` of its calls run at
once, the rest wait their owner's turn, not a thread's. The router's few database threads are
shared by every tenant; without a share, one tenant's burst (a dashboard's reads, puts held by a
slow primary) filled them all and every other tenant's answer waited behind it.

A call's place is held until its thread is done, not until its caller stops waiting: a request
whose client left is cancelled, but a statement already on a thread runs on, and a tenant that
hung up at once on each of its reads would otherwise fill every thread all the same."""

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass
class _Share:
    slots: asyncio.Semaphore
    users: int = 0  # running or waiting: at 0 the share is dropped (an owner seen once holds no memory)


@dataclass
class OwnerShares:
    per_owner: int
    _shares: dict[str, _Share] = field(default_factory=dict)

    async def run(self, owner: str, executor: Executor, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on ``executor``, once ``owner`` has a place; the place is given back when
        the thread is done with it (or the call never started)."""
        share = self._shares.setdefault(owner, _Share(asyncio.Semaphore(self.per_owner)))
        share.users += 1  # counted: a released slot reads free before its next holder runs
        try:
            await share.slots.acquire()
        except BaseException:  # cancelled while it waited: it held no place
            self._leave(owner, share)
            raise
        loop = asyncio.get_running_loop()
        try:
            job: Future = executor.submit(fn, *args)
        except BaseException:
            self._release(owner, share)
            raise

        def done(_: Future) -> None:  # on the worker's thread (or here, if cancelled before it ran)
            try:
                loop.call_soon_threadsafe(self._release, owner, share)
            except RuntimeError:  # the loop is closed: the router has stopped
                pass

        job.add_done_callback(done)
        return await asyncio.wrap_future(job)

    def _release(self, owner: str, share: _Share) -> None:
        share.slots.release()
        self._leave(owner, share)

    def _leave(self, owner: str, share: _Share) -> None:
        share.users -= 1
        if share.users == 0 and self._shares.get(owner) is share:
            del self._shares[owner]

    def owners(self) -> dict[str, int]:
        """Each owner with calls running or waiting here, and how many (tests, diagnostics)."""
        return {owner: share.users for owner, share in self._shares.items()}

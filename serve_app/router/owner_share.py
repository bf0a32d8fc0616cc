"""An owner's share of a pool of threads on one router: at most ``per_owner`` of its calls run at
once, the rest wait their owner's turn, not a thread's. The router's few database threads are
shared by every tenant; without a share, one tenant's burst (a dashboard's reads, puts held by a
slow primary) filled them all and every other tenant's answer waited behind it."""

import asyncio
import contextlib
from dataclasses import dataclass, field


@dataclass
class _Share:
    slots: asyncio.Semaphore
    users: int = 0  # running or waiting: at 0 the share is dropped (an owner seen once holds no memory)


@dataclass
class OwnerShares:
    per_owner: int
    _shares: dict[str, _Share] = field(default_factory=dict)

    @contextlib.asynccontextmanager
    async def turn(self, owner: str):
        share = self._shares.setdefault(owner, _Share(asyncio.Semaphore(self.per_owner)))
        share.users += 1  # counted: a released slot reads free before its next holder runs
        try:
            async with share.slots:
                yield
        finally:
            share.users -= 1
            if share.users == 0:
                del self._shares[owner]

    def owners(self) -> dict[str, int]:
        """Each owner with calls running or waiting here, and how many (tests, diagnostics)."""
        return {owner: share.users for owner, share in self._shares.items()}

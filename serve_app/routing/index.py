"""Which replica most likely still holds which prompt blocks: the router's model of each engine's
prefix cache, bounded and evicted the way the engine evicts.

Each replica gets a bit; ``_holders`` maps a block hash to the bits of the replicas that served
it, and each replica keeps its own LRU of the blocks it holds, capped at what its engine's cache
can hold (``blocks_per_replica``) and by the index's total (``max_blocks`` shared between the
replicas). A request's blocks are recorded on the replica it was routed to from its last block
to its first, so a conversation's first blocks — the ones every later turn shares — are the most
recent and are evicted last; vLLM frees a finished request's blocks in the same reverse order,
so its free queue drops a prompt's tail first too.

A lookup walks the request's chain once, keeping the replicas that hold every block so far, and
stops at the first block nobody holds: per request O(blocks matched), nothing per token.
"""

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

DEFAULT_MAX_BLOCKS = 100_000  # every replica's entries together: ~25 MB of router memory at most


class PrefixIndex:
    def __init__(self, blocks_per_replica: int, max_blocks: int = DEFAULT_MAX_BLOCKS):
        if blocks_per_replica < 1 or max_blocks < 1:
            raise ValueError("blocks_per_replica and max_blocks must be positive")
        self.blocks_per_replica, self.max_blocks = blocks_per_replica, max_blocks
        self._bits: dict[Hashable, int] = {}  # replica → its bit
        self._lru: dict[Hashable, OrderedDict[int, None]] = {}  # replica → its blocks, oldest first
        self._holders: dict[int, int] = {}  # block hash → bits of the replicas holding it

    # --- replicas ----------------------------------------------------------------------------
    def sync(self, replicas: Iterable[Hashable]) -> None:
        """Track exactly ``replicas``: a new one starts empty (its engine's cache is), a gone one
        is forgotten with its blocks."""
        wanted = set(replicas)
        for replica in [r for r in self._bits if r not in wanted]:
            self._forget(replica)
        for replica in wanted - self._bits.keys():
            used = set(self._bits.values())
            self._bits[replica] = next(1 << n for n in range(len(used) + 1) if 1 << n not in used)
            self._lru[replica] = OrderedDict()
        for replica in self._bits:  # more replicas: a smaller share each
            self._trim(replica)

    def _forget(self, replica: Hashable) -> None:
        bit = self._bits.pop(replica)
        for block in self._lru.pop(replica):
            self._drop(block, bit)

    @property
    def capacity(self) -> int:
        """Blocks one replica may hold: its engine's cache, or its share of the index."""
        return min(self.blocks_per_replica, self.max_blocks // max(len(self._bits), 1))

    def size(self, replica: Hashable) -> int:
        return len(self._lru.get(replica, ()))

    # --- requests ----------------------------------------------------------------------------
    def match(self, hashes: Sequence[int], replicas: Iterable[Hashable]) -> dict[Hashable, int]:
        """For each of ``replicas``, how many of the chain's first blocks it holds."""
        depth = {replica: 0 for replica in replicas}
        alive = 0
        for replica in depth:
            alive |= self._bits.get(replica, 0)
        for i, block in enumerate(hashes):
            holding = self._holders.get(block, 0) & alive
            if holding != alive:
                for replica in depth:
                    bit = self._bits.get(replica, 0)
                    if alive & bit and not holding & bit:
                        depth[replica] = i
            alive = holding
            if not alive:
                return depth
        for replica in depth:
            if alive & self._bits.get(replica, 0):
                depth[replica] = len(hashes)
        return depth

    def record(self, replica: Hashable, hashes: Sequence[int]) -> None:
        """``replica`` served this chain: its blocks are now its most recent, first block last."""
        bit = self._bits.get(replica)
        if bit is None:
            return
        lru = self._lru[replica]
        for block in reversed(hashes):
            if block in lru:
                lru.move_to_end(block)
            else:
                lru[block] = None
                self._holders[block] = self._holders.get(block, 0) | bit
        self._trim(replica)

    def _trim(self, replica: Hashable) -> None:
        lru, bit, cap = self._lru[replica], self._bits[replica], self.capacity
        while len(lru) > cap:
            block, _ = lru.popitem(last=False)
            self._drop(block, bit)

    def _drop(self, block: int, bit: int) -> None:
        holders = self._holders.get(block, 0) & ~bit
        if holders:
            self._holders[block] = holders
        else:
            self._holders.pop(block, None)


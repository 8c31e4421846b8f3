"""KV block allocator: free list, reference counts, and an LRU of cached blocks.

A block is in exactly one state:
  free    - on the free list, holds nothing useful;
  used    - reference count > 0 (one per request using it);
  cached  - reference count 0 but its contents are a known prefix (it has a hash): kept in LRU
            order and reused by `match_prefix`, or evicted (oldest first) when `allocate` runs
            out of free blocks.
Invariant: num_free + num_used + num_cached == num_blocks. Pure Python; no torch.
`LockedAllocator` is the same behind a lock, for an engine whose thread and event loop both
allocate.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

from shared.block_hash import BlockHash
from shared.errors import CapacityExhausted

BlockEvent = Callable[[str, BlockHash], None]  # ("stored" | "removed", hash)


class BlockAllocator:
    def __init__(self, num_blocks: int, on_event: BlockEvent | None = None) -> None:
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refs: dict[int, int] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU: oldest first
        self._hash_of: dict[int, BlockHash] = {}
        self._block_of: dict[BlockHash, int] = {}
        self._on_event = on_event

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_available(self) -> int:
        """Blocks `allocate` can hand out: free ones plus evictable cached ones."""
        return len(self._free) + len(self._cached)

    def allocate(self, count: int) -> list[int]:
        if count > self.num_available:
            raise CapacityExhausted(f"need {count} KV blocks, {self.num_available} available")
        blocks = []
        for _ in range(count):
            block = self._free.pop() if self._free else self._evict_oldest()
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block; unreferenced blocks become cached or free."""
        for block in block_ids:
            refs = self._refs[block] - 1
            if refs > 0:
                self._refs[block] = refs
                continue
            del self._refs[block]
            if block in self._hash_of:
                self._cached[block] = None
            else:
                self._free.append(block)

    def share(self, block_ids: Sequence[int]) -> None:
        """Take one more reference to each used block (a forked sequence reads them too)."""
        for block in block_ids:
            self._refs[block] += 1

    def match_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Take a reference to the longest run of blocks holding `hashes`, in order."""
        matched = []
        for block_hash in hashes:
            block = self._block_of.get(block_hash)
            if block is None:
                break
            if block in self._cached:
                del self._cached[block]
                self._refs[block] = 1
            else:
                self._refs[block] += 1
            matched.append(block)
        return matched

    def held_hashes(self) -> list[BlockHash]:
        """Every hash a block holds now: the cache's whole state, as its events built it."""
        return list(self._block_of)

    def peek_prefix(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of `hashes` are held, without taking them."""
        count = 0
        for block_hash in hashes:
            if block_hash not in self._block_of:
                break
            count += 1
        return count

    def register(self, block: int, block_hash: BlockHash) -> None:
        """Record that used `block` now holds the full block `block_hash`."""
        if block not in self._refs:
            raise ValueError(f"block {block} is not in use")
        if block_hash in self._block_of or block in self._hash_of:
            return  # another block already holds this prefix; keep one copy indexed
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block
        if self._on_event is not None:
            self._on_event("stored", block_hash)

    def cache(self, block_ids: Sequence[int], hashes: Sequence[BlockHash]) -> None:
        """Register the first `len(hashes)` of used `block_ids` under `hashes`, then free
        them all (the registered ones stay cached)."""
        for block, block_hash in zip(block_ids, hashes, strict=False):
            self.register(block, block_hash)
        self.free(block_ids)

    def _evict_oldest(self) -> int:
        block, _ = self._cached.popitem(last=False)
        block_hash = self._hash_of.pop(block)
        del self._block_of[block_hash]
        if self._on_event is not None:
            self._on_event("removed", block_hash)
        return block


class LockedAllocator(BlockAllocator):
    """The allocator, safe to call from the event loop and the engine thread."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks, on_event=self._record)
        self.lock = threading.RLock()
        self._events: list[tuple[str, bytes]] = []

    def _record(self, kind: str, block_hash: bytes) -> None:
        self._events.append((kind, block_hash))  # called under self.lock

    def drain_events(self) -> list[tuple[str, bytes]]:
        with self.lock:
            events, self._events = self._events, []
        return events

    def held_hashes(self) -> list[BlockHash]:
        with self.lock:
            return super().held_hashes()

    def allocate(self, count: int) -> list[int]:
        with self.lock:
            return super().allocate(count)

    def free(self, block_ids: Sequence[int]) -> None:
        with self.lock:
            super().free(block_ids)

    def share(self, block_ids: Sequence[int]) -> None:
        with self.lock:
            super().share(block_ids)

    def match_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        with self.lock:
            return super().match_prefix(hashes)

    def register(self, block: int, block_hash: BlockHash) -> None:
        with self.lock:
            super().register(block, block_hash)

    def peek_prefix(self, hashes: Sequence[BlockHash]) -> int:
        with self.lock:
            return super().peek_prefix(hashes)

    def cache(self, block_ids: Sequence[int], hashes: Sequence[BlockHash]) -> None:
        with self.lock:  # reentrant: cache() calls register() and free()
            super().cache(block_ids, hashes)

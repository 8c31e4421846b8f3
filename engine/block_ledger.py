"""`BlockLedger`: the KV blocks each request holds, for engines that count blocks without
computing KV (the fake and the simulated engine).

It sits on a real `BlockAllocator`, prefix cache included: a prompt's full blocks are hashed
and registered once its prefill completed, later prompts sharing a prefix take those blocks
(and skip their cost), and the cache's stored/removed events feed the conductor's prefix
index as the torch engine's do. It implements the `PrefixCache` protocol, so an engine that
composes it hands those calls straight through.

Invariant: a request id owns at most one list of blocks (`blocks`), freed once (`free`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.block_allocator import BlockAllocator
from shared.block_hash import block_hashes
from shared.errors import CapacityExhausted


@dataclass(frozen=True)
class PromptBlocks:
    """A prompt's blocks as allocated: the hashes of its full blocks (empty without prefix
    caching) and how many leading prompt tokens the prefix cache already held."""

    hashes: list[bytes]
    num_cached_tokens: int


class BlockLedger:
    def __init__(self, num_blocks: int, block_size: int, *, is_prefix_caching: bool = True
                 ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.is_prefix_caching = is_prefix_caching
        self._events: list[tuple[str, bytes]] = []
        self._allocator = BlockAllocator(num_blocks, on_event=self._record_event)
        self._owned: dict[str, list[int]] = {}

    @property
    def num_available(self) -> int:
        return self._allocator.num_available

    def owns(self, request_id: str) -> bool:
        return request_id in self._owned

    def blocks(self, request_id: str) -> list[int]:
        return list(self._owned.get(request_id, []))

    def request_ids(self) -> list[str]:
        return list(self._owned)

    def allocate_prompt(self, request_id: str, prompt: list[int]) -> PromptBlocks:
        """Take the cached leading blocks of `prompt` and fresh ones for the rest (at least
        one prompt token is always computed); raises `CapacityExhausted`."""
        hashes = block_hashes(prompt, self.block_size) if self.is_prefix_caching else []
        cached = self._allocator.match_prefix(hashes)
        needed = math.ceil(len(prompt) / self.block_size) - len(cached)
        try:
            self._owned[request_id] = cached + self.take(needed)
        except CapacityExhausted:
            self._allocator.free(cached)
            raise
        return PromptBlocks(hashes, min(len(cached) * self.block_size, len(prompt) - 1))

    def reserve(self, request_id: str, num_tokens: int) -> list[int]:
        """Blocks for `num_tokens` tokens of a request that owns none yet (else its own)."""
        if request_id not in self._owned:
            self._owned[request_id] = self.take(max(1, math.ceil(num_tokens / self.block_size)))
        return list(self._owned[request_id])

    def grow(self, request_id: str, num_tokens: int) -> None:
        """Make a request's blocks hold `num_tokens`; on `CapacityExhausted` it keeps its own."""
        more = math.ceil(num_tokens / self.block_size) - len(self._owned[request_id])
        if more > 0:
            self._owned[request_id] += self.take(more)

    def register(self, request_id: str, hashes: list[bytes]) -> None:
        """The prompt's full blocks are computed: they join the prefix cache."""
        for block, block_hash in zip(self._owned.get(request_id, []), hashes, strict=False):
            self._allocator.register(block, block_hash)

    def free(self, request_id: str) -> bool:
        """Give back the request's blocks; whether it held any."""
        blocks = self._owned.pop(request_id, None)
        if blocks is None:
            return False
        self._allocator.free(blocks)
        return True

    def take(self, count: int) -> list[int]:
        available = self._allocator.num_available
        if count > available:
            raise CapacityExhausted(f"need {count} KV blocks, {available} free",
                                    param="max_tokens")
        return self._allocator.allocate(count)

    # The `PrefixCache` protocol: the block bookkeeping is real, the (absent) bytes are not.
    def drain_kv_events(self) -> list[tuple[str, bytes]]:
        events, self._events = self._events, []
        return events

    def held_block_hashes(self) -> list[bytes]:
        return self._allocator.held_hashes()

    def num_cached_blocks(self, block_hashes: list[bytes]) -> int:
        return self._allocator.peek_prefix(block_hashes)

    def hold_prefix(self, block_hashes: list[bytes]) -> list[int]:
        return self._allocator.match_prefix(block_hashes)

    def release_blocks(self, block_ids: list[int]) -> None:
        self._allocator.free(block_ids)

    def allocate_blocks(self, count: int) -> list[int]:
        return self.take(count)

    def cache_blocks(self, block_ids: list[int], block_hashes: list[bytes]) -> None:
        self._allocator.cache(block_ids, block_hashes)

    def _record_event(self, kind: str, block_hash: bytes) -> None:
        self._events.append((kind, block_hash))

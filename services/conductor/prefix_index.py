"""The global prefix index: which workers hold which prefix-cache blocks.

Built only from workers' `KvEventBatch`es (replayed from JetStream when a conductor starts),
so every conductor replica that has read the same events answers the same. Memory is
bounded: `removed` events evict, a worker that leaves is forgotten, and past `max_blocks`
entries the least recently stored or matched hash is dropped (a safety net: a dropped entry
only costs a missed cache hit).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

import numpy as np

from shared.block_hash import HASH_BYTES, BlockHash
from shared.messages import KvEventBatch, PrefixIndexSnapshot


class PrefixIndex:
    def __init__(self, max_blocks: int = 1_000_000) -> None:
        self.max_blocks = max_blocks
        self._holders: OrderedDict[BlockHash, set[str]] = OrderedDict()
        self._blocks_of: dict[str, set[BlockHash]] = {}

    def __len__(self) -> int:
        return len(self._holders)

    def apply(self, batch: KvEventBatch) -> None:
        worker = batch.worker_id
        if batch.is_reset:
            self.forget_worker(worker)
        for event in batch.events:
            block_hash = bytes.fromhex(event.block_hash)
            if event.kind == "stored":
                self._store(worker, block_hash)
            else:
                self._remove(worker, block_hash)

    def snapshot(self, stream_seq: int, taken_at_s: float) -> PrefixIndexSnapshot:
        """The whole index, as of KV-event stream sequence `stream_seq`."""
        hashes = list(self._holders)
        position = {block_hash: i for i, block_hash in enumerate(hashes)}
        workers = sorted(self._blocks_of)
        worker_blocks = [
            np.fromiter((position[h] for h in self._blocks_of[w] if h in position),
                        dtype="<u4").tobytes() for w in workers]
        return PrefixIndexSnapshot(
            stream_seq=stream_seq, taken_at_s=taken_at_s,
            hash_bytes=len(hashes[0]) if hashes else HASH_BYTES, hashes=b"".join(hashes),
            workers=workers, worker_blocks=worker_blocks)

    def restore(self, snapshot: PrefixIndexSnapshot) -> None:
        """Replace the index with `snapshot`'s (LRU order kept)."""
        size, data = snapshot.hash_bytes, snapshot.hashes
        hashes = [data[i:i + size] for i in range(0, len(data), size)]
        holders: list[set[str]] = [set() for _ in hashes]
        self._blocks_of = {}
        for worker, blocks in zip(snapshot.workers, snapshot.worker_blocks, strict=True):
            positions = np.frombuffer(blocks, dtype="<u4").tolist()
            for i in positions:
                holders[i].add(worker)
            self._blocks_of[worker] = {hashes[i] for i in positions}
        self._holders = OrderedDict(
            (block_hash, owners) for block_hash, owners in zip(hashes, holders, strict=True)
            if owners)
        self._evict_over_limit()

    def forget_worker(self, worker_id: str) -> None:
        for block_hash in self._blocks_of.pop(worker_id, set()):
            holders = self._holders.get(block_hash)
            if holders is not None:
                holders.discard(worker_id)
                if not holders:
                    del self._holders[block_hash]

    def leading_blocks(self, hashes: Sequence[BlockHash], workers: Collection[str]
                       ) -> dict[str, int]:
        """For each of `workers`, how many leading blocks of `hashes` it holds."""
        counts = dict.fromkeys(workers, 0)
        alive = set(counts)
        depth = 0
        for depth, block_hash in enumerate(hashes):
            holders = self._holders.get(block_hash)
            still = alive & holders if holders else set()
            for dropped in alive - still:
                counts[dropped] = depth
            alive = still
            if not alive:
                return counts
            self._holders.move_to_end(block_hash)
        for worker in alive:
            counts[worker] = depth + 1 if hashes else 0
        return counts

    def _store(self, worker: str, block_hash: BlockHash) -> None:
        holders = self._holders.setdefault(block_hash, set())
        holders.add(worker)
        self._holders.move_to_end(block_hash)
        self._blocks_of.setdefault(worker, set()).add(block_hash)
        self._evict_over_limit()

    def _evict_over_limit(self) -> None:
        while len(self._holders) > self.max_blocks:
            oldest, owners = self._holders.popitem(last=False)
            for owner in owners:
                self._blocks_of.get(owner, set()).discard(oldest)

    def _remove(self, worker: str, block_hash: BlockHash) -> None:
        holders = self._holders.get(block_hash)
        if holders is not None:
            holders.discard(worker)
            if not holders:
                del self._holders[block_hash]
        self._blocks_of.get(worker, set()).discard(block_hash)

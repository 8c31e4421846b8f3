from __future__ import annotations

import random

import pytest

from engine.block_allocator import BlockAllocator
from shared.block_hash import block_hashes, chain_hash
from shared.errors import CapacityExhausted


def check(allocator: BlockAllocator) -> None:
    assert allocator.num_free + allocator.num_used + allocator.num_cached == allocator.num_blocks


def test_hash_is_chained() -> None:
    assert block_hashes([1, 2, 3, 4], 2)[1] == chain_hash(chain_hash(None, [1, 2]), [3, 4])
    assert block_hashes([9, 2, 3, 4], 2)[1] != block_hashes([1, 2, 3, 4], 2)[1]
    assert block_hashes([1, 2, 3], 2) == block_hashes([1, 2], 2)
    assert chain_hash(None, [1], salt=b"a") != chain_hash(None, [1], salt=b"b")


def test_hash_value_is_pinned() -> None:
    # A fixed value: any change to the encoding breaks prefix matching across machines.
    assert chain_hash(None, [1, 2, 3]).hex() == "f6a753e0395b8dfa6485b18612a446af"


def test_allocate_and_free_keep_the_invariant() -> None:
    allocator = BlockAllocator(8)
    blocks = allocator.allocate(5)
    check(allocator)
    allocator.free(blocks)
    check(allocator)
    assert allocator.num_free == 8


def test_allocating_more_than_available_raises() -> None:
    allocator = BlockAllocator(4)
    allocator.allocate(3)
    with pytest.raises(CapacityExhausted, match="need 2 KV blocks, 1 available"):
        allocator.allocate(2)
    check(allocator)


def test_freed_hashed_blocks_are_cached_and_matched_again() -> None:
    allocator = BlockAllocator(8)
    hashes = block_hashes(list(range(8)), 4)
    blocks = allocator.allocate(2)
    for block, block_hash in zip(blocks, hashes, strict=True):
        allocator.register(block, block_hash)
    allocator.free(blocks)
    assert (allocator.num_cached, allocator.num_free) == (2, 6)
    check(allocator)
    assert allocator.match_prefix(hashes) == blocks
    assert allocator.num_used == 2
    check(allocator)


def test_shared_blocks_are_reference_counted() -> None:
    allocator = BlockAllocator(4)
    [block] = allocator.allocate(1)
    allocator.register(block, b"h" * 16)
    assert allocator.match_prefix([b"h" * 16]) == [block]
    allocator.free([block])
    assert allocator.num_used == 1
    allocator.free([block])
    assert allocator.num_cached == 1
    check(allocator)


def test_cached_blocks_are_evicted_oldest_first_with_events() -> None:
    events: list[tuple[str, bytes]] = []
    allocator = BlockAllocator(2, on_event=lambda kind, h: events.append((kind, h)))
    a, b = allocator.allocate(2)
    allocator.register(a, b"a" * 16)
    allocator.register(b, b"b" * 16)
    allocator.free([a])
    allocator.free([b])
    [taken] = allocator.allocate(1)
    assert taken == a
    assert events[-1] == ("removed", b"a" * 16)
    assert allocator.match_prefix([b"a" * 16]) == []
    check(allocator)


def test_match_stops_at_the_first_missing_block() -> None:
    allocator = BlockAllocator(4)
    hashes = block_hashes(list(range(12)), 4)
    blocks = allocator.allocate(3)
    allocator.register(blocks[0], hashes[0])
    allocator.register(blocks[2], hashes[2])
    assert allocator.peek_prefix(hashes) == 1
    assert allocator.match_prefix(hashes) == [blocks[0]]


def test_random_operations_keep_the_invariant() -> None:
    rng = random.Random(0)
    allocator = BlockAllocator(32)
    held: list[list[int]] = []
    for step in range(2000):
        action = rng.random()
        if action < 0.4 and allocator.num_available >= 3:
            blocks = allocator.allocate(rng.randint(1, 3))
            for block in blocks:
                if rng.random() < 0.5:
                    allocator.register(block, chain_hash(None, [step, block]))
            held.append(blocks)
        elif action < 0.6:
            hashes = [chain_hash(None, [rng.randrange(step + 1), rng.randrange(32)])]
            if matched := allocator.match_prefix(hashes):
                held.append(matched)
        elif held:
            allocator.free(held.pop(rng.randrange(len(held))))
        check(allocator)

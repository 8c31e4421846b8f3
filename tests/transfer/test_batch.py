"""Turning a caller's pieces into runs: grouping, coalescing, bounds, striping (no I/O)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from shared.messages import SegmentInfo
from transfer_engine.batch import (
    PieceArrays,
    Run,
    TransferPiece,
    check_ranges,
    coalesce,
    group,
    stripe,
)
from transfer_engine.errors import InvalidTransfer
from transfer_engine.segment import Segment


def arrays(*columns: list[int]) -> list[np.ndarray]:
    return [np.array(column, dtype=np.int64) for column in columns]


def test_contiguous_pieces_merge_and_empty_ones_vanish() -> None:
    local, remote, lengths = coalesce(*arrays([0, 10, 20, 100, 200], [5, 15, 25, 300, 400],
                                              [10, 10, 0, 10, 5]))
    assert (local.tolist(), remote.tolist(), lengths.tolist()) == (
        [0, 100, 200], [5, 300, 400], [20, 10, 5])


def test_pieces_contiguous_on_one_side_only_stay_apart() -> None:
    _, _, lengths = coalesce(*arrays([0, 10], [0, 50], [10, 10]))
    assert lengths.tolist() == [10, 10]


def test_pieces_group_by_segment_pair_in_order() -> None:
    groups = group([TransferPiece("a", 0, "x", 0, 1), ("b", 5, "x", 6, 2),
                    ("a", 1, "x", 1, 3)])
    assert [(g.local_segment, g.remote_segment, g.local_offsets.tolist()) for g in groups] == [
        ("a", "x", [0, 1]), ("b", "x", [5])]


def test_arrays_pass_through_untouched() -> None:
    pieces = PieceArrays("kv", "kv", *arrays([0], [0], [8]))
    assert group(pieces) == [pieces]


@pytest.mark.parametrize("batch", [
    [("kv", 0.5, "kv", 0, 8)],
    [("kv", 0, "kv", 0, 1 << 70)],
    [("kv", 0, "kv", 0)],
])
def test_malformed_pieces_are_refused(batch: list[tuple[object, ...]]) -> None:
    with pytest.raises(InvalidTransfer):
        group(batch)


@pytest.mark.parametrize("num_pieces", [1, 200])  # the short loop and the vectorized check
def test_out_of_range_pieces_are_named(num_pieces: int) -> None:
    offsets = np.zeros(num_pieces, dtype=np.int64)
    lengths = np.ones(num_pieces, dtype=np.int64)
    offsets[-1], lengths[-1] = 90, 20
    with pytest.raises(InvalidTransfer, match=r"piece \[90, 110\) is outside segment 'kv'"):
        check_ranges("kv", 100, offsets, lengths)


def test_a_sum_that_would_overflow_is_still_refused() -> None:
    offsets, lengths = arrays([1 << 62] * 20, [1 << 62] * 20)
    with pytest.raises(InvalidTransfer):
        check_ranges("kv", 1 << 20, offsets, lengths)


@pytest.mark.parametrize("seed", range(40))
def test_stripes_cover_every_byte_once_in_balanced_parts(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [rng.randint(1, 5000) for _ in range(rng.randint(1, 60))]
    local = np.cumsum([0, *lengths[:-1]])
    segment = Segment(name="kv", segment_id=1, data=memoryview(bytearray(1)))
    info = SegmentInfo(name="kv", segment_id=1, size_bytes=1 << 30)
    run = Run(segment, info, local, local + 7, np.array(lengths))
    num_parts = rng.randint(1, 6)
    parts = stripe([run], num_parts)
    pieces = sorted((int(a), int(b), int(c)) for part in parts for r in part
                    for a, b, c in zip(r.local_offsets, r.remote_offsets, r.lengths,
                                       strict=True))
    position = 0
    for local_offset, remote_offset, length in pieces:
        assert (local_offset, remote_offset) == (position, position + 7)
        position += length
    assert position == sum(lengths)
    target = -(-sum(lengths) // num_parts)
    assert len(parts) <= num_parts
    assert all(sum(r.num_bytes for r in part) <= target for part in parts)

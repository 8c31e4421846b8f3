from __future__ import annotations

from services.conductor.prefix_index import PrefixIndex
from shared.messages import KvBlockEvent, KvEventBatch


def h(name: str) -> bytes:
    return name.encode().ljust(16, b"-")


def batch(worker: str, *events: tuple[str, str], is_reset: bool = False) -> KvEventBatch:
    return KvEventBatch(worker_id=worker, block_size=16, is_reset=is_reset, events=[
        KvBlockEvent(kind=kind, block_hash=h(name).hex())  # type: ignore[arg-type]
        for kind, name in events])


def test_counts_leading_blocks_per_worker() -> None:
    index = PrefixIndex()
    index.apply(batch("a", ("stored", "h1"), ("stored", "h2"), ("stored", "h3")))
    index.apply(batch("b", ("stored", "h1")))
    assert index.leading_blocks([h("h1"), h("h2"), h("h3"), h("h4")], ["a", "b", "c"]) == {
        "a": 3, "b": 1, "c": 0}


def test_a_gap_ends_the_prefix() -> None:
    index = PrefixIndex()
    index.apply(batch("a", ("stored", "h1"), ("stored", "h3")))
    assert index.leading_blocks([h("h1"), h("h2"), h("h3")], ["a"]) == {"a": 1}


def test_removed_events_evict() -> None:
    index = PrefixIndex()
    index.apply(batch("a", ("stored", "h1"), ("stored", "h2"), ("removed", "h1")))
    assert index.leading_blocks([h("h1"), h("h2")], ["a"]) == {"a": 0}
    assert len(index) == 1


def test_reset_and_forget_drop_a_workers_blocks() -> None:
    index = PrefixIndex()
    index.apply(batch("a", ("stored", "h1")))
    index.apply(batch("b", ("stored", "h1")))
    index.apply(batch("a", is_reset=True))
    assert index.leading_blocks([h("h1")], ["a", "b"]) == {"a": 0, "b": 1}
    index.forget_worker("b")
    assert len(index) == 0


def test_memory_is_capped_least_recent_first() -> None:
    index = PrefixIndex(max_blocks=2)
    index.apply(batch("a", ("stored", "h1"), ("stored", "h2")))
    index.leading_blocks([h("h1")], ["a"])  # h1 is now the most recent
    index.apply(batch("a", ("stored", "h3")))
    assert len(index) == 2
    assert index.leading_blocks([h("h2")], ["a"]) == {"a": 0}
    assert index.leading_blocks([h("h1")], ["a"]) == {"a": 1}


def test_a_restored_snapshot_answers_as_the_original() -> None:
    index = PrefixIndex()
    index.apply(batch("a", ("stored", "h1"), ("stored", "h2"), ("stored", "h3")))
    index.apply(batch("b", ("stored", "h1"), ("stored", "h2")))
    index.apply(batch("a", ("removed", "h3")))
    snapshot = index.snapshot(stream_seq=3, taken_at_s=1.0)
    restored = PrefixIndex()
    restored.restore(snapshot)
    query = [h("h1"), h("h2"), h("h3")]
    assert restored.leading_blocks(query, ["a", "b"]) == index.leading_blocks(query, ["a", "b"])
    assert len(restored) == len(index) == 2
    restored.forget_worker("a")  # the per-worker side was restored too
    assert restored.leading_blocks(query, ["a", "b"]) == {"a": 0, "b": 2}


def test_a_snapshot_keeps_the_eviction_order_and_the_cap() -> None:
    index = PrefixIndex()
    index.apply(batch("a", ("stored", "old"), ("stored", "mid"), ("stored", "new")))
    restored = PrefixIndex(max_blocks=2)
    restored.restore(index.snapshot(stream_seq=1, taken_at_s=1.0))
    assert restored.leading_blocks([h("old")], ["a"]) == {"a": 0}  # least recent went first
    assert restored.leading_blocks([h("mid")], ["a"]) == {"a": 1}
    assert restored.leading_blocks([h("new")], ["a"]) == {"a": 1}

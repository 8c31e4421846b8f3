"""KV leases: holds for another party, renewed while it progresses, expiring when it does
not; every change an event, the live count and expirations in metrics."""

from __future__ import annotations

from services.kv_leases import LeaseTable
from shared.messages import KvLeaseEvent
from shared.metrics import WorkerMetrics

KINDS = ("decode_reservation", "prefix_fetch", "prefill_hold")


def table() -> tuple[LeaseTable, list[KvLeaseEvent], WorkerMetrics]:
    events: list[KvLeaseEvent] = []
    metrics = WorkerMetrics()
    return LeaseTable("decode-1", metrics, events.append), events, metrics


def sample(metrics: WorkerMetrics, name: str, kind: str) -> float:
    value = metrics.registry.get_sample_value(name, {"kind": kind})
    return 0.0 if value is None else value


def test_a_lease_renewed_by_its_party_outlives_its_first_expiry() -> None:
    leases, _, _ = table()
    lease = leases.grant("decode_reservation", "r", "prefill-1", 4, ttl_s=1.0)
    assert leases.renew("decode_reservation", "r", "prefill-1", ttl_s=100.0)
    assert leases.expired(KINDS, now=lease.granted_at + 50.0) == []


def test_only_the_party_it_is_held_for_renews_a_lease() -> None:
    leases, _, _ = table()
    lease = leases.grant("decode_reservation", "r", "prefill-1", 4, ttl_s=1.0)
    assert not leases.renew("decode_reservation", "r", "prefill-2", ttl_s=100.0)
    assert [x.request_id for x in leases.expired(KINDS, now=lease.granted_at + 2.0)] == ["r"]


def test_an_expired_lease_is_counted_published_and_gone() -> None:
    leases, events, metrics = table()
    lease = leases.grant("decode_reservation", "r", "prefill-1", 4, ttl_s=1.0)
    assert sample(metrics, "halfmoon_kv_leases", "decode_reservation") == 1
    (gone,) = leases.expired(KINDS, now=lease.granted_at + 1.5)
    assert (gone.num_blocks, len(leases)) == (4, 0)
    assert sample(metrics, "halfmoon_kv_lease_expirations_total", "decode_reservation") == 1
    assert sample(metrics, "halfmoon_kv_leases", "decode_reservation") == 0
    assert [(e.action, e.owner, e.party, e.num_blocks) for e in events] == [
        ("granted", "decode-1", "prefill-1", 4), ("expired", "decode-1", "prefill-1", 4)]


def test_a_released_lease_never_expires() -> None:
    leases, events, metrics = table()
    lease = leases.grant("prefix_fetch", "r", "prefill-2", 2, ttl_s=1.0, block_ids=[5, 6])
    assert leases.release("prefix_fetch", "r") is lease
    assert leases.expired(KINDS, now=lease.granted_at + 10.0) == []
    assert [e.action for e in events] == ["granted", "released"]
    assert sample(metrics, "halfmoon_kv_lease_expirations_total", "prefix_fetch") == 0


def test_granting_again_hands_the_lease_to_the_new_party() -> None:
    leases, events, _ = table()
    leases.grant("decode_reservation", "r", "prefill-1", 4, ttl_s=1.0)
    leases.grant("decode_reservation", "r", "prefill-2", 4, ttl_s=1.0)
    assert leases.renew("decode_reservation", "r", "prefill-2", ttl_s=1.0)
    assert [e.action for e in events] == ["granted"]  # one hold, re-pointed


def test_expiry_is_asked_for_by_kind() -> None:
    """A worker finishing one role's work while serving the other: each role frees the
    blocks of its own kinds of lease."""
    leases, _, _ = table()
    reservation = leases.grant("decode_reservation", "r", "prefill-1", 4, ttl_s=1.0)
    leases.grant("prefix_fetch", "s", "prefill-2", 2, ttl_s=1.0, block_ids=[5, 6])
    later = reservation.granted_at + 2.0
    assert [x.request_id for x in leases.expired(("prefix_fetch",), now=later)] == ["s"]
    assert leases.count(("decode_reservation",)) == 1 and leases.count(("prefix_fetch",)) == 0

"""KV leases: every hold of KV blocks on behalf of another party, as observable state.

A worker that keeps blocks for someone else (decode: a reservation a prefill worker will
write into; prefill: cached blocks a peer is reading, or blocks a peer is writing into) holds
them under a `Lease`: kind, owner (this worker), party, request id, block count and expiry.
While the party is alive and progressing it renews the lease (`KvLeaseRenewal`, every
heartbeat), so a request queued behind long prompts keeps its reservation; a lease whose
party went silent expires, its blocks are freed, and the log and a `KvLeaseEvent` say so.

Grants, releases and expiries are published on `Subjects.kv_lease_event` and counted in
`halfmoon_kv_leases{kind}` (held now) and `halfmoon_kv_lease_expirations_total{kind}`.
Pure bookkeeping: the caller frees the blocks of what `expired()` returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.messages import KvLeaseEvent, KvLeaseKind
from shared.metrics import WorkerMetrics


@dataclass
class Lease:
    kind: KvLeaseKind
    request_id: str
    party: str
    num_blocks: int
    granted_at: float  # monotonic
    expires_at: float
    block_ids: list[int] = field(default_factory=list)  # when the owner frees them itself


class LeaseTable:
    def __init__(self, owner: str, metrics: WorkerMetrics,
                 publish: Callable[[KvLeaseEvent], None]) -> None:
        self.owner = owner
        self._metrics = metrics
        self._publish = publish
        self._leases: dict[tuple[KvLeaseKind, str], Lease] = {}
        for kind in ("decode_reservation", "prefix_fetch", "prefill_hold"):
            metrics.kv_leases.labels(kind).set_function(
                lambda kind=kind: sum(lease.kind == kind for lease in self._leases.values()))

    def __len__(self) -> int:
        return len(self._leases)

    def count(self, kinds: tuple[KvLeaseKind, ...]) -> int:
        return sum(lease.kind in kinds for lease in self._leases.values())

    def get(self, kind: KvLeaseKind, request_id: str) -> Lease | None:
        return self._leases.get((kind, request_id))

    def grant(self, kind: KvLeaseKind, request_id: str, party: str, num_blocks: int,
              ttl_s: float, block_ids: list[int] | None = None) -> Lease:
        """Hold (or, when held already, hand over to `party` and renew)."""
        now = time.monotonic()
        lease = self._leases.get((kind, request_id))
        if lease is not None:
            lease.party, lease.expires_at = party, now + ttl_s
            return lease
        lease = Lease(kind, request_id, party, num_blocks, now, now + ttl_s,
                      list(block_ids or []))
        self._leases[(kind, request_id)] = lease
        self._event("granted", lease)
        return lease

    def renew(self, kind: KvLeaseKind, request_id: str, party: str, ttl_s: float) -> bool:
        """Extend the lease if `party` is the one it is held for; whether it was."""
        lease = self._leases.get((kind, request_id))
        if lease is None or lease.party != party:
            return False
        lease.expires_at = max(lease.expires_at, time.monotonic() + ttl_s)
        return True

    def release(self, kind: KvLeaseKind, request_id: str) -> Lease | None:
        """The hold ended as planned (committed, aborted, transfer done)."""
        lease = self._leases.pop((kind, request_id), None)
        if lease is not None:
            self._event("released", lease)
        return lease

    def expired(self, kinds: tuple[KvLeaseKind, ...], now: float | None = None,
                is_party_lost: Callable[[str], bool] | None = None) -> list[Lease]:
        """Leases of `kinds` past their expiry, or whose party is known to be gone,
        removed: the caller frees their blocks."""
        now = time.monotonic() if now is None else now
        gone = [lease for lease in self._leases.values() if lease.kind in kinds and (
            lease.expires_at <= now or (is_party_lost is not None and is_party_lost(lease.party)))]
        for lease in gone:
            del self._leases[(lease.kind, lease.request_id)]
            self._metrics.kv_lease_expirations.labels(lease.kind).inc()
            self._event("expired", lease)
        return gone

    def _event(self, action: str, lease: Lease) -> None:
        held_s = 0.0 if action == "granted" else time.monotonic() - lease.granted_at
        self._publish(KvLeaseEvent(
            action=action, kind=lease.kind, owner=self.owner,  # type: ignore[arg-type]
            party=lease.party, request_id=lease.request_id, num_blocks=lease.num_blocks,
            held_s=held_s, at_s=time.time()))

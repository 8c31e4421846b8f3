"""Every NATS subject, stream, consumer and bucket name. No literals elsewhere.

All names live under one cluster name, so several halfmoon clusters (or test runs) can share
one NATS server without seeing each other's traffic.
"""

from __future__ import annotations

import re

from shared.errors import ConfigError

_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")

SCHEMA_VERSION = "v1"


def check_token(value: str, what: str) -> str:
    """A subject token must be non-empty and free of `.`, `*`, `>` and whitespace."""
    if not _TOKEN.match(value):
        raise ConfigError(f"{what} {value!r} must match {_TOKEN.pattern}")
    return value


class Subjects:
    """Names for one cluster. Subjects look like `halfmoon.<cluster>.v1.<...>`."""

    def __init__(self, cluster: str) -> None:
        self.cluster = check_token(cluster, "cluster name")
        self._root = f"halfmoon.{cluster}.{SCHEMA_VERSION}"

    # JetStream request stream (work queue) and its durable conductor consumer.
    @property
    def requests(self) -> str:
        return f"{self._root}.requests"

    @property
    def requests_stream(self) -> str:
        return self._stream("REQUESTS")

    @property
    def conductor_consumer(self) -> str:
        return "conductor"

    # Core NATS, queue group `conductor_consumer`: any one conductor answers.
    @property
    def decode_replacement(self) -> str:
        return f"{self._root}.conductor.replace_decode"

    # Core NATS.
    def gateway(self, gateway_id: str) -> str:
        return f"{self._root}.gateway.{check_token(gateway_id, 'gateway id')}"

    def gateway_status(self, gateway_id: str) -> str:
        """Where the gateway answers `StreamQuery` and `OpenStreamsQuery` (request/reply)."""
        return f"{self.gateway(gateway_id)}.status"

    def heartbeat(self, role: str, worker_id: str) -> str:
        return f"{self._root}.heartbeat.{role}.{check_token(worker_id, 'worker id')}"

    def role_heartbeats(self, role: str) -> str:
        return f"{self._root}.heartbeat.{check_token(role, 'role')}.*"

    @property
    def all_heartbeats(self) -> str:
        return f"{self._root}.heartbeat.>"

    @property
    def abort(self) -> str:
        return f"{self._root}.abort"

    def prefill_task(self, worker_id: str) -> str:
        return self._worker(worker_id, "prefill")

    def decode_reserve(self, worker_id: str) -> str:
        return self._worker(worker_id, "reserve")

    def kv_target(self, worker_id: str) -> str:
        return self._worker(worker_id, "kv_target")

    def kv_commit(self, worker_id: str) -> str:
        return self._worker(worker_id, "kv_commit")

    def prefix_fetch(self, worker_id: str) -> str:
        return self._worker(worker_id, "prefix_fetch")

    def stream_resume(self, worker_id: str) -> str:
        return self._worker(worker_id, "resume")

    def kv_lease_renewal(self, worker_id: str) -> str:
        return self._worker(worker_id, "lease_renewal")

    def role_change(self, worker_id: str) -> str:
        return self._worker(worker_id, "role")

    def shed_load(self, worker_id: str) -> str:
        return self._worker(worker_id, "shed")

    def _worker(self, worker_id: str, verb: str) -> str:
        return f"{self._root}.worker.{check_token(worker_id, 'worker id')}.{verb}"

    # Public events (core NATS): request lifecycle for anyone on the bus.
    def request_event(self, kind: str) -> str:
        return f"{self._root}.events.request.{check_token(kind, 'event kind')}"

    @property
    def all_request_events(self) -> str:
        return f"{self._root}.events.request.>"

    def kv_lease_event(self, action: str) -> str:
        return f"{self._root}.events.kv_lease.{check_token(action, 'lease action')}"

    @property
    def all_kv_lease_events(self) -> str:
        return f"{self._root}.events.kv_lease.>"

    @property
    def all_events(self) -> str:
        return f"{self._root}.events.>"

    # JetStream stream of prefix-cache events (limits retention: replayable history).
    def kv_events(self, worker_id: str) -> str:
        return f"{self._root}.kv_events.{check_token(worker_id, 'worker id')}"

    @property
    def all_kv_events(self) -> str:
        return f"{self._root}.kv_events.>"

    @property
    def kv_events_stream(self) -> str:
        return self._stream("KV_EVENTS")

    def _stream(self, what: str) -> str:
        return f"HALFMOON_{self.cluster.upper().replace('-', '_')}_{what}"

    # NATS KV bucket: worker registry (latest heartbeat of each live worker).
    @property
    def workers_bucket(self) -> str:
        return f"halfmoon_{self.cluster.replace('-', '_')}_workers"

    # Object store: conductor state snapshots (the global prefix index).
    @property
    def snapshot_bucket(self) -> str:
        return f"halfmoon_{self.cluster.replace('-', '_')}_snapshots"

    @property
    def prefix_snapshot(self) -> str:
        return "prefix_index"

    # NATS KV bucket: the planner's lease (one conductor plans at a time).
    @property
    def planner_bucket(self) -> str:
        return f"halfmoon_{self.cluster.replace('-', '_')}_planner"

    @property
    def planner_lease(self) -> str:
        return "leader"

    # NATS KV bucket: stored Responses API responses (`StoredResponse`), by response id.
    @property
    def responses_bucket(self) -> str:
        return f"halfmoon_{self.cluster.replace('-', '_')}_responses"

    # NATS KV bucket: transfer-engine descriptors (`TransferEndpoint`), one per engine.
    @property
    def transfer_bucket(self) -> str:
        return f"halfmoon_{self.cluster.replace('-', '_')}_transfer"

"""Prometheus metrics: one registry per service instance, every name `halfmoon_*` with its unit.

The gateway serves them at `/metrics` on its API port; every other service on a small HTTP
port of its own (`--metrics-host`, `--metrics-port`; 0 picks a free port, which the service
logs). The README lists every metric.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

CONTENT_TYPE = CONTENT_TYPE_LATEST.split(";")[0]  # aiohttp takes the charset separately

# Latency buckets in seconds: milliseconds to a minute.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0)
# Bandwidth buckets in bytes/s: 10 MB/s to 100 GB/s.
BANDWIDTH_BUCKETS = (*(10.0 ** e * m for e in range(7, 11) for m in (1, 2.5, 5)), 1e11)


class ServiceMetrics:
    """What every service reports."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.nats_reconnects = Counter("halfmoon_nats_reconnects", "NATS reconnections",
                                       registry=r)
        self.nats_disconnects = Counter("halfmoon_nats_disconnects", "NATS disconnections",
                                        registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class GatewayMetrics(ServiceMetrics):
    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.requests = Counter("halfmoon_requests", "HTTP generation requests by route and "
                                "status", ["route", "status"], registry=r)
        self.requests_in_flight = Gauge("halfmoon_requests_in_flight",
                                        "generation requests being served", registry=r)
        self.ttft = Histogram("halfmoon_time_to_first_token_seconds", "time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("halfmoon_inter_token_latency_seconds",
                             "time between consecutive streamed tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("halfmoon_e2e_request_latency_seconds",
                             "request received to last token sent", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.prompt_tokens = Counter("halfmoon_prompt_tokens", "prompt tokens served",
                                     registry=r)
        self.cached_prompt_tokens = Counter(
            "halfmoon_prompt_cached_tokens", "prompt tokens the prefix cache served", registry=r)
        self.generation_tokens = Counter("halfmoon_generation_tokens", "tokens generated",
                                         registry=r)
        self.failovers = Counter("halfmoon_failovers", "requests placed again, as "
                                 "continuations, after a worker serving them was lost",
                                 registry=r)


class ConductorMetrics(ServiceMetrics):
    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.placements = Counter("halfmoon_placements", "requests placed, by policy, path "
                                  "(disaggregated | local) and whether a prefix is fetched",
                                  ["policy", "path", "prefix_fetch"], registry=r)
        self.rejections = Counter("halfmoon_rejections", "requests rejected, by reason",
                                  ["reason"], registry=r)
        self.deliveries_again = Counter("halfmoon_request_deliveries_again", "requests "
                                        "delivered to a conductor again, by what it did "
                                        "(held_here | place | place_unasked | done | drop "
                                        "| move | ask_later)", ["step"], registry=r)
        self.deliveries_lapsed = Counter(
            "halfmoon_request_deliveries_lapsed", "requests this conductor stopped placing: "
            "held past most of the ack wait (stopped, or its loop blocked), maybe delivered "
            "again", registry=r)
        self.room_waits = Counter("halfmoon_room_waits", "requests that waited in line for room "
                                  "(a healthy worker of a role, decode KV, a prefill queue)",
                                  registry=r)
        self.abandoned = Counter("halfmoon_requests_abandoned", "requests their gateway "
                                 "ended (the client gone) before they were placed: dropped",
                                 registry=r)
        self.room_waiting = Gauge("halfmoon_room_waiting_requests", "requests waiting in line "
                                    "for room now", registry=r)
        self.placement_seconds = Histogram("halfmoon_placement_seconds",
                                           "request taken (its delivery pulled) to its "
                                           "workers accepted, waits in line included",
                                           buckets=LATENCY_BUCKETS, registry=r)
        self.workers = Gauge("halfmoon_workers_healthy", "healthy workers by role", ["role"],
                             registry=r)
        self.prefix_index_blocks = Gauge("halfmoon_prefix_index_blocks",
                                         "block hashes in the global prefix index", registry=r)
        self.planner_leader = Gauge("halfmoon_planner_leader", "1 while this conductor holds "
                                    "the planner's lease", registry=r)
        self.planner_moves = Counter("halfmoon_planner_moves", "role changes the planner "
                                     "asked for, by new role and outcome (done | refused | "
                                     "failed)", ["to_role", "outcome"], registry=r)
        self.planner_sheds = Counter("halfmoon_planner_sheds", "decode workers the planner "
                                     "told to shed load, by outcome (done | refused | "
                                     "failed)", ["outcome"], registry=r)
        self.planner_pressure = Gauge("halfmoon_planner_pressure", "each role's load as a "
                                      "share of its SLO, as the planner last saw it",
                                      ["model", "role"], registry=r)


class CounterAtScrape:
    """A counter whose value something else keeps (the engine's stats), read at scrape."""

    def __init__(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        self.name, self.documentation, self.read = name, documentation, read

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.name, self.documentation, value=self.read())


class WorkerMetrics(ServiceMetrics):
    """Prefill and decode workers."""

    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.running = Gauge("halfmoon_requests_running", "requests in the engine's batch",
                             registry=r)
        self.waiting = Gauge("halfmoon_requests_waiting", "requests queued", registry=r)
        self.kv_blocks_used = Gauge("halfmoon_kv_blocks_used", "KV blocks in use (not free "
                                    "and not evictable cache)", registry=r)
        self.kv_blocks_free = Gauge("halfmoon_kv_blocks_free", "KV blocks free or evictable",
                                    registry=r)
        self.busy_seconds = Gauge("halfmoon_engine_busy_seconds", "wall seconds the engine's "
                                  "device spent in model steps since start (utilization: its "
                                  "rate)", registry=r)
        self.kv_leases = Gauge("halfmoon_kv_leases", "KV block holds on behalf of another "
                               "party, by kind", ["kind"], registry=r)
        self.kv_lease_expirations = Counter("halfmoon_kv_lease_expirations", "KV leases that "
                                            "expired (their party went silent), by kind",
                                            ["kind"], registry=r)
        self.orphaned_streams = Counter("halfmoon_orphaned_streams", "requests a decode "
                                        "worker stopped because no client waited for them "
                                        "any more (an abort lost, the gateway gone, the rest "
                                        "placed elsewhere)", registry=r)
        self.kv_transfer_bytes = Counter("halfmoon_kv_transfer_bytes", "KV bytes moved, by "
                                         "transport", ["transport"], registry=r)
        self.kv_transfer_seconds = Histogram("halfmoon_kv_transfer_seconds",
                                             "one KV transfer, first byte to last landed",
                                             ["transport"], buckets=LATENCY_BUCKETS,
                                             registry=r)
        self.kv_transfer_bandwidth = Histogram("halfmoon_kv_transfer_bandwidth_bytes_per_second",
                                               "one KV transfer's bytes over its seconds",
                                               ["transport"], buckets=BANDWIDTH_BUCKETS,
                                               registry=r)

    def observe_transfer(self, transport: str, num_bytes: int, seconds: float) -> None:
        self.kv_transfer_bytes.labels(transport).inc(num_bytes)
        self.kv_transfer_seconds.labels(transport).observe(seconds)
        if seconds > 0:
            self.kv_transfer_bandwidth.labels(transport).observe(num_bytes / seconds)


class PrefillMetrics(WorkerMetrics):
    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.queue_time = Histogram("halfmoon_queue_time_seconds",
                                    "prefill task accepted to its first token computed, less "
                                    "compute: the wait for the engine", buckets=LATENCY_BUCKETS,
                                    registry=r)
        self.prefill_seconds = Histogram("halfmoon_prefill_seconds",
                                         "prefill task accepted to first token",
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("halfmoon_prefill_prompt_tokens", "prompt tokens prefilled "
                                     "(cached or computed)", registry=r)
        self.cached_tokens = Counter("halfmoon_prefill_cached_tokens", "prompt tokens found in "
                                     "the prefix cache", registry=r)
        self.hit_ratio = Gauge("halfmoon_prefix_cache_hit_ratio", "cached over prompt tokens "
                               "since start", registry=r)
        self.prefix_fetches = Counter("halfmoon_prefix_fetches", "prefix fetches from other "
                                      "prefill workers, by outcome", ["outcome"], registry=r)
        self._num_prompt = self._num_cached = 0

    def observe_prompt(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)
        self.cached_tokens.inc(num_cached_tokens)
        self._num_prompt += num_prompt_tokens
        self._num_cached += num_cached_tokens
        self.hit_ratio.set(self._num_cached / self._num_prompt if self._num_prompt else 0.0)


class DecodeMetrics(WorkerMetrics):
    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.step_seconds = Histogram("halfmoon_decode_step_seconds", "one decode step",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.generated_tokens = Counter("halfmoon_decode_tokens", "tokens decoded", registry=r)
        self.kv_commits = Counter("halfmoon_kv_commits", "requests joined, by how their KV "
                                  "came (shm | tcp | rdma | local | none)", ["transport"],
                                  registry=r)
        self.shed_requests = Counter("halfmoon_decode_shed_requests", "running requests "
                                     "handed back to be placed again (`ShedLoad`)", registry=r)


class ElasticWorkerMetrics(PrefillMetrics, DecodeMetrics):
    """A worker's: both roles' metrics, since a worker may change roles (`RoleChange`)."""

    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.role_changes = Counter("halfmoon_role_changes", "role changes of this worker, by "
                                    "the role left and the role taken", ["from_role", "to_role"],
                                    registry=r)
        self.model_changes = Counter("halfmoon_model_changes", "model switches of this "
                                     "worker, by the model left and the model taken",
                                     ["from_model", "to_model"], registry=r)
        self.role = Gauge("halfmoon_worker_role", "1 for the role this worker serves now",
                          ["role"], registry=r)

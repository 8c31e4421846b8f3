"""Predicted TTFT and TBT, the seed's weighted score, and SLO admission: pure functions.

Mooncake's estimate: TTFT = T_load + T_transfer + T_queue + T_prefill(prompt, cached prefix),
T_load the measured time to load the model on a worker that must load it first. Each
worker fits its prefill cost from measured steps, T(n) = overhead + s_per_token * n
(`engine/step_cost.py`), and reports it with its queued prompt tokens in every heartbeat; so
    T_queue   = s_per_token * queued tokens
    T_prefill = overhead + s_per_token * uncached prompt tokens
    T_transfer = the time to fetch a cached prefix from another worker, when one is fetched.
Without a fit it falls back to the measured rate, then to `default_tokens_per_s`.
TBT, for decode, the same way: each worker fits its decode step, T(b) = overhead +
s_per_sequence * b over the batches it ran, and a request's TBT is T(running + 1).

Prefix reuse across workers (the seed's reuse benefit): fetching a prefix another worker
holds saves computing its tokens and costs moving its KV,
    benefit = s_per_token x prefix tokens - (overhead + KV bytes / transfer bytes per s)
and the chosen worker fetches when the benefit is positive.

The seed's score over healthy prefill workers, each term in [0, 1]:
    0.3 (1 - load) + 0.2 (1 - queue / max_queue) + 0.2 compute + 0.15 network + 0.15 model
with compute relative to the fastest candidate, network 1 in the decode worker's zone (0.5
elsewhere), model 1 where the request's model is loaded (0 on a worker that must load it
from its disk, `model_loads`). A cached prompt prefix counts in the TTFT estimate instead.

The "seed" policy combines them as cost = predicted TTFT x (2 - score): the estimate decides,
and the score stretches it by up to 2x for a worker that is busy, slow, far or cold, which
breaks near-ties towards the healthier choice.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.errors import SloViolation
from shared.messages import WorkerHeartbeat

SEED_WEIGHTS = {"load": 0.3, "queue": 0.2, "compute": 0.2, "network": 0.15, "model": 0.15}
_W_LOAD, _W_QUEUE, _W_COMPUTE, _W_NETWORK, _W_MODEL = SEED_WEIGHTS.values()


@dataclass(frozen=True)
class Slo:
    ttft_s: float | None = None
    tbt_s: float | None = None


def predicted_ttft_s(worker: WorkerHeartbeat, uncached_tokens: int,
                     default_tokens_per_s: float, transfer_s: float = 0.0,
                     load_s: float = 0.0, priority: int | None = None) -> float:
    """With `priority`, the queue is what waits ahead of a request of that priority (its
    own and the more urgent; all of it where the worker does not say)."""
    tokens = queued_tokens(worker, priority) + uncached_tokens
    if worker.prefill_s_per_token > 0.0:
        compute_s = worker.prefill_overhead_s + worker.prefill_s_per_token * tokens
    else:
        compute_s = tokens / (worker.prefill_tokens_per_s or default_tokens_per_s)
    return load_s + transfer_s + compute_s


def queued_tokens(worker: WorkerHeartbeat, priority: int | None = None) -> int:
    """The prompt tokens a request of `priority` (None: any) waits behind on the worker."""
    by_priority = worker.num_waiting_tokens_by_priority
    if priority is None or not by_priority:
        return worker.num_waiting_tokens
    return sum(tokens for waiting, tokens in by_priority.items() if waiting <= priority)


@dataclass(frozen=True)
class TransferCost:
    """What moving KV between prefill workers costs: a fixed overhead (a NATS round trip,
    the transfer's set-up) plus bytes over the link's rate."""

    bytes_per_s: float = 2e9
    overhead_s: float = 0.002

    def seconds(self, num_bytes: int) -> float:
        return self.overhead_s + num_bytes / self.bytes_per_s


def reuse_benefit_s(worker: WorkerHeartbeat, num_tokens: int, num_bytes: int,
                    transfer: TransferCost, default_tokens_per_s: float) -> float:
    """Seconds `worker` saves by fetching `num_tokens` of cached prefix (`num_bytes` of KV)
    instead of computing them; negative when moving them costs more."""
    if worker.prefill_s_per_token > 0.0:
        s_per_token = worker.prefill_s_per_token
    else:
        s_per_token = 1.0 / (worker.prefill_tokens_per_s or default_tokens_per_s)
    return s_per_token * num_tokens - transfer.seconds(num_bytes)


def predicted_tbt_s(worker: WorkerHeartbeat, extra_requests: int = 1) -> float:
    """A decode step's time once this request joins: the worker's fitted step cost at
    that batch. From a worker without the fit, the measured step time grown in proportion
    to the batch (a conservative, memory-bound-free assumption)."""
    fitted = worker.fitted_decode_step_s(worker.num_running + extra_requests)
    if fitted is not None:
        return fitted
    if worker.decode_step_s == 0.0:
        return 0.0
    running = max(1, worker.num_running)
    return worker.decode_step_s * (running + extra_requests) / running


def decode_step_now_s(worker: WorkerHeartbeat) -> float:
    """A decode step's time at the batch the worker runs now: its fit there (none when
    idle: the steps it last ran, at another batch, are no load now); from a worker without
    the fit, the last steps' measured time."""
    fitted = worker.fitted_decode_step_s(worker.num_running)
    if fitted is None:
        return worker.decode_step_s
    return fitted if worker.num_running else 0.0


def seed_score(worker: WorkerHeartbeat, *, load: float, max_queue: int, fastest: float,
               decode_zone: str, is_model_loaded: bool = True) -> float:
    # Plain arithmetic: this runs for every candidate of every request.
    return (_W_LOAD * (1.0 - min(1.0, load))
            + _W_QUEUE * (1.0 - min(1.0, worker.num_waiting / max(1, max_queue)))
            + _W_COMPUTE * (worker.compute_score / fastest if fastest > 0 else 1.0)
            + _W_NETWORK * (1.0 if worker.zone == decode_zone else 0.5)
            + (_W_MODEL if is_model_loaded else 0.0))


def check_slo(ttft_s: float, tbt_s: float, slo: Slo) -> None:
    """Reject early (429) when the best placement's prediction breaks an SLO."""
    if slo.ttft_s is not None and ttft_s > slo.ttft_s:
        raise SloViolation(f"predicted TTFT {ttft_s * 1000:.0f} ms exceeds the SLO of "
                           f"{slo.ttft_s * 1000:.0f} ms", role="prefill",
                           retry_after_s=max(1.0, ttft_s - slo.ttft_s))
    if slo.tbt_s is not None and tbt_s > slo.tbt_s:
        raise SloViolation(f"predicted time between tokens {tbt_s * 1000:.0f} ms exceeds the "
                           f"SLO of {slo.tbt_s * 1000:.0f} ms", role="decode", retry_after_s=1.0)

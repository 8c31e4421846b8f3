"""The planner's policy: which worker should change roles, from the cluster's measured load
against the SLOs. Pure (heartbeats and a clock in, at most one decision's moves out);
`planning.py` runs it in the conductor that holds the planner's lease.

Pressure of a role, 1.0 = at its SLO, each worker's from its heartbeat, averaged per role:
    prefill  the predicted TTFT of a new request there (its queued prompt tokens on its
             fitted prefill cost, as placement predicts it) over `--ttft-slo-ms`
    decode   the largest of its decode step at the batch it runs now (its fitted cost; none
             when idle) over `--tbt-slo-ms`, the used share of
             its KV pool and its batch's occupancy (requests running, over its batch size):
             a pool or a batch filling up are the other ways decode runs out. Reservations
             waiting for their prefill are not counted as load (they are a prefill backlog,
             which would otherwise stop prefill from borrowing a decode worker); their KV is
             in the used share.
A role whose requests admission rejected for its SLO in the last two intervals (TTFT:
prefill, time between tokens: decode) is at least at its SLO (1.0): admission keeps the
queues short exactly when a role lacks workers, so its measured pressure alone would stay
under the high mark while requests are turned away.
Workers move from the role with room to the more pressed role when that stayed so for
`hold_s`: over the high mark, as many as bring its pressure to the middle of the marks (its
load spread over more workers); above the low mark, while it would still be the more pressed
of the two after the move (balancing: the move cannot flip back). Either way only as far as
the giving role stays below `high` with the workers fewer (else the move would only move the
problem). Balancing weighs compute: decode's step time and batch, not its KV pool (a pool
60 % full slows nothing; on the Mooncake trace a lone decode worker of long contexts so full
took a worker from a prefill role that needed it, and gave it back seconds later). Over the
high mark, a filling pool counts in full.
`high` is a share of the SLO below 1: the planner acts before admission starts rejecting.
Sizing a move at once, rather than a worker a cooldown apart, and balancing below
the high mark matter for a load that changes faster than the cooldown: on the Mooncake trace
the planner that moved one worker only over the high mark reached its split after most of
the bursts that needed it, and at 2x the trace's rate sometimes never moved.
A worker serving outside its home role (the one it started in, in its heartbeat) goes home
once both pressures stayed below `low` for `home_after_s`, much longer than `hold_s`, and its
role would stay below `low` without it: a bursty load is calm between its bursts, and a
worker sent home then is only borrowed again at the next one. A pressed role takes back a
worker whose home it is first. Never the last worker of a role; one decision at a time, at
least `cooldown_s` apart (the moved workers' next heartbeats show the new split). Workers of
each model are planned on their own first; when a model's higher pressure stays above `high`
and no role move of its own relieves it, a worker of a model whose pressures both stayed
below `low` is reassigned to it (a worker with that model on its disk, `models_on_disk`,
from a role the calm model keeps a worker in): a (role, model) move, which reloads the
worker.
After a move a role's new workers start empty while the old ones keep what they hold: a
decode worker that runs more requests than its batch size (each waits its turns) while the
model's other decode workers have batch room is told to shed (`ShedLoad`) down to the role's
average, as far as the others have room: those requests are placed again, their KV
recomputed from the prompt and the tokens so far (prefill must have room below `high`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass

from services.conductor.cost_model import decode_step_now_s, predicted_ttft_s
from shared.messages import WorkerHeartbeat, WorkerRole


@dataclass(frozen=True)
class PlannerRules:
    ttft_slo_s: float | None
    tbt_slo_s: float | None
    high: float = 0.8
    low: float = 0.3
    hold_s: float = 2.0
    cooldown_s: float = 5.0
    home_after_s: float = 60.0
    default_tokens_per_s: float = 2000.0


@dataclass(frozen=True)
class Split:
    """One model's workers by role, and each role's pressure (1.0: at its SLO)."""

    model: str
    prefill: list[WorkerHeartbeat]
    decode: list[WorkerHeartbeat]
    prefill_pressure: float
    decode_pressure: float
    decode_compute_pressure: float  # its step's and batch's shares, not its pool's


@dataclass(frozen=True)
class Move:
    """Serve `to_role` (of `to_model`, when set: a worker of `split.model` reassigned)."""

    worker_id: str
    from_role: WorkerRole
    to_role: WorkerRole
    reason: str
    split: Split  # what the decision was made on (the giving model's, for a model move)
    to_model: str = ""


@dataclass(frozen=True)
class Shed:
    """Hand `num_requests` of a decode worker's running requests back to be placed again."""

    worker_id: str
    num_requests: int
    reason: str
    split: Split


def prefill_pressure(worker: WorkerHeartbeat, rules: PlannerRules) -> float:
    if rules.ttft_slo_s is None:
        return 0.0
    return predicted_ttft_s(worker, 0, rules.default_tokens_per_s) / rules.ttft_slo_s


def decode_pressure(worker: WorkerHeartbeat, rules: PlannerRules) -> float:
    return max(decode_compute_pressure(worker, rules), kv_used_share(worker))


def decode_compute_pressure(worker: WorkerHeartbeat, rules: PlannerRules) -> float:
    step = decode_step_now_s(worker) / rules.tbt_slo_s if rules.tbt_slo_s else 0.0
    # Running sequences only: a decode worker's waiting requests are reservations whose
    # prefill is queued (a prefill backlog, not decode load; their KV counts in the pool).
    return max(step, worker.num_running / max(1, worker.max_batch_size))


def kv_used_share(worker: WorkerHeartbeat) -> float:
    if not worker.num_total_blocks:
        return 0.0
    return 1.0 - worker.num_free_blocks / worker.num_total_blocks


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


class SloRejections:
    """When admission last rejected a request of each (model, role) for that role's SLO."""

    def __init__(self) -> None:
        self._last_s: dict[tuple[str, str], float] = {}

    def note(self, model: str, role: str, now_s: float) -> None:
        self._last_s[(model, role)] = now_s

    def within(self, now_s: float, window_s: float) -> set[tuple[str, str]]:
        return {key for key, at_s in self._last_s.items() if now_s - at_s <= window_s}


def splits(workers: list[WorkerHeartbeat], rules: PlannerRules,
           rejected: Collection[tuple[str, str]] = ()) -> list[Split]:
    """Healthy workers by model, in model order; a (model, role) in `rejected` is at least
    at its SLO."""
    by_model: dict[str, list[WorkerHeartbeat]] = defaultdict(list)
    for worker in workers:
        by_model[worker.model].append(worker)
    found = []
    for model in sorted(by_model):
        prefill = [w for w in by_model[model] if w.role == "prefill"]
        decode = [w for w in by_model[model] if w.role == "decode"]
        decode_floor = 1.0 if (model, "decode") in rejected else 0.0
        found.append(Split(
            model, prefill, decode,
            prefill_pressure=max(_mean([prefill_pressure(w, rules) for w in prefill]),
                                 1.0 if (model, "prefill") in rejected else 0.0),
            decode_pressure=max(_mean([decode_pressure(w, rules) for w in decode]),
                                decode_floor),
            decode_compute_pressure=max(
                _mean([decode_compute_pressure(w, rules) for w in decode]), decode_floor)))
    return found


class Planner:
    """The policy with its memory of time: since when each pressure held, when the last
    move was. Losing it (a new lease holder) only restarts those clocks."""

    def __init__(self, rules: PlannerRules) -> None:
        self.rules = rules
        self._since: dict[tuple[str, str], float] = {}  # (model, condition) -> first seen
        self._last_move_s = float("-inf")

    def decide(self, workers: list[WorkerHeartbeat], now_s: float,
               rejected: Collection[tuple[str, str]] = ()) -> list[Move]:
        """One decision over every model: the moves of one role change within a model
        first, else a worker of a calm model reassigned to a model under pressure; none
        (empty) most of the time. `rejected`: the (model, role)s admission turned requests
        away for lately."""
        return self.decide_on(splits(workers, self.rules, rejected), now_s)

    def decide_on(self, found: list[Split], now_s: float) -> list[Move]:
        """`decide`, on splits already made (`splits`)."""
        reassignment = self._reassign(found, now_s)  # its clocks run every time
        decisions = [self._decide(split, now_s) for split in found]
        moves = next((d for d in decisions if d), [reassignment] if reassignment else [])
        if not moves or now_s - self._last_move_s < self.rules.cooldown_s:
            return []
        self._last_move_s = now_s
        self._since.clear()  # the next decision waits for the new split's own evidence
        return moves

    def _decide(self, split: Split, now_s: float) -> list[Move]:
        rules, p, d = self.rules, split.prefill_pressure, split.decode_pressure
        n_p, n_d = len(split.prefill), len(split.decode)
        if not n_p or not n_d:
            return []  # a role without workers: nothing to balance against
        # Prefill's pressure is all compute; decode's balances without its pool.
        d_compute = split.decode_compute_pressure
        to_prefill = self._spared(p, p, n_p, d, d_compute, n_d)
        if self._held(split.model, "prefill pressed", to_prefill > 0, now_s):
            # Borrowed prefill workers first, then those holding least: they drain soonest
            # (reservations wait for their prefill).
            movers = sorted(split.decode, key=lambda w: (w.home_role != "prefill",
                                                         w.num_running + w.num_waiting,
                                                         w.worker_id))[:to_prefill]
            return [Move(w.worker_id, "decode", "prefill",
                         f"prefill pressure {p:.2f} of its SLO, decode {d:.2f}", split)
                    for w in movers]
        to_decode = self._spared(d, d_compute, n_d, p, p, n_p) if not to_prefill else 0
        if self._held(split.model, "decode pressed", to_decode > 0, now_s):
            movers = sorted(split.prefill, key=lambda w: (w.home_role != "decode",
                                                          w.num_waiting_tokens,
                                                          w.worker_id))[:to_decode]
            return [Move(w.worker_id, "prefill", "decode",
                         f"decode pressure {d:.2f} of its SLO, prefill {p:.2f}", split)
                    for w in movers]
        if self._held(split.model, "calm", p < rules.low and d < rules.low, now_s,
                      rules.home_after_s):
            return [move] if (move := _homecoming(split, rules)) else []
        return []

    def _spared(self, pressure: float, compute: float, num_workers: int,
                giving_pressure: float, giving_compute: float, num_giving: int) -> int:
        """Workers to move to a role at `pressure` (`compute`: its compute part) over
        `num_workers` from one at `giving_pressure` (`giving_compute`) over `num_giving`:
        over the high mark, enough to bring it to the middle of the marks; with its compute
        above the low mark, while that would still be the higher of the two after the move.
        As many as the giving role spares while it keeps a worker and stays below the high
        mark."""
        rules = self.rules
        if pressure <= rules.low:
            return 0
        middle = (rules.high + rules.low) / 2
        count = 0
        while num_giving - count > 1:
            fewer = num_giving / (num_giving - count - 1)
            more = num_workers / (num_workers + count + 1)
            still_over = pressure > rules.high \
                and pressure * num_workers / (num_workers + count) > middle
            still_more_pressed = compute > rules.low \
                and compute * more > giving_compute * fewer
            if giving_pressure * fewer >= rules.high or not (still_over or still_more_pressed):
                break
            count += 1
        return count

    def _reassign(self, found: list[Split], now_s: float) -> Move | None:
        """A worker of a model whose both pressures stayed below `low`, with the needy
        model on its disk, for the model whose higher pressure stayed above `high`."""
        rules = self.rules
        over = [s for s in found if self._held(s.model, "model over", _peak(s) > rules.high,
                                               now_s)]
        calm = [s for s in found if self._held(s.model, "model calm", _peak(s) < rules.low,
                                               now_s)]
        for needy in sorted(over, key=lambda s: (-_peak(s), s.model)):
            to_role: WorkerRole = ("prefill" if needy.prefill_pressure >= needy.decode_pressure
                                   else "decode")
            for donor in calm:
                worker = _spare_worker(donor, needy.model, rules)
                if worker is not None:
                    return Move(worker.worker_id, worker.role, to_role,
                                f"model {needy.model} {to_role} pressure {_peak(needy):.2f} of "
                                f"its SLO; {donor.model} at {_peak(donor):.2f}", donor,
                                to_model=needy.model)
        return None

    def sheds(self, found: list[Split], now_s: float) -> list[Shed]:
        """Decode workers to shed load (`shed_load`), once that stayed so for `hold_s`;
        the clock starts over after each shed (the next waits for heartbeats after it)."""
        found_sheds = []
        for split in found:
            shed = shed_load(split, self.rules)
            if self._held(split.model, "decode oversubscribed", shed is not None, now_s) \
                    and shed is not None:
                self._since.pop((split.model, "decode oversubscribed"), None)
                found_sheds.append(shed)
        return found_sheds

    def _held(self, model: str, condition: str, is_true: bool, now_s: float,
              hold_s: float | None = None) -> bool:
        """`is_true` has held for `hold_s` (the rules' by default; a condition that lapses
        starts over)."""
        key = (model, condition)
        if not is_true:
            self._since.pop(key, None)
            return False
        hold_s = self.rules.hold_s if hold_s is None else hold_s
        return now_s - self._since.setdefault(key, now_s) >= hold_s


def shed_load(split: Split, rules: PlannerRules) -> Shed | None:
    """The decode worker running the most requests past its batch size, to shed down to
    the role's average as far as the others have batch room; None when none runs past its
    batch, none has room, or prefill (which recomputes what is shed) is at `high`."""
    decode = [w for w in split.decode if not w.is_draining]
    if len(decode) < 2 or split.prefill_pressure >= rules.high:
        return None
    busiest = max(decode, key=lambda w: (w.num_running, w.worker_id))
    if busiest.num_running <= busiest.max_batch_size:
        return None
    average = -(-sum(w.num_running for w in decode) // len(decode))
    room = sum(max(0, w.max_batch_size - w.num_running - w.num_waiting)
               for w in decode if w is not busiest)
    count = min(busiest.num_running - average, room)
    if count <= 0:
        return None
    return Shed(busiest.worker_id, count,
                f"runs {busiest.num_running} requests on a batch of "
                f"{busiest.max_batch_size}; decode averages {average}", split)


def _peak(split: Split) -> float:
    return max(split.prefill_pressure, split.decode_pressure)


def _spare_worker(donor: Split, model: str, rules: PlannerRules) -> WorkerHeartbeat | None:
    """The least busy worker of `donor` that has `model` on disk, from a role that keeps a
    worker and stays below `high` without it."""
    for role_workers, pressure in ((donor.decode, donor.decode_pressure),
                                   (donor.prefill, donor.prefill_pressure)):
        n = len(role_workers)
        if n < 2 or pressure * n / (n - 1) >= rules.high:
            continue
        able = [w for w in role_workers if model in w.models_on_disk]
        if able:
            return min(able, key=lambda w: (w.num_running + w.num_waiting, w.worker_id))
    return None


def _homecoming(split: Split, rules: PlannerRules) -> Move | None:
    """A worker serving away from its home role goes back, unless it is its role's last or
    the role would rise over the low mark without it (and borrow it again)."""
    for role_workers, pressure in ((split.prefill, split.prefill_pressure),
                                   (split.decode, split.decode_pressure)):
        n = len(role_workers)
        if n < 2 or pressure * n / (n - 1) >= rules.low:
            continue
        for worker in sorted(role_workers, key=lambda w: w.worker_id):
            if worker.home_role is not None and worker.home_role != worker.role:
                return Move(worker.worker_id, worker.role, worker.home_role,
                            "load back under the low mark", split)
    return None

"""What `halfmoon bench serve` sends: a list of requests, with arrival times for open loop.

Four sources:
  - synthetic (open loop): arrivals at `rate` per second, inter-arrival gaps drawn from a
    gamma distribution of shape `burstiness` (1: Poisson; below 1: burstier, above: more
    even); prompt and output lengths uniform within `range_ratio` of their means;
  - synthetic (closed loop): the same prompts, no arrival times; `concurrency` clients each
    send the next request when their last one ends;
  - phases (open or closed loop): synthetic stretches of other lengths one after another
    (`--phase 2048:32:200 --phase 256:512:200`), the mix changing mid-run;
  - a Mooncake trace (`bench/trace.py`): its arrivals and lengths, scaled; prompts made from
    its hash ids, so requests sharing blocks in the trace share tokens here.
Prompts are token ids (every OpenAI-compatible `/v1/completions` accepts them), drawn from
1..255 so that any vocabulary, byte-level ones included, holds them. All seeded.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from bench.trace import TraceScaling, load_trace


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float | None = None  # from the start of the run; None: closed loop
    model: str | None = None  # None: the client's model


@dataclass(frozen=True)
class SyntheticSpec:
    num_requests: int
    input_len: int
    output_len: int
    range_ratio: float = 0.0  # lengths uniform in mean x [1 - r, 1 + r]
    rate: float | None = None  # requests/s; None: closed loop
    burstiness: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("num_requests, input_len and output_len must be >= 1")
        if not 0 <= self.range_ratio < 1:
            raise ValueError("range_ratio must be in [0, 1)")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("rate must be > 0")
        if self.burstiness <= 0:
            raise ValueError("burstiness must be > 0")


def _length(rng: random.Random, mean: int, range_ratio: float) -> int:
    low = max(1, round(mean * (1 - range_ratio)))
    return rng.randint(low, max(low, round(mean * (1 + range_ratio))))


def arrival_times(num: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Gamma-distributed gaps of mean 1 / rate; the first request arrives at 0."""
    times, at = [], 0.0
    for _ in range(num):
        times.append(at)
        at += rng.gammavariate(burstiness, 1 / (rate * burstiness))
    return times


def synthetic(spec: SyntheticSpec) -> list[BenchRequest]:
    rng = random.Random(spec.seed)
    arrivals: list[float | None] = [None] * spec.num_requests
    if spec.rate is not None:
        arrivals = list(arrival_times(spec.num_requests, spec.rate, spec.burstiness, rng))
    requests = []
    for arrival_s in arrivals:
        num_prompt = _length(rng, spec.input_len, spec.range_ratio)
        requests.append(BenchRequest(
            prompt_token_ids=[rng.randint(1, 255) for _ in range(num_prompt)],
            max_tokens=_length(rng, spec.output_len, spec.range_ratio), arrival_s=arrival_s))
    return requests


@dataclass(frozen=True)
class Phase:
    """One stretch of a phased workload: `num_requests` of these mean lengths."""

    input_len: int
    output_len: int
    num_requests: int
    model: str | None = None  # its requests' model (None: the client's)

    @classmethod
    def parse(cls, text: str) -> Phase:
        """`INPUT:OUTPUT:NUM[:MODEL]`, e.g. `2048:32:200` or `512:128:200:qwen-2.5-7b-h200`."""
        parts = text.split(":", 3)
        try:
            input_len, output_len, num = (int(part) for part in parts[:3])
        except ValueError as exc:
            raise ValueError("a phase is INPUT:OUTPUT:NUM[:MODEL] (e.g. 2048:32:200), not "
                             f"{text!r}") from exc
        return cls(input_len, output_len, num, parts[3] if len(parts) > 3 else None)


def phased(phases: list[Phase], spec: SyntheticSpec) -> list[BenchRequest]:
    """Synthetic phases one after another at `spec`'s rate (its lengths replaced by each
    phase's): the mix changes mid-run, as a day's load does."""
    requests: list[BenchRequest] = []
    start_s = 0.0
    for index, phase in enumerate(phases):
        part = synthetic(SyntheticSpec(
            num_requests=phase.num_requests, input_len=phase.input_len,
            output_len=phase.output_len, range_ratio=spec.range_ratio, rate=spec.rate,
            burstiness=spec.burstiness, seed=spec.seed + index))
        requests += [BenchRequest(r.prompt_token_ids, r.max_tokens,
                                  None if r.arrival_s is None else start_s + r.arrival_s,
                                  model=phase.model)
                     for r in part]
        if spec.rate is not None:
            start_s += phase.num_requests / spec.rate
    return requests


def from_trace(path: Path, scaling: TraceScaling, *, limit: int | None = None,
               max_total_len: int | None = None) -> list[BenchRequest]:
    """The trace's requests, scaled; those whose prompt + output exceeds `max_total_len` are
    left out (the server would refuse them)."""
    return [BenchRequest(r.prompt_token_ids, r.max_tokens, r.arrival_s)
            for r in load_trace(path, scaling, limit)
            if max_total_len is None or len(r.prompt_token_ids) + r.max_tokens <= max_total_len]

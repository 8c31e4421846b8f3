"""A benchmark run's summary: latency percentiles, throughput, goodput under SLOs.

Goodput counts the requests that completed within both SLOs: TTFT at most `ttft_ms`, and the
90th percentile of their inter-token latencies at most `itl_ms` (a per-request p90 rather
than the max: one late token does not fail a request, a slow stream does). It is reported as
requests/s and as output tokens/s of those requests, over the run's wall time.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from bench.client import RequestRecord

QUANTILES = (0.5, 0.9, 0.99)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks; nan for no values."""
    ordered = sorted(v for v in values if not math.isnan(v))
    if not ordered:
        return float("nan")
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class Slo:
    ttft_ms: float | None = None
    itl_ms: float | None = None

    def is_met(self, record: RequestRecord) -> bool:
        if record.status != "ok":
            return False
        if self.ttft_ms is not None and not record.ttft_s * 1000 <= self.ttft_ms:
            return False
        itls = record.itls_s
        return self.itl_ms is None or not itls or percentile(itls, 0.9) * 1000 <= self.itl_ms


@dataclass(frozen=True)
class Latency:
    """Milliseconds."""

    p50: float
    p90: float
    p99: float
    mean: float

    @classmethod
    def of(cls, values_s: list[float]) -> Latency:
        values = [1000 * v for v in values_s if not math.isnan(v)]
        mean = sum(values) / len(values) if values else float("nan")
        return cls(*(percentile(values, q) for q in QUANTILES), mean=mean)


@dataclass(frozen=True)
class Summary:
    num_requests: int
    num_ok: int
    num_rejected: int
    num_errors: int
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    input_tokens_per_s: float
    ttft: Latency
    itl: Latency
    tpot: Latency
    e2e: Latency
    slo: Slo
    slo_attainment: float  # of all requests sent
    goodput_requests_per_s: float
    goodput_tokens_per_s: float
    cached_token_ratio: float  # prompt tokens the server reported cached, of all prompt tokens

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def summarize(records: list[RequestRecord], duration_s: float, slo: Slo) -> Summary:
    ok = [r for r in records if r.status == "ok"]
    good = [r for r in ok if slo.is_met(r)]
    duration_s = max(duration_s, 1e-9)
    num_prompt = sum(r.num_prompt_tokens for r in ok)
    return Summary(
        num_requests=len(records), num_ok=len(ok),
        num_rejected=sum(r.status == "rejected" for r in records),
        num_errors=sum(r.status == "error" for r in records),
        duration_s=duration_s,
        requests_per_s=len(ok) / duration_s,
        output_tokens_per_s=sum(r.num_output_tokens for r in ok) / duration_s,
        input_tokens_per_s=num_prompt / duration_s,
        ttft=Latency.of([r.ttft_s for r in ok]),
        itl=Latency.of([itl for r in ok for itl in r.itls_s]),
        tpot=Latency.of([r.tpot_s for r in ok]),
        e2e=Latency.of([r.end_s for r in ok]),
        slo=slo,
        slo_attainment=len(good) / max(1, len(records)),
        goodput_requests_per_s=len(good) / duration_s,
        goodput_tokens_per_s=sum(r.num_output_tokens for r in good) / duration_s,
        cached_token_ratio=sum(r.num_cached_tokens for r in ok) / max(1, num_prompt),
    )


def format_summary(summary: Summary) -> str:
    lines = [
        f"requests: {summary.num_requests} sent, {summary.num_ok} ok, "
        f"{summary.num_rejected} rejected, {summary.num_errors} errors "
        f"in {summary.duration_s:.1f} s",
        f"throughput: {summary.requests_per_s:.2f} req/s, "
        f"{summary.output_tokens_per_s:.1f} output tok/s, "
        f"{summary.input_tokens_per_s:.0f} input tok/s",
        f"{'ms':>6} {'p50':>9} {'p90':>9} {'p99':>9} {'mean':>9}",
    ]
    for name in ("ttft", "itl", "tpot", "e2e"):
        latency: Latency = getattr(summary, name)
        lines.append(f"{name.upper():>6} {latency.p50:9.1f} {latency.p90:9.1f} "
                     f"{latency.p99:9.1f} {latency.mean:9.1f}")
    slo = summary.slo
    if slo.ttft_ms is not None or slo.itl_ms is not None:
        lines.append(f"goodput (TTFT <= {slo.ttft_ms} ms, ITL p90 <= {slo.itl_ms} ms): "
                     f"{summary.goodput_requests_per_s:.2f} req/s, "
                     f"{summary.goodput_tokens_per_s:.1f} tok/s, "
                     f"{100 * summary.slo_attainment:.1f} % of requests")
    if summary.cached_token_ratio:
        lines.append(f"prefix cache: {100 * summary.cached_token_ratio:.1f} % of prompt tokens")
    return "\n".join(lines)

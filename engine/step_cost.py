"""A per-worker step cost model, fitted online from measured steps.

T(n) = overhead_s + s_per_unit * n, by weighted least squares over (n, seconds) of recent
steps (older steps decay by `decay` per step): for prefill n is a step's prompt tokens, for
decode its sequences. Workers report both fits in their heartbeats; the conductor's TTFT and
TBT estimates use them. Linear, not quadratic: at the prompt lengths served here attention's
n^2 term is small next to the matmuls, and a two-parameter fit stays stable on few samples.
A decode step's time is a fit, not the last steps' average, because it depends on the batch:
an idle worker whose last steps ran a large batch is not that slow for one request.
"""

from __future__ import annotations

import time

# A step that takes more than this many times the fit's prediction for its size (within the
# sizes seen, once the fit rests on a few steps) counts as this many: one step spanning a
# paused process or a stalled machine (seconds where tens of ms were due) otherwise raised
# the fit so far that admission refused every request for good (no step ran to lower it).
# A worker that got slower for real is still learned: each step pulls the fit up to this
# factor, so a few steps follow any change. A step this many times *faster* than predicted
# starts the fit over from it: the steps before ran in other conditions (a worker's first
# seconds, every process of a host warming up at once, fitted 1 s + 0.8 ms a token where a
# warm step takes 0.06 ms a token), and averaging them away took dozens of steps.
OUTLIER_FACTOR = 4.0
MIN_WEIGHT = 3.0  # steps (decayed) before outliers are judged
# Sizes spread less than this (coefficient of variation) fit a rate through the origin: a
# slope from near-equal sizes is the noise's (prompts of 1,000 and 1,001 tokens taking 80
# and 90 ms fitted 10 ms a token).
MIN_SIZE_SPREAD = 0.2


class StepCostFit:
    """T(n) = overhead_s + s_per_unit * n over recent (n, seconds) steps."""

    def __init__(self, decay: float = 0.95) -> None:
        self.decay = decay
        self.observed_at_s: float | None = None  # monotonic; None before any step
        self._restart()

    def _restart(self) -> None:
        self._w = self._n = self._nn = self._t = self._nt = 0.0
        self._max_size = 0

    def observe(self, size: int, seconds: float) -> None:
        self.observed_at_s = time.monotonic()
        if self._w >= MIN_WEIGHT and size <= self._max_size:
            predicted = self.predict(size)
            if seconds * OUTLIER_FACTOR < predicted:
                self._restart()
            else:
                seconds = min(seconds, OUTLIER_FACTOR * predicted)
        self._max_size = max(self._max_size, size)
        d = self.decay
        n = float(size)
        self._w = d * self._w + 1.0
        self._n = d * self._n + n
        self._nn = d * self._nn + n * n
        self._t = d * self._t + seconds
        self._nt = d * self._nt + n * seconds

    def age_s(self) -> float:
        """Seconds since the last step observed (0 before any: nothing to be old)."""
        return 0.0 if self.observed_at_s is None else time.monotonic() - self.observed_at_s

    def predict(self, size: int) -> float:
        overhead, per_unit = self.coefficients()
        return overhead + per_unit * size

    def coefficients(self) -> tuple[float, float]:
        """(overhead_s, s_per_unit); (0, 0) before any observation. Through the origin
        (no overhead) where the sizes barely differ, or where a line through them would
        cross zero time at a positive size (a negative overhead)."""
        if self._w == 0.0 or self._n == 0.0:
            return 0.0, 0.0
        through_origin = 0.0, self._t / self._n
        spread = self._w * self._nn - self._n * self._n  # w^2 x the sizes' variance
        if spread <= (MIN_SIZE_SPREAD * self._n) ** 2:
            return through_origin
        slope = (self._w * self._nt - self._n * self._t) / spread
        overhead = (self._t - slope * self._n) / self._w
        if slope <= 0.0 or overhead < 0.0:
            return through_origin
        return overhead, slope

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


class StepCostFit:
    """T(n) = overhead_s + s_per_unit * n over recent (n, seconds) steps."""

    def __init__(self, decay: float = 0.95) -> None:
        self.decay = decay
        self._w = self._n = self._nn = self._t = self._nt = 0.0

    def observe(self, size: int, seconds: float) -> None:
        d = self.decay
        n = float(size)
        self._w = d * self._w + 1.0
        self._n = d * self._n + n
        self._nn = d * self._nn + n * n
        self._t = d * self._t + seconds
        self._nt = d * self._nt + n * seconds

    def coefficients(self) -> tuple[float, float]:
        """(overhead_s, s_per_unit); (0, 0) before any observation."""
        if self._w == 0.0 or self._n == 0.0:
            return 0.0, 0.0
        spread = self._w * self._nn - self._n * self._n
        if spread <= 1e-9 * self._w * self._nn:  # one size so far: no intercept
            return 0.0, self._t / self._n
        slope = (self._w * self._nt - self._n * self._t) / spread
        if slope <= 0.0:
            return 0.0, self._t / self._n
        overhead = max(0.0, (self._t - slope * self._n) / self._w)
        return overhead, slope

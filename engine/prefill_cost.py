"""A per-worker prefill cost model, fitted online from measured prefill steps.

T_prefill(n) = overhead_s + s_per_token * n, by weighted least squares over (tokens, seconds)
of recent prefill steps (older steps decay by `decay` per step). Workers report the fit in
their heartbeats; the conductor's TTFT estimate uses it. Linear, not quadratic: at the prompt
lengths served here attention's n^2 term is small next to the matmuls, and a two-parameter
fit stays stable on few samples.
"""

from __future__ import annotations


class PrefillCostFit:
    def __init__(self, decay: float = 0.95) -> None:
        self.decay = decay
        self._w = self._n = self._nn = self._t = self._nt = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        d = self.decay
        n = float(num_tokens)
        self._w = d * self._w + 1.0
        self._n = d * self._n + n
        self._nn = d * self._nn + n * n
        self._t = d * self._t + seconds
        self._nt = d * self._nt + n * seconds

    def coefficients(self) -> tuple[float, float]:
        """(overhead_s, s_per_token); (0, 0) before any observation."""
        if self._w == 0.0 or self._n == 0.0:
            return 0.0, 0.0
        spread = self._w * self._nn - self._n * self._n
        if spread <= 1e-9 * self._w * self._nn:  # one prompt length so far: no intercept
            return 0.0, self._t / self._n
        slope = (self._w * self._nt - self._n * self._t) / spread
        if slope <= 0.0:
            return 0.0, self._t / self._n
        overhead = max(0.0, (self._t - slope * self._n) / self._w)
        return overhead, slope

"""The link a simulated engine's KV would cross (`--engine sim`).

A simulated engine's pool holds the model's KV divided by `byte_scale` (the real sizes would
not fit this machine), so its transfers alone would understate the time a handoff takes on
the profile's hardware. The prefill worker's KV handoff waits, after each real write, until
the full bytes would have crossed this link.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass


@dataclass
class SimulatedLink:
    """The link a simulated engine's KV would cross: its pool holds the model's KV divided by
    `byte_scale`, so after each real write a stream waits until `byte_scale` times the bytes
    would have crossed a link of `bytes_per_s` (in wall time: times `time_scale`). Writes
    queue for the link one after another, as on one NIC."""

    bytes_per_s: float
    byte_scale: float = 1.0
    time_scale: float = 1.0
    _free_at: float = 0.0

    async def carry(self, num_bytes: int, started_at: float) -> None:
        """A write of `num_bytes` that began at `started_at` (perf_counter) is done."""
        duration_s = num_bytes * self.byte_scale / self.bytes_per_s * self.time_scale
        self._free_at = max(started_at, self._free_at) + duration_s
        await asyncio.sleep(max(0.0, self._free_at - time.perf_counter()))


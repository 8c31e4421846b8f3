from __future__ import annotations

import asyncio
import time

import pytest

from engine.sim_link import SimulatedLink


async def test_writes_take_the_full_sizes_time_one_after_another() -> None:
    link = SimulatedLink(bytes_per_s=1e6, byte_scale=1000, time_scale=2.0)
    started = time.perf_counter()
    # Two 25-byte writes stand for 25 kB each: 25 ms each at 1 MB/s, doubled by the scale.
    await asyncio.gather(link.carry(25, started), link.carry(25, started))
    assert time.perf_counter() - started == pytest.approx(0.1, abs=0.03)


async def test_an_idle_link_adds_only_the_writes_own_time() -> None:
    link = SimulatedLink(bytes_per_s=1e6)
    await link.carry(1000, time.perf_counter() - 1.0)  # long done
    started = time.perf_counter()
    await link.carry(10_000, started)
    assert time.perf_counter() - started == pytest.approx(0.01, abs=0.01)

"""The KV-handoff step: how a prefill worker moves a request's KV into the decode worker's
reserved blocks before committing the request to decode.

The prefill service calls `send(result, target)` after the engine returns the first token and
the decode worker's `KvTarget` has arrived; the returned report is carried in `KvCommitted`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine.protocol import PrefillResult
from shared.messages import KvTarget


@dataclass(frozen=True)
class HandoffReport:
    num_bytes: int
    seconds: float
    transport: str


class KvHandoff(Protocol):
    async def send(self, result: PrefillResult, target: KvTarget) -> HandoffReport:
        """Move the KV of `result` into `target`'s blocks; raise `TransferFailed` or
        `TransferTimeout` on failure."""

    async def close(self) -> None: ...


class NoKvHandoff:
    """For engines that keep no KV to move (the fake engine): the decode side regenerates
    its state from the prompt, so nothing crosses and the report says so."""

    async def send(self, result: PrefillResult, target: KvTarget) -> HandoffReport:
        return HandoffReport(num_bytes=0, seconds=0.0, transport="none")

    async def close(self) -> None:
        return None

"""What a decode worker holds of each request, by stage.

  - reserved: blocks taken, the KV awaited from the prefill worker (`Reservation`);
  - local: colocated (prefilled here too), while what it needs beyond blocks is readied;
  - active: decoding, by choice id (`choice_id`: the request's own for n = 1), with an
    n > 1 request's open choices listed under its id.

A request is in one stage at a time; an abort drops it from whichever holds it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from shared.errors import InvalidRequest
from shared.messages import GenerateRequest, KvCommitted, request_of


@dataclass
class Reservation:
    request: GenerateRequest
    prefill_worker_id: str
    block_ids: list[int]
    readied: asyncio.Task[InvalidRequest | None]  # `DecodeDuty._ready`
    commit: KvCommitted | None = None  # the KV is in; joins once readied


class HeldRequests:
    """Every request a decode worker holds, at the stage it is at."""

    def __init__(self) -> None:
        self.reservations: dict[str, Reservation] = {}
        self.local: dict[str, GenerateRequest] = {}  # colocated, until readied
        self.active: dict[str, GenerateRequest] = {}  # by choice id
        self.choices: dict[str, list[str]] = {}  # n > 1: a request's open choices

    @property
    def num_open(self) -> int:
        return len(self.reservations) + len(self.local) + len(self.active)

    def num_waiting(self) -> int:
        """Requests not decoding yet: reserved, or readied to prefill here."""
        return len(self.reservations) + len(self.local)

    def attempt(self, request_id: str) -> int | None:
        """Which attempt of the request is held (reserved, prefilling, decoding), if any."""
        if (reservation := self.reservations.get(request_id)) is not None:
            return reservation.request.attempt
        choices = self.choices.get(request_id) or [request_id]
        held = self.local.get(request_id) or self.active.get(choices[0])
        return None if held is None else held.attempt

    def holds(self, stream_id: str) -> bool:
        """Whether a stream (a choice's, or the request's) is held at any stage."""
        return stream_id in self.active or self.attempt(request_of(stream_id)) is not None

    def prefill_worker_of(self, request_id: str) -> str | None:
        """The prefill worker whose KV the request still waits for, if it does."""
        reservation = self.reservations.get(request_id)
        if reservation is None or reservation.commit is not None:
            return None
        return reservation.prefill_worker_id

    def drop(self, request_id: str) -> list[str]:
        """Let the request go from every stage; the choice ids it was decoding under."""
        streams = [*self.choices.pop(request_id, []), request_id]
        for stream_id in streams:
            self.active.pop(stream_id, None)
        self.reservations.pop(request_id, None)
        self.local.pop(request_id, None)
        return streams

    def requests(self) -> list[GenerateRequest]:
        """Every request held (each decoding choice on its own)."""
        return [*self.active.values(), *self.local.values(),
                *(reservation.request for reservation in self.reservations.values())]

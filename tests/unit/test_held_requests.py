"""What a decode worker holds of each request, stage by stage (`services.decode.held_requests`)."""

from __future__ import annotations

import asyncio

import msgspec

from services.decode.held_requests import HeldRequests, Reservation
from shared.messages import GenerateRequest, KvCommitted, SamplingParams, choice_id


def request(request_id: str, *, attempt: int = 0, n: int = 1) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, model="m", prompt_token_ids=[1, 2],
                           sampling=SamplingParams(max_tokens=4, n=n), reply_subject="reply",
                           created_at_s=0.0, attempt=attempt)


async def reserved(held: HeldRequests, one: GenerateRequest) -> Reservation:
    readied = asyncio.get_running_loop().create_task(asyncio.sleep(0, result=None))
    held.reservations[one.request_id] = Reservation(one, "p1", [3, 4], readied)
    await readied
    return held.reservations[one.request_id]


async def test_a_reserved_request_is_held_waiting_for_its_prefill_worker() -> None:
    held = HeldRequests()
    reservation = await reserved(held, request("r1", attempt=2))
    assert (held.num_open, held.num_waiting(), held.attempt("r1")) == (1, 1, 2)
    assert held.holds("r1") and not held.holds("r2")
    assert held.prefill_worker_of("r1") == "p1"
    reservation.commit = KvCommitted(request_id="r1", prefill_worker_id="p1", first_token_id=7,
                                    num_prompt_tokens=2)
    assert held.prefill_worker_of("r1") is None  # the KV is in: nothing waits on p1


def test_a_request_decoding_under_its_choices_is_held_under_each() -> None:
    held, whole = HeldRequests(), request("r1", attempt=1, n=2)
    ids = [choice_id("r1", j, 2) for j in range(2)]
    for stream_id in ids:
        held.active[stream_id] = msgspec.structs.replace(whole, request_id=stream_id)
    held.choices["r1"] = ids
    assert (held.num_open, held.num_waiting(), held.attempt("r1")) == (2, 0, 1)
    assert all(held.holds(stream_id) for stream_id in ids)
    assert held.prefill_worker_of("r1") is None
    assert sorted(r.request_id for r in held.requests()) == ids


async def test_dropping_a_request_lets_it_go_from_every_stage() -> None:
    held = HeldRequests()
    await reserved(held, request("r1"))
    held.local["r2"] = request("r2")
    held.active["r3#0"] = request("r3#0")
    held.choices["r3"] = ["r3#0"]
    assert held.drop("r1") == ["r1"]
    assert held.drop("r2") == ["r2"]
    assert held.drop("r3") == ["r3#0", "r3"]
    assert (held.num_open, held.requests(), held.attempt("r3")) == (0, [], None)

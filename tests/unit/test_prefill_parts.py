"""The prefill role's parts that need no worker: its KV targets and the messages a prefill
result makes."""

from __future__ import annotations

import asyncio

import pytest

from engine.protocol import FirstToken, PrefillResult
from services.kv_handoff import HandoffReport
from services.prefill.kv_targets import KvTargets
from services.prefill.result_messages import first_token_deltas, kv_committed
from shared.errors import TransferTimeout
from shared.messages import GenerateRequest, KvTarget, SamplingParams, TokenLogprob


def target(decode_worker_id: str, *, attempt: int = 0, delivery: int = 0) -> KvTarget:
    return KvTarget(request_id="r1", decode_worker_id=decode_worker_id, block_ids=[1],
                    attempt=attempt, delivery=delivery)


async def test_a_target_that_comes_first_is_there_when_the_run_asks() -> None:
    targets = KvTargets()
    targets.receive(target("d1"))
    assert (await targets.wait("r1", 1.0)).decode_worker_id == "d1"
    assert targets.decode_worker_of("r1") == "d1"


async def test_the_newest_target_wins_and_a_waiting_run_gets_the_first() -> None:
    targets = KvTargets()
    waiting = asyncio.ensure_future(targets.wait("r1", 1.0))
    await asyncio.sleep(0)
    assert targets.decode_worker_of("r1") is None
    targets.receive(target("d1"))
    targets.receive(target("d2"))  # decode placed again
    assert (await waiting).decode_worker_id == "d1"
    assert targets.decode_worker_of("r1") == "d2"


async def test_no_target_in_time_is_a_transfer_timeout() -> None:
    with pytest.raises(TransferTimeout, match=r"within 0\.01s"):
        await KvTargets().wait("r1", 0.01)


async def test_forgetting_keeps_a_target_of_the_placement_it_makes_way_for() -> None:
    targets = KvTargets()
    targets.receive(target("d2", attempt=0, delivery=2))
    targets.forget("r1", keep_from=(0, 2))
    assert targets.decode_worker_of("r1") == "d2"
    targets.forget("r1", keep_from=(0, 3))  # a later placement's abort: this one goes
    assert targets.decode_worker_of("r1") is None
    assert list(targets) == []


async def test_targets_heard_of_long_ago_are_found_for_letting_go() -> None:
    targets = KvTargets()
    targets.receive(target("d1"))
    assert targets.first_heard_before(0.0) == []
    assert targets.first_heard_before(float("inf")) == ["r1"]


def request(n: int, *, logprobs: int | None = None) -> GenerateRequest:
    return GenerateRequest(request_id="r1", model="m", prompt_token_ids=[5, 6, 7],
                           sampling=SamplingParams(max_tokens=4, n=n, logprobs=logprobs),
                           reply_subject="reply", created_at_s=0.0, output_offset=2)


def result() -> PrefillResult:
    return PrefillResult(request_id="r1", first_token_id=10, block_ids=[0],
                         logprob=TokenLogprob(-0.5), num_cached_tokens=1,
                         forks=[FirstToken(11, TokenLogprob(-1.0), "stop")])


REPORT = HandoffReport(num_bytes=100, seconds=0.01, transport="tcp", compression="int8",
                       wire_bytes=30)


def test_each_choice_gets_its_first_token_under_its_own_id() -> None:
    deltas = first_token_deltas(request(2, logprobs=0), result())
    assert [(d.request_id, d.token_ids, d.index, d.finish_reason) for d in deltas] == [
        ("r1#0", [10], 2, None), ("r1#1", [11], 2, "stop")]
    assert [d.logprobs for d in deltas] == [[TokenLogprob(-0.5)], [TokenLogprob(-1.0)]]
    assert first_token_deltas(request(2), result())[0].logprobs is None  # not asked


def test_a_commit_carries_the_transfer_and_every_choices_first_token() -> None:
    single = kv_committed(request(1), result(), REPORT, "p1")
    assert (single.first_token_id, single.first_logprob, single.first_token_ids) == (10, None, [])
    assert (single.num_kv_bytes, single.num_kv_wire_bytes, single.transport,
            single.kv_compression, single.prefill_worker_id) == (100, 30, "tcp", "int8", "p1")
    several = kv_committed(request(2, logprobs=0), result(), REPORT, "p1")
    assert several.first_token_ids == [10, 11]
    assert several.finished_choices == [1]
    assert several.first_logprobs == [TokenLogprob(-0.5), TokenLogprob(-1.0)]

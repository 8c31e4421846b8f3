from __future__ import annotations

import pytest

from services.gateway.request_stream import RequestStream, StreamTable
from shared.errors import (
    CapacityExhausted,
    ErrorCode,
    RequestMoved,
    RequestTimeout,
    TransferTimeout,
)
from shared.messages import (
    OpenStreams,
    OpenStreamsQuery,
    RequestFailed,
    RequestPlaced,
    StreamAttempt,
    StreamQuery,
    StreamStatus,
    TokenBatch,
    TokenDelta,
)


def delta(index: int, token: int, finish: str | None = None) -> TokenDelta:
    return TokenDelta(request_id="r", index=index, token_ids=[token],
                      finish_reason=finish)  # type: ignore[arg-type]


async def test_deltas_come_out_in_index_order_whatever_order_they_arrive() -> None:
    stream = RequestStream("r")
    for d in (delta(2, 12), delta(1, 11), delta(0, 10, None)):
        stream.deliver(d)
    assert [(await stream.next(1.0)).token_ids[0] for _ in range(3)] == [10, 11, 12]


async def test_duplicates_are_dropped() -> None:
    stream = RequestStream("r")
    stream.deliver(delta(0, 10))
    stream.deliver(delta(0, 10))
    stream.deliver(delta(1, 11, "length"))
    assert (await stream.next(1.0)).index == 0
    assert (await stream.next(1.0)).finish_reason == "length"
    with pytest.raises(RequestTimeout):
        await stream.next(0.01)


async def test_failure_reaches_the_reader_as_a_typed_error() -> None:
    table = StreamTable()
    stream = table.open("r")
    table.dispatch(RequestFailed(request_id="r", code=ErrorCode.CAPACITY_EXHAUSTED,
                                 message="full"))
    with pytest.raises(CapacityExhausted, match="full"):
        await stream.next(1.0)


async def test_once_placed_only_the_placed_workers_can_fail_the_request() -> None:
    """A worker of an earlier placement attempt (a decode worker whose reservation went
    elsewhere, its lease expiring later) does not end a request served by others."""
    table = StreamTable()
    stream = table.open("r")
    table.dispatch(RequestPlaced(request_id="r", prefill_worker_id="p2",
                                 decode_worker_id="d2"))
    table.dispatch(RequestFailed(request_id="r", code=ErrorCode.TRANSFER_TIMEOUT,
                                 message="stale", worker_id="d1"))
    table.dispatch(TokenBatch(worker_id="d2", items=[delta(0, 10)]))
    assert (await stream.next(1.0)).token_ids == [10]
    table.dispatch(RequestFailed(request_id="r", code=ErrorCode.TRANSFER_TIMEOUT,
                                 message="placed", worker_id="d2"))
    with pytest.raises(TransferTimeout, match="placed"):
        await stream.next(1.0)


async def test_table_routes_batches_by_request_and_ignores_unknown_ids() -> None:
    table = StreamTable()
    stream = table.open("r")
    table.dispatch(TokenBatch(worker_id="w", items=[
        delta(0, 10), TokenDelta(request_id="other", index=0, token_ids=[1]),
    ]))
    assert (await stream.next(1.0)).token_ids == [10]
    table.close("r")
    assert len(table) == 0


@pytest.mark.parametrize(("now_started_s", "lost"), [
    (100.0, None),  # the worker it was placed on
    (250.0, "d"),  # started again since: what it held is gone
    (50.0, None),  # an older heartbeat than the conductor's: the gateway is behind
    (0.0, None),  # not heard of yet
])
def test_a_decode_worker_that_restarted_since_placement_is_lost(
        now_started_s: float, lost: str | None) -> None:
    """A worker back under its id within the heartbeat timeout never looked dead; its
    heartbeat's start, later than the one the request was placed on, says it restarted."""
    table = StreamTable()
    stream = table.open("r")
    table.dispatch(RequestPlaced(request_id="r", prefill_worker_id="p", decode_worker_id="d",
                                 prefill_started_at_s=10.0, decode_started_at_s=100.0))
    started = {"p": 10.0, "d": now_started_s}
    assert stream.lost_worker(lambda _: True, started.__getitem__) == lost
    assert table.fail_lost(lambda _: True, started.__getitem__) == (lost is not None)


def test_a_placement_from_an_older_conductor_is_judged_by_heartbeats_alone() -> None:
    table = StreamTable()
    stream = table.open("r")
    table.dispatch(RequestPlaced(request_id="r", prefill_worker_id="p", decode_worker_id="d"))
    assert stream.lost_worker(lambda _: True, lambda _: 500.0) is None
    assert stream.lost_worker(lambda worker: worker != "p", lambda _: 500.0) == "p"


def test_the_status_a_conductor_asks_for_says_what_the_gateway_holds() -> None:
    table = StreamTable()
    assert not table.status(StreamQuery(request_id="r", attempt=0)).is_open
    stream = table.open("r")
    assert table.status(StreamQuery(request_id="r", attempt=0)) == StreamStatus(
        request_id="r", is_open=True, is_current=True)
    stream.deliver(delta(0, 10))
    stream.deliver(delta(1, 11))
    assert table.status(StreamQuery(request_id="r", attempt=0)).num_streamed == 2
    table.dispatch(RequestPlaced(request_id="r", prefill_worker_id="p", decode_worker_id="d"))
    assert table.status(StreamQuery(request_id="r", attempt=0)).is_placed
    stream.attempt = 1  # the gateway placed the rest again itself
    assert table.status(StreamQuery(request_id="r", attempt=0)) == StreamStatus(
        request_id="r", is_open=True, is_current=False)


def test_a_choice_still_on_the_first_attempt_keeps_it_current() -> None:
    table = StreamTable()
    first, second = table.open_group("r", ["r-0", "r-1"])
    first.attempt = 1  # failed over on its own
    second.deliver(TokenDelta(request_id="r-1", index=0, token_ids=[5, 6]))
    assert table.status(StreamQuery(request_id="r", attempt=0)) == StreamStatus(
        request_id="r", is_open=True, is_current=True, num_streamed=2)


def test_a_placement_of_an_attempt_moved_on_from_is_ignored() -> None:
    """A late placement of the attempt before (a prefill worker's handoff retry, a
    conductor back from a partition) does not replace the current attempt's."""
    table = StreamTable()
    stream = table.open("r")
    stream.attempt = 1  # failed over
    current = RequestPlaced(request_id="r", prefill_worker_id="p2", decode_worker_id="d2",
                            attempt=1)
    table.dispatch(current)
    table.dispatch(RequestPlaced(request_id="r", prefill_worker_id="p1",
                                 decode_worker_id="d1"))
    assert stream.placement == current
    assert stream.is_stale_failure("d1") and not stream.is_stale_failure("d2")


def test_a_placement_of_an_earlier_delivery_is_ignored() -> None:
    """A conductor that woke after another placed the request's next delivery sends its
    `RequestPlaced` late: the gateway keeps following the later placement. A decode side
    placed again after a failed handoff (no delivery) replaces it as before."""
    table = StreamTable()
    stream = table.open("r")
    later = RequestPlaced(request_id="r", prefill_worker_id="p2", decode_worker_id="d2",
                          delivery=2)
    table.dispatch(later)
    table.dispatch(RequestPlaced(request_id="r", prefill_worker_id="p1",
                                 decode_worker_id="d1", delivery=1))
    assert stream.placement == later
    replaced = RequestPlaced(request_id="r", prefill_worker_id="p2", decode_worker_id="d3")
    table.dispatch(replaced)
    assert stream.placement == replaced


async def test_a_conductors_move_is_never_stale() -> None:
    """A conductor moves a request (`redelivery`) with no worker id: each attempt's move
    fails the stream over, and none makes a later failure look stale."""
    table = StreamTable()
    stream = table.open("r")
    for _ in range(2):
        table.dispatch(RequestFailed(request_id="r", code=ErrorCode.MOVED, message="moved"))
        with pytest.raises(RequestMoved):
            await stream.next(1.0)
    assert not stream.is_stale_failure("")


def test_open_streams_are_those_a_client_waits_for_on_the_asked_attempt() -> None:
    table = StreamTable()
    table.open("a")
    table.open("b").attempt = 1  # placed again elsewhere: attempt 0 decodes for no one
    table.open_group("c", ["c-0", "c-1"])
    query = OpenStreamsQuery(streams=[
        StreamAttempt(request_id=request_id, attempt=0)
        for request_id in ("a", "b", "c-1", "c", "gone")])
    assert table.open_streams(query) == OpenStreams(request_ids=["a", "c-1", "c"])

"""The wire contract: every message round-trips and matches its checked-in golden payload.

A golden mismatch means the public contract changed. If that is deliberate (a new field with
a default, added last), regenerate with `HALFMOON_REGENERATE_GOLDEN=1 pytest tests/unit`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec
import pytest

from shared.errors import ErrorCode
from shared.messages import (
    AbortRequest,
    CudaIpcHandle,
    DecodeReservation,
    DispatchReply,
    GatewayEvent,
    GenerateRequest,
    KvBlockEvent,
    KvCommitted,
    KvEventBatch,
    KvPoolLayout,
    KvTarget,
    Message,
    OpenStreams,
    OpenStreamsQuery,
    PrefillTask,
    PrefixFetch,
    PrefixFetched,
    PrefixSource,
    RdmaPort,
    RequestFailed,
    RequestPlaced,
    RoleChange,
    SamplingParams,
    SegmentInfo,
    StreamAttempt,
    StreamQuery,
    StreamStatus,
    TokenBatch,
    TokenDelta,
    TokenLogprob,
    TransferEndpoint,
    WorkerHeartbeat,
)

GOLDEN = Path(__file__).parent.parent / "golden"

LAYOUT = KvPoolLayout(num_layers=2, num_blocks=4096, block_size=16, num_kv_heads=4,
                      head_dim=32, dtype="float32")

REQUEST = GenerateRequest(
    request_id="cmpl-1", model="halfmoon-tiny", prompt_token_ids=[104, 105],
    sampling=SamplingParams(max_tokens=8, temperature=0.0, seed=7, stop_token_ids=(257,),
                            frequency_penalty=0.5, logit_bias=((3, -100.0),), logprobs=2),
    reply_subject="halfmoon.default.v1.gateway.gw-1", created_at_s=1700000000.5,
)

SAMPLES: dict[str, Message] = {
    "generate_request": REQUEST,
    "prefill_task": PrefillTask(request=REQUEST, prefix_source=PrefixSource(
        worker_id="prefill-b", num_blocks=6)),
    "prefix_fetch": PrefixFetch(request_id="cmpl-1", requester_id="prefill-a",
                                block_hashes=["f6a753e0395b8dfa6485b18612a446af"],
                                block_ids=[7], kv_num_blocks=4096, kv_block_bytes=2048,
                                kv_layout=msgspec.structs.replace(LAYOUT, num_kv_heads=1),
                                engine_incarnation="5b1e0c2d9a8f7e6d"),
    "prefix_fetched": PrefixFetched(worker_id="prefill-b", num_blocks=1, num_bytes=8192,
                                    transport="tcp"),
    "decode_reservation": DecodeReservation(request=REQUEST, prefill_worker_id="prefill-a"),
    "dispatch_reply": DispatchReply(is_accepted=False, worker_id="decode-b",
                                    reason="need 7 KV blocks, 5 free",
                                    code="capacity_exhausted"),
    "kv_target": KvTarget(request_id="cmpl-1", decode_worker_id="decode-b", block_ids=[3, 4],
                          kv_num_blocks=4096, kv_block_bytes=8192, kv_layout=LAYOUT,
                          engine_incarnation="9c4f2a7e1b3d5c60"),
    "transfer_endpoint": TransferEndpoint(
        engine_id="decode-b", host_id="h1/boot", tcp_host="10.0.0.7", tcp_port=7100,
        segments=[SegmentInfo(name="kv", segment_id=1, size_bytes=1 << 30,
                              shm_name="halfmoon-te-42-decode-b-1"),
                  SegmentInfo(name="kv-gpu", segment_id=2, size_bytes=1 << 30,
                              cuda_ipc=CudaIpcHandle(
                                  device_uuid="5f0e3c8a9b1d4e2f8a7b6c5d4e3f2a1b",
                                  handle="ab" * 64, offset_bytes=2 << 20),
                              mirror_shm_name="halfmoon-te-42-decode-b-3")],
        rdma=RdmaPort(device="mlx5_0", port_num=1, lid=0, gid="fe80::1"),
        incarnation="9c4f2a7e1b3d5c60"),
    "kv_committed": KvCommitted(request_id="cmpl-1", prefill_worker_id="prefill-a",
                                first_token_id=97, num_prompt_tokens=2),
    "token_batch": TokenBatch(worker_id="decode-b", items=[
        TokenDelta(request_id="cmpl-1", index=1, token_ids=[98],
                   logprobs=[TokenLogprob(-0.25, [(98, -0.25), (12, -1.5)])],
                   prompt_logprobs=[TokenLogprob(None), TokenLogprob(-3.0, rank=2)]),
        TokenDelta(request_id="cmpl-2", index=4, token_ids=[99], finish_reason="length"),
    ]),
    "request_failed": RequestFailed(request_id="cmpl-1", code=ErrorCode.CAPACITY_EXHAUSTED,
                                    message="no room", worker_id="conductor"),
    "request_placed": RequestPlaced(request_id="cmpl-1", prefill_worker_id="prefill-a",
                                    decode_worker_id="decode-b",
                                    prefill_started_at_s=1699999000.5,
                                    decode_started_at_s=1699999100.75),
    "abort_request": AbortRequest(request_id="cmpl-1", reason="client gone"),
    "stream_query": StreamQuery(request_id="cmpl-1", attempt=1),
    "open_streams_query": OpenStreamsQuery(streams=[
        StreamAttempt(request_id="cmpl-1", attempt=1), StreamAttempt(request_id="cmpl-2-0")]),
    "open_streams": OpenStreams(request_ids=["cmpl-2-0"]),
    "stream_status": StreamStatus(request_id="cmpl-1", is_open=True, is_current=True,
                                  num_streamed=12),
    "role_change": RoleChange(role="prefill", reason="prefill queue over the TTFT SLO",
                              requested_by="conductor-a"),
    "kv_event_batch": KvEventBatch(worker_id="prefill-a", block_size=16, events=[
        KvBlockEvent(kind="stored", block_hash="f6a753e0395b8dfa6485b18612a446af"),
        KvBlockEvent(kind="removed", block_hash="0123456789abcdef0123456789abcdef"),
    ]),
    "worker_heartbeat": WorkerHeartbeat(
        worker_id="decode-b", role="decode", model="halfmoon-tiny", host="h1", num_running=2,
        num_waiting=1, max_batch_size=64, num_free_blocks=100, num_total_blocks=128,
        block_size=16, heartbeat_interval_s=0.5, sent_at_s=1700000000.25, busy_s=12.5,
        started_at_s=1699999100.75, max_model_len=2048, kv_blocks_by_priority={-1: 4, 0: 20},
        num_waiting_tokens_by_priority={0: 300},
    ),
}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_message_round_trips(name: str) -> None:
    message = SAMPLES[name]
    assert msgspec.json.decode(msgspec.json.encode(message), type=type(message)) == message


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_message_matches_golden_payload(name: str) -> None:
    message = SAMPLES[name]
    path = GOLDEN / f"{name}.json"
    encoded = msgspec.json.format(msgspec.json.encode(message), indent=2) + b"\n"
    if os.environ.get("HALFMOON_REGENERATE_GOLDEN") == "1":
        path.write_bytes(encoded)
    assert path.read_bytes() == encoded
    assert msgspec.json.decode(path.read_bytes(), type=type(message)) == message


def test_messages_are_tagged_by_class_name() -> None:
    payload = json.loads(msgspec.json.encode(SAMPLES["abort_request"]))
    assert payload["type"] == "AbortRequest"


def test_gateway_event_union_decodes_each_member() -> None:
    decoder = msgspec.json.Decoder(GatewayEvent)
    for name in ("token_batch", "request_failed", "request_placed"):
        assert decoder.decode(msgspec.json.encode(SAMPLES[name])) == SAMPLES[name]


def test_old_payload_without_newer_defaulted_fields_still_decodes() -> None:
    payload = json.loads(msgspec.json.encode(SAMPLES["kv_committed"]))
    del payload["num_kv_bytes"], payload["transport"]
    decoded = msgspec.json.decode(json.dumps(payload), type=KvCommitted)
    assert (decoded.num_kv_bytes, decoded.transport) == (0, "none")


def test_a_refusal_from_before_refusal_codes_still_decodes() -> None:
    old = b'{"type": "DispatchReply", "is_accepted": false, "worker_id": "d", "reason": "full"}'
    assert msgspec.json.decode(old, type=DispatchReply).code == ""


def test_a_reservation_from_before_local_prefill_still_decodes() -> None:
    payload = json.loads(msgspec.json.encode(SAMPLES["decode_reservation"]))
    del payload["is_local_prefill"]
    decoded = msgspec.json.decode(json.dumps(payload), type=DecodeReservation)
    assert decoded.is_local_prefill is False


def test_a_kv_target_from_before_the_pool_layout_still_decodes() -> None:
    payload = json.loads(msgspec.json.encode(SAMPLES["kv_target"]))
    del payload["kv_num_blocks"], payload["kv_block_bytes"]
    decoded = msgspec.json.decode(json.dumps(payload), type=KvTarget)
    assert (decoded.kv_num_blocks, decoded.kv_block_bytes) == (0, 0)


def test_a_kv_target_from_before_kv_layout_decodes_without_it() -> None:
    payload = json.loads(msgspec.json.encode(SAMPLES["kv_target"]))
    del payload["kv_layout"]
    decoded = msgspec.json.decode(json.dumps(payload), type=KvTarget)
    assert decoded.kv_layout is None
    assert (decoded.kv_num_blocks, decoded.kv_block_bytes) == (4096, 8192)


def test_pool_layout_names_each_size() -> None:
    # A piece: one layer's K (or V) of one block; a block: every layer's K and V.
    assert LAYOUT.layer_block_bytes == 16 * 4 * 32 * 4
    assert LAYOUT.block_bytes == 2 * 2 * LAYOUT.layer_block_bytes
    assert LAYOUT.size_bytes == 4096 * LAYOUT.block_bytes


def test_pool_layouts_that_differ_only_in_block_count_match() -> None:
    assert LAYOUT.mismatch(msgspec.structs.replace(LAYOUT, num_blocks=7)) is None


def test_pool_layout_mismatch_names_every_differing_field() -> None:
    other = msgspec.structs.replace(LAYOUT, head_dim=64, dtype="bfloat16")
    assert LAYOUT.mismatch(other) == "head_dim 32 here, 64 there, dtype float32 here, " \
        "bfloat16 there"


def test_unknown_fields_from_newer_peers_are_ignored() -> None:
    payload = json.loads(msgspec.json.encode(SAMPLES["abort_request"]))
    payload["added_in_v2"] = 1
    assert msgspec.json.decode(json.dumps(payload), type=AbortRequest) == SAMPLES["abort_request"]


def test_wrong_field_type_is_rejected() -> None:
    payload = json.loads(msgspec.json.encode(SAMPLES["kv_target"]))
    payload["block_ids"] = "3,4"
    with pytest.raises(msgspec.ValidationError, match=r"block_ids"):
        msgspec.json.decode(json.dumps(payload), type=KvTarget)


def test_heartbeat_from_a_worker_before_the_cost_fields_still_decodes() -> None:
    payload = json.loads(msgspec.json.encode(SAMPLES["worker_heartbeat"]))
    for newer in ("compute_score", "zone", "prefill_tokens_per_s", "num_waiting_tokens",
                  "decode_step_s", "max_queue", "prefill_overhead_s", "prefill_s_per_token",
                  "local_prefill_max_tokens", "kv_blocks_by_priority",
                  "num_waiting_tokens_by_priority"):
        del payload[newer]
    decoded = msgspec.json.decode(json.dumps(payload), type=WorkerHeartbeat)
    assert (decoded.compute_score, decoded.zone, decoded.prefill_tokens_per_s) == (1.0, "", 0.0)
    assert decoded.kv_blocks_by_priority == {}  # no block counted as another's to take
    assert decoded.num_waiting_tokens_by_priority == {}  # a request waits behind them all


def test_a_request_and_tokens_from_before_sampling_controls_and_logprobs_still_decode() -> None:
    request = msgspec.json.decode(
        b'{"type":"GenerateRequest","request_id":"cmpl-1","model":"m","prompt_token_ids":[1],'
        b'"sampling":{"max_tokens":8,"temperature":0.0,"top_p":1.0,"top_k":null,"seed":7,'
        b'"stop_token_ids":[257],"ignore_eos":false},"reply_subject":"r",'
        b'"created_at_s":1.5,"output_offset":0}', type=GenerateRequest)
    assert request.sampling.logit_bias == () and request.sampling.logprobs is None
    assert not request.sampling.has_penalties and request.sampling.min_tokens == 0
    batch = msgspec.json.decode(
        b'{"type":"TokenBatch","worker_id":"d","items":[{"request_id":"cmpl-1","index":1,'
        b'"token_ids":[98],"finish_reason":null,"num_cached_tokens":0}]}', type=TokenBatch)
    assert batch.items[0].logprobs is None and batch.items[0].prompt_logprobs is None


def test_a_request_from_before_token_filters_and_priorities_still_decodes() -> None:
    payload = json.loads(msgspec.json.encode(SAMPLES["generate_request"]))
    del payload["sampling"]["allowed_token_ids"], payload["sampling"]["bad_words"]
    del payload["priority"]
    decoded = msgspec.json.decode(json.dumps(payload), type=GenerateRequest)
    assert decoded == SAMPLES["generate_request"]
    assert (decoded.sampling.allowed_token_ids, decoded.sampling.bad_words) == ((), ())
    assert decoded.priority == 0


def test_an_abort_from_before_ended_requests_still_decodes_as_not_ending_it() -> None:
    """An older gateway's abort leaves a request waiting at a conductor to be placed."""
    decoded = msgspec.json.decode(b'{"type":"AbortRequest","request_id":"cmpl-1"}',
                                  type=AbortRequest)
    assert decoded == AbortRequest(request_id="cmpl-1") and not decoded.is_ended

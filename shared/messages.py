"""The wire contract: every message that crosses a process (schema version 1).

All messages are JSON-encoded msgspec Structs, tagged by class name in the field `type`, so a
custom NATS subscriber can decode them with any JSON library. Evolution rules: new fields get
defaults and go last; a field never changes type; golden payloads in `tests/golden/` pin the
encoding. Subjects come from `shared.subjects.Subjects`.

A request's life on the wire:
    gateway   --GenerateRequest (JetStream)-->        conductor
    conductor --PrefillTask (request/reply)-->       prefill      (replies DispatchReply)
    conductor --DecodeReservation (request/reply)--> decode       (replies DispatchReply)
    decode    --KvTarget-->                          prefill      (where the KV goes)
    conductor --RequestPlaced-->                     gateway
    prefill   --TokenBatch (first token)-->          gateway
    prefill   --KvCommitted (request/reply)-->       decode       (replies DispatchReply)
    decode    --TokenBatch (one per gateway per step)--> gateway
    workers   --KvEventBatch (JetStream)-->          conductor (global prefix index)
    anyone    --RequestFailed-->                     gateway
    gateway/conductor --AbortRequest-->              every worker
"""

from __future__ import annotations

from typing import Literal

import msgspec

from shared.errors import ErrorCode

FinishReason = Literal["stop", "length"]
WorkerRole = Literal["prefill", "decode"]


class Message(msgspec.Struct, frozen=True, kw_only=True, tag=True, tag_field="type"):
    """Base of every wire message; the tag is the class name."""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to pick tokens. `temperature == 0` means greedy."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


class GenerateRequest(Message, frozen=True, kw_only=True):
    """A tokenized request. Published by the gateway on `Subjects.requests` (JetStream, with
    `Nats-Msg-Id = request_id`); consumed by the conductor's durable pull consumer.
    Tokens and errors for it go to `reply_subject` (the gateway's own subject)."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_subject: str
    created_at_s: float
    # A continuation after a worker was lost: `prompt_token_ids` ends with the
    # `output_offset` tokens already streamed, and output indexes count on from there.
    output_offset: int = 0


class PrefixSource(msgspec.Struct, frozen=True, kw_only=True):
    """Another prefill worker that holds the prompt's first `num_blocks` blocks in its prefix
    cache, from which fetching them is cheaper than computing them."""

    worker_id: str
    num_blocks: int


class PrefillTask(Message, frozen=True, kw_only=True):
    """Command from the conductor to one prefill worker (`Subjects.prefill_task`), sent as a
    request; the worker answers `DispatchReply` at once and computes later. The decode side is
    learnt from the `KvTarget` that the decode worker sends. With `prefix_source` the worker
    first fetches the cached prefix it lacks from that worker (`PrefixFetch`)."""

    request: GenerateRequest
    prefix_source: PrefixSource | None = None


class DecodeReservation(Message, frozen=True, kw_only=True):
    """Command from the conductor to one decode worker (`Subjects.decode_reserve`): reserve KV
    blocks for the request and tell `prefill_worker_id` where to write. Sent again with another
    prefill worker id if the first prefill worker refused; the decode worker then keeps its
    blocks and re-sends the `KvTarget`. With `is_local_prefill` the decode worker prefills the
    prompt itself (colocated mode, or a prompt short enough for conditional disaggregation):
    no prefill worker and no KV transfer take part."""

    request: GenerateRequest
    prefill_worker_id: str
    is_local_prefill: bool = False


class DispatchReply(Message, frozen=True, kw_only=True):
    """A worker's immediate answer to `PrefillTask`, `DecodeReservation` or `KvCommitted`."""

    is_accepted: bool
    worker_id: str
    reason: str = ""


class KvTarget(Message, frozen=True, kw_only=True):
    """Fact from a decode worker to a prefill worker (`Subjects.kv_target`): the blocks
    reserved for the request, where prefill must write its KV. `kv_num_blocks` and
    `kv_block_bytes` give the decode pool's layout (engine.protocol.KvLayout) in its transfer
    engine's segment `kv` (engine id = `decode_worker_id`); 0 when it has no KV pool."""

    request_id: str
    decode_worker_id: str
    block_ids: list[int]
    kv_num_blocks: int = 0
    kv_block_bytes: int = 0


class KvCommitted(Message, frozen=True, kw_only=True):
    """Command from a prefill worker to the decode worker (`Subjects.kv_commit`), sent as a
    request: the request's KV is in the target blocks and its first token is out; join the
    running batch."""

    request_id: str
    prefill_worker_id: str
    first_token_id: int
    num_prompt_tokens: int
    num_kv_bytes: int = 0
    transport: str = "none"


class PrefixFetch(Message, frozen=True, kw_only=True):
    """Command from one prefill worker to another (`Subjects.prefix_fetch`), sent as a
    request: write the KV of the cached blocks `block_hashes` (hex chain hashes, consecutive
    prompt blocks) into the requester's `block_ids`, every layer, through the transfer engine
    (engine id = `requester_id`, segment `kv`, pool layout `kv_num_blocks` x
    `kv_block_bytes`). The holder writes the leading run it still holds and answers
    `PrefixFetched`."""

    request_id: str
    requester_id: str
    block_hashes: list[str]
    block_ids: list[int]
    kv_num_blocks: int
    kv_block_bytes: int


class PrefixFetched(Message, frozen=True, kw_only=True):
    """The holder's answer to `PrefixFetch`: its first `num_blocks` blocks are written."""

    worker_id: str
    num_blocks: int
    num_bytes: int = 0
    transport: str = "none"


class TokenDelta(msgspec.Struct, frozen=True, kw_only=True):
    """New tokens of one request. `index` is the position in the output of the first token
    here, so the gateway can order deltas that reach it from different workers. The first
    token's delta (from prefill) says how many prompt tokens the prefix cache served."""

    request_id: str
    index: int
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0


class TokenBatch(Message, frozen=True, kw_only=True):
    """Fact: new tokens for one gateway (`Subjects.gateway`). Prefill sends the first token of
    a request; decode sends one batch per gateway per step."""

    worker_id: str
    items: list[TokenDelta]


class RequestFailed(Message, frozen=True, kw_only=True):
    """Fact: the request ended in an error. Sent to the gateway (`Subjects.gateway`) by the
    conductor (rejection) or a worker (failure)."""

    request_id: str
    code: ErrorCode
    message: str
    worker_id: str = ""
    retry_after_s: float | None = None  # for rejections: when trying again makes sense


class AbortRequest(Message, frozen=True, kw_only=True):
    """Command on `Subjects.abort` (every worker listens): stop the request, free its blocks.
    Published by the gateway (client gone, stop string hit) or the conductor (placement
    failed)."""

    request_id: str
    reason: str = ""


class WorkerHeartbeat(Message, frozen=True, kw_only=True):
    """Fact from each worker on `Subjects.heartbeat` every `heartbeat_interval_s`; also its
    entry in the worker registry bucket. `is_draining` means: send no new work."""

    worker_id: str
    role: WorkerRole
    model: str
    host: str
    num_running: int
    num_waiting: int
    max_batch_size: int
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    heartbeat_interval_s: float
    sent_at_s: float
    is_draining: bool = False
    compute_score: float = 1.0  # relative speed, set per deployment (1.0 = reference)
    zone: str = ""  # network position: workers in one zone move KV cheaply
    prefill_tokens_per_s: float = 0.0  # measured; 0 until the first prefill
    num_waiting_tokens: int = 0  # prompt tokens queued for prefill
    decode_step_s: float = 0.0  # measured time of one decode step; 0 until the first
    max_queue: int = 0  # requests the worker queues before refusing; 0: unknown
    prefill_overhead_s: float = 0.0  # fitted prefill cost: overhead + s_per_token * tokens
    prefill_s_per_token: float = 0.0  # 0 until fitted
    local_prefill_max_tokens: int = 0  # decode: prompts up to this long it prefills itself
    kv_bytes_per_block: int = 0  # one block's KV, every layer; 0: no KV to move (fake engine)
    busy_s: float = 0.0  # wall seconds the device spent in model steps since the worker started


class KvBlockEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One change to a worker's prefix cache; `block_hash` is the hex chain hash."""

    kind: Literal["stored", "removed"]
    block_hash: str


class KvEventBatch(Message, frozen=True, kw_only=True):
    """Fact from a worker on `Subjects.kv_events` (JetStream, replayable; the stream's sequence
    number orders batches): its prefix cache's changes since the last batch, in order. The
    conductor's global prefix index is built from these. `is_reset`: forget everything this
    worker was known to hold (it started with an empty cache)."""

    worker_id: str
    block_size: int
    events: list[KvBlockEvent]
    is_reset: bool = False


class RequestPlaced(Message, frozen=True, kw_only=True):
    """Fact from the conductor to the request's gateway (`Subjects.gateway`): which workers
    serve it. The gateway watches their heartbeats and places the request again (as a
    continuation) when one of them is lost."""

    request_id: str
    prefill_worker_id: str
    decode_worker_id: str


GatewayEvent = TokenBatch | RequestFailed | RequestPlaced


class SegmentInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One memory region a transfer engine registered: peers address it by `segment_id` and
    byte offsets. `shm_name` is set when it lives in POSIX shared memory (a same-host peer may
    map it); `rdma_addr`/`rdma_rkey` when it is an RDMA memory region."""

    name: str
    segment_id: int
    size_bytes: int
    shm_name: str | None = None
    rdma_addr: int | None = None
    rdma_rkey: int | None = None


class RdmaPort(msgspec.Struct, frozen=True, kw_only=True):
    """Where a transfer engine's RDMA device sits: enough for a peer to address its QPs."""

    device: str
    port_num: int
    lid: int
    gid: str


class TransferEndpoint(Message, frozen=True, kw_only=True):
    """A transfer engine's descriptor. Put by each engine in `Subjects.transfer_bucket` under
    its `engine_id` (and sent in its handshake); read by peers to choose a transport
    (`host_id` equal: shared memory; `rdma` on both sides: RDMA; else TCP) and to address
    segments. No KV bytes ever travel on NATS, only this."""

    engine_id: str
    host_id: str
    tcp_host: str
    tcp_port: int
    segments: list[SegmentInfo] = []
    rdma: RdmaPort | None = None

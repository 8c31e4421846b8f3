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
    operator/planner --RoleChange (request/reply)--> one worker   (replies DispatchReply)
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from shared.errors import ErrorCode, HalfmoonError

FinishReason = Literal["stop", "length"]
WorkerRole = Literal["prefill", "decode"]


class Message(msgspec.Struct, frozen=True, kw_only=True, tag=True, tag_field="type"):
    """Base of every wire message; the tag is the class name."""


class GrammarSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What the output must match (structured outputs): `json_object` any JSON object;
    `json_schema` the JSON schema in `source` (JSON text); `ebnf` the grammar in `source`;
    `regex` the regular expression in `source` (a worker older than `regex` refuses it).
    A JSON output may be wrapped in the literal texts `begin` and `end` (a forced tool
    call: `<tool_call>{...}</tool_call>`)."""

    kind: Literal["json_object", "json_schema", "ebnf", "regex"]
    source: str = ""
    begin: str = ""
    end: str = ""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to pick tokens. `temperature == 0` means greedy."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Controls on the logits, applied in this order before temperature (`engine.sampler`):
    # the token filters (below) and, until `min_tokens` output tokens, eos and stop tokens
    # masked; `logit_bias` (token id, bias) added; `repetition_penalty` on every token of
    # prompt and output (> 1 dampens); `frequency_penalty` per occurrence and
    # `presence_penalty` once, on output tokens (OpenAI's semantics). After temperature:
    # `min_p`, `top_k`, `top_p`.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    min_tokens: int = 0
    # vLLM's token filters: only `allowed_token_ids` may be drawn (empty: any); of each
    # `bad_words` sequence the last token is masked where the output so far ends with the
    # rest of it. A mask that would leave no token (with the grammar's) is not applied.
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    # Report each output token's logprob with this many alternatives (None: no logprobs);
    # and, computed on prefill only when asked, each prompt token's (such a prompt is
    # computed whole: the prefix cache keeps K/V, not the logits).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Constrained decoding: every output token keeps the output inside this grammar.
    grammar: GrammarSpec | None = None
    # Choices of one prompt: prefilled once, its KV moved once, then forked on decode into
    # `n` sequences (choice j draws from `seed + j`), each under `choice_id(request_id, j)`.
    n: int = 1

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def choice_id(request_id: str, choice: int, n: int) -> str:
    """The id a choice of a request travels under (tokens, aborts, continuations): the
    request's own for n == 1, `<id>#<choice>` otherwise."""
    return request_id if n == 1 else f"{request_id}#{choice}"


def request_of(choice: str) -> str:
    """The request a choice id belongs to (the inverse of `choice_id`)."""
    return choice.rsplit("#", 1)[0]


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One token's log-probability under the model's own distribution (before any sampling
    control), and the `top` most likely tokens at its position as (token id, logprob), most
    likely first. `logprob` is None only for a prompt's first token (nothing predicts it).
    `rank`: a prompt token's place among its position's tokens (1: the most likely; ties
    share the better place); None for output tokens and from peers that predate it."""

    logprob: float | None
    top: list[tuple[int, float]] = []
    rank: int | None = None


# Bytes per element of the KV dtypes a pool may hold (names as torch spells them).
KV_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "int8": 1}


class KvPoolLayout(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's KV pool as it lies in its transfer engine's segment `kv`: one tensor
    `[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]` of `dtype`.

    Sizes: a *piece* is one layer's K (or V) of one block, `layer_block_bytes` long, at byte
    `((layer * 2 + kind) * num_blocks + block_id) * layer_block_bytes` (kind 0 = K, 1 = V);
    a *block* is every layer's K and V, `block_bytes`. A simulated engine keeps only
    `1 / byte_scale` of each piece's bytes. Two pools exchange KV only when they agree on
    everything but `num_blocks` (`mismatch`). Carried whole in `KvTarget` and `PrefixFetch`."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    byte_scale: int = 1

    @property
    def layer_block_bytes(self) -> int:
        full = self.block_size * self.num_kv_heads * self.head_dim * KV_DTYPE_BYTES[self.dtype]
        return max(1, full // self.byte_scale)

    @property
    def block_bytes(self) -> int:
        return self.num_layers * 2 * self.layer_block_bytes

    @property
    def size_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def mismatch(self, other: KvPoolLayout) -> str | None:
        """Why KV cannot move between this pool and `other`; None when it can."""
        differing = [name for name in self.__struct_fields__
                     if name != "num_blocks" and getattr(self, name) != getattr(other, name)]
        if not differing:
            return None
        return ", ".join(f"{name} {getattr(self, name)} here, {getattr(other, name)} there"
                         for name in differing)


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
    # How many times the gateway placed the request again (0: the first placement), and
    # where it answers `StreamQuery` and `OpenStreamsQuery` ("": too old to answer).
    attempt: int = 0
    status_subject: str = ""
    # vLLM's: lower is served first where requests wait (the conductor's lines for room,
    # the engines' queues and preemption); 0 unless the gateway's scheduling policy is
    # `priority`.
    priority: int = 0
    # How long from `created_at_s` its gateway waits for its first token (the gateway's
    # `request_timeout_s`): the conductor holds it in line for room no longer, and drops it
    # as expired past it. 0: not said (a gateway from before this field), the conductor's
    # `request_max_age_s` then.
    wait_s: float = 0.0


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
    # The JetStream delivery of the request it was placed from (see `AbortRequest.attempt`);
    # 0: from none (a decode side placed again after a failed handoff), or an older conductor.
    delivery: int = 0


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
    delivery: int = 0  # as `PrefillTask.delivery`


class DecodeReplacement(Message, frozen=True, kw_only=True):
    """Command from a prefill worker to the conductors (`Subjects.decode_replacement`, one
    conductor answers): the KV handoff to `failed_decode_worker_id` failed after prefill
    computed the KV, which the prefill worker holds (a `prefill_hold` lease): place the
    decode side again, on another worker, keeping this prefill worker. Answered with
    `DispatchReply` once the new decode worker accepted (it then sends its `KvTarget`)."""

    request: GenerateRequest
    prefill_worker_id: str
    failed_decode_worker_id: str
    reason: str = ""


class DispatchReply(Message, frozen=True, kw_only=True):
    """A worker's immediate answer to `PrefillTask`, `DecodeReservation` or `KvCommitted`.
    A refusal's `code` is the `ErrorCode` behind it, when one is (`capacity_exhausted`: no
    KV room now); empty from peers that predate it."""

    is_accepted: bool
    worker_id: str
    reason: str = ""
    code: str = ""


class KvTarget(Message, frozen=True, kw_only=True):
    """Fact from a decode worker to a prefill worker (`Subjects.kv_target`): the blocks
    reserved for the request, where prefill must write its KV. `kv_layout` is the decode
    pool's layout in its transfer engine's segment `kv` (engine id = `decode_worker_id`);
    None when it has no KV pool. `kv_num_blocks` and `kv_block_bytes` (one piece: a layer's
    K or V of one block) repeat it for peers from before `kv_layout`; 0 without a pool.
    `engine_incarnation` is the incarnation of that transfer engine the blocks belong to
    (`TransferEndpoint.incarnation`): a worker restarted since under the same id is not
    written; empty from peers before it. `attempt` and `delivery` are the reservation's
    (`DecodeReservation.delivery`): the placement the target belongs to."""

    request_id: str
    decode_worker_id: str
    block_ids: list[int]
    kv_num_blocks: int = 0
    kv_block_bytes: int = 0
    kv_layout: KvPoolLayout | None = None
    engine_incarnation: str = ""
    attempt: int = 0
    delivery: int = 0


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
    # The KV crossed quantized (`fp8`, `int8`: TCP with `--kv-transfer-dtype`) or as it is,
    # and the bytes that crossed (`num_kv_bytes` when not quantized).
    kv_compression: str = "none"
    num_kv_wire_bytes: int = 0
    first_logprob: TokenLogprob | None = None  # when the request asked for logprobs
    # n > 1: every choice's first token (choice 0's is `first_token_id` too) and logprob,
    # and the choices that already finished with it.
    first_token_ids: list[int] = []
    first_logprobs: list[TokenLogprob] = []
    finished_choices: list[int] = []


class PrefixFetch(Message, frozen=True, kw_only=True):
    """Command from one prefill worker to another (`Subjects.prefix_fetch`), sent as a
    request: write the KV of the cached blocks `block_hashes` (hex chain hashes, consecutive
    prompt blocks) into the requester's `block_ids`, every layer, through the transfer engine
    (engine id = `requester_id`, segment `kv`, pool layout `kv_layout`; peers before it sent
    only `kv_num_blocks` and `kv_block_bytes`, one piece's size; `engine_incarnation` as in
    `KvTarget`). The holder writes the leading run it still holds and answers
    `PrefixFetched`."""

    request_id: str
    requester_id: str
    block_hashes: list[str]
    block_ids: list[int]
    kv_num_blocks: int
    kv_block_bytes: int
    kv_layout: KvPoolLayout | None = None
    engine_incarnation: str = ""


class PrefixFetched(Message, frozen=True, kw_only=True):
    """The holder's answer to `PrefixFetch`: its first `num_blocks` blocks are written."""

    worker_id: str
    num_blocks: int
    num_bytes: int = 0
    transport: str = "none"
    compression: str = "none"  # the holder's `--kv-transfer-dtype`, as applied on the wire


class TokenDelta(msgspec.Struct, frozen=True, kw_only=True):
    """New tokens of one request. `index` is the position in the output of the first token
    here, so the gateway can order deltas that reach it from different workers. The first
    token's delta (from prefill) says how many prompt tokens the prefix cache served. Where
    a prompt's logprobs would not fit one NATS message, deltas with no token and a piece of
    them each come first, in order; the first token's delta carries the last piece
    (`shared.token_batches`)."""

    request_id: str
    index: int
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0
    # When the request asked: one per token of `token_ids`; and, on the first token's delta,
    # one per prompt token.
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


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
    param: str | None = None  # the request field at fault, for an invalid request
    is_final: bool = False  # trying the same request again cannot succeed


def request_failed(request_id: str, error: HalfmoonError, worker_id: str) -> RequestFailed:
    """The `RequestFailed` that reports `error` for a request."""
    return RequestFailed(request_id=request_id, code=error.code, message=error.message,
                         worker_id=worker_id, retry_after_s=error.retry_after_s,
                         param=error.param, is_final=error.is_final)


class AbortRequest(Message, frozen=True, kw_only=True):
    """Command on `Subjects.abort` (every worker listens, and the conductors): stop the
    request, free its blocks. Published by the gateway (client gone, stop string hit) or the
    conductor (placement failed; or one side given up while the request is placed
    elsewhere: `worker_id`)."""

    request_id: str
    reason: str = ""
    worker_id: str = ""  # only this worker drops the request; empty: every worker
    # Set when the request is placed again: by a conductor, attempt `attempt` from JetStream
    # delivery `before_delivery` on; by its gateway, as attempt `attempt` (`before_delivery`
    # 1). A command of an earlier attempt or delivery that arrives after this abort (sent by
    # a conductor that stood still) is then refused, not run for no one. 0: none.
    attempt: int = 0
    before_delivery: int = 0
    # By its gateway, done with the request (its client has the answer or is gone): nothing
    # of it is placed again. A conductor drops it if it has not placed it yet (waiting for
    # room, or still queued), instead of computing it for no one.
    is_ended: bool = False


class StoredResponse(Message, frozen=True, kw_only=True):
    """A Responses API response a gateway stored (its `store` was true), the value under its
    id in `Subjects.responses_bucket`; any gateway reads it for `previous_response_id` and
    GET /v1/responses/{id}. `conversation` is what a later turn continues: the items the
    model saw (earlier turns, this input) and then its output items, as `input` takes them
    (`instructions` are not carried over, as OpenAI's are not)."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    num_input_items: int  # the leading items of `conversation` that were input


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
    home_role: WorkerRole | None = None  # the role it started in (`role` may differ: RoleChange)
    # The directory it loaded `model` from, as this worker names it ("": none, e.g. the fake
    # engine): a gateway that can read it there takes the model's tokenizer from it.
    model_path: str = ""
    # Models it can switch to (`RoleChange.model`): those on its disk (`--models-dir`), or
    # the sim engine's profiles; and how long loading its model took (0: unknown).
    models_on_disk: list[str] = msgspec.field(default_factory=list)
    model_load_s: float = 0.0
    # Told to serve another model (`RoleChange.model`): finishing its work to load this one,
    # as `loading_role`. Every conductor counts it as that model's load in flight.
    loading_model: str = ""
    loading_role: WorkerRole | None = None
    # When this worker started serving (wall clock, its own; 0: unknown). A later one under
    # the same `worker_id` is a restart: what the earlier process held is gone.
    started_at_s: float = 0.0
    # The longest sequence (prompt and output) it can hold: its model's context, or less
    # where its whole KV pool holds less (0: no limit of its own). Gateways admit no request
    # past the least of a model's live workers.
    max_model_len: int = 0
    # Blocks its running requests hold, by priority (`GenerateRequest.priority`): room for
    # a more urgent request, whose reservation preempts them (empty: none runs, or a worker
    # from before priorities).
    kv_blocks_by_priority: dict[int, int] = msgspec.field(default_factory=dict)
    # `num_waiting_tokens` by priority: a request waits behind its own and the more urgent
    # (empty: none waits, or a worker from before priorities: behind all of them).
    num_waiting_tokens_by_priority: dict[int, int] = msgspec.field(default_factory=dict)
    # Fitted decode step cost, overhead + s_per_sequence * batch (both 0 until fitted, or
    # from a worker before the fit): what a step takes at the batch a request would join,
    # where `decode_step_s` is what the last steps took at whatever batch they ran.
    decode_overhead_s: float = 0.0
    decode_s_per_sequence: float = 0.0
    # Seconds since the prefill fit's last step (0: none yet, a fixed cost, or a worker from
    # before it): an idle worker's old fit may come from other conditions (`admit`).
    prefill_fit_age_s: float = 0.0

    def fitted_decode_step_s(self, batch: int) -> float | None:
        """The fitted decode step at `batch` sequences; None where the worker reports no fit."""
        if self.decode_overhead_s == 0.0 and self.decode_s_per_sequence == 0.0:
            return None
        return self.decode_overhead_s + self.decode_s_per_sequence * batch


class RoleChange(Message, frozen=True, kw_only=True):
    """Command to one worker (request/reply, `Subjects.role_change`), from an operator or a
    conductor's planner: serve as `role` from now on. The worker takes the new role's work
    at once, without reloading weights (its KV pool and prefix cache stay), and answers
    `DispatchReply`; its next heartbeat carries the new role. What it holds of the old role
    finishes meanwhile (it takes no new work of that role): a switch never fails a request.
    With `model`, it serves that model instead: see the field."""

    role: WorkerRole
    reason: str = ""
    requested_by: str = ""
    # Serve this model instead ("": keep the model), loaded from the worker's disk: the worker
    # finishes what it holds, taking nothing new, then reloads (weights and KV pool) under
    # the same worker id; refused when the model is not among its `models_on_disk`.
    model: str = ""


class KvBlockEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One change to a worker's prefix cache; `block_hash` is the hex chain hash."""

    kind: Literal["stored", "removed"]
    block_hash: str


class KvEventBatch(Message, frozen=True, kw_only=True):
    """Fact from a worker on `Subjects.kv_events` (JetStream, replayable; the stream's sequence
    number orders batches): its prefix cache's changes since the last batch, in order. The
    conductor's global prefix index is built from these. `is_reset`: forget everything this
    worker was known to hold; `events` are then all it holds (at its start, and in a stream
    made anew, whose earlier events are gone)."""

    worker_id: str
    block_size: int
    events: list[KvBlockEvent]
    is_reset: bool = False


class PrefixIndexSnapshot(Message, frozen=True, kw_only=True):
    """A conductor's global prefix index as of KV-event stream sequence `stream_seq`, kept in
    the object store bucket `Subjects.snapshot_bucket` (object `Subjects.prefix_snapshot`).
    A starting conductor restores it and replays only the events after `stream_seq`.
    Compact, for 10^5..10^6 blocks: `hashes` concatenates every block's chain hash
    (`hash_bytes` each, least recently used first); `worker_blocks[i]` lists, as unsigned
    32-bit little-endian integers, the positions in `hashes` of the blocks `workers[i]`
    holds. (Bytes travel base64-encoded in JSON.)"""

    stream_seq: int
    taken_at_s: float
    hash_bytes: int
    hashes: bytes
    workers: list[str]
    worker_blocks: list[bytes]
    # When the stream `stream_seq` counts in was made (ISO 8601; "": unknown). A stream made
    # anew starts its sequence over: a snapshot of an earlier one is not restored.
    stream_created: str = ""


class RequestPlaced(Message, frozen=True, kw_only=True):
    """Fact from the conductor to the request's gateway (`Subjects.gateway`): which workers
    serve it. The gateway watches their heartbeats and places the request again (as a
    continuation) when one of them is lost, or restarted: its heartbeat's `started_at_s`
    is later than the one it was placed on (`*_started_at_s`, 0: unknown), as when it
    comes back under the same id within the heartbeat timeout. `attempt` is the placed
    request's (`GenerateRequest.attempt`): the placement of an attempt the gateway has
    moved on from (a late handoff retry, a conductor back from a partition) is ignored;
    so is one of an earlier JetStream `delivery` of the attempt than the placement it
    follows (a conductor that woke after another had placed the request again). `delivery`
    0: a decode side placed again after a failed handoff (or an older conductor), or a
    decode worker's answer to an `is_unplaced` `StreamResume` (the decode worker itself as
    the prefill side once the KV is in, or a colocated request)."""

    request_id: str
    prefill_worker_id: str
    decode_worker_id: str
    prefill_started_at_s: float = 0.0
    decode_started_at_s: float = 0.0
    attempt: int = 0
    delivery: int = 0


GatewayEvent = TokenBatch | RequestFailed | RequestPlaced


class StreamQuery(Message, frozen=True, kw_only=True):
    """Request from a conductor to a request's gateway (`GenerateRequest.status_subject`)
    before it places a request delivered again: the delivery before may have been placed
    (its conductor died, or its ack was lost, after the commands went out), and a second
    placement would run the request twice. Answered with `StreamStatus`."""

    request_id: str
    attempt: int  # the delivered message's `GenerateRequest.attempt`


class StreamStatus(Message, frozen=True, kw_only=True):
    """The gateway's answer to `StreamQuery`: whether a client still waits for the request
    (`is_open`), whether that attempt is the one its stream follows (`is_current`: false
    once the gateway placed the request again itself), whether the stream has that
    attempt's `RequestPlaced` (`is_placed`) and how many output tokens it has had
    (`num_streamed`)."""

    request_id: str
    is_open: bool
    is_current: bool = False
    is_placed: bool = False
    num_streamed: int = 0


class StreamAttempt(msgspec.Struct, frozen=True, kw_only=True):
    """One attempt at a request (`GenerateRequest.attempt`), by request id (choice id for
    one choice of an n > 1 request)."""

    request_id: str
    attempt: int = 0


class OpenStreamsQuery(Message, frozen=True, kw_only=True):
    """Request from a decode worker to a gateway (`GenerateRequest.status_subject`), every
    few seconds, about the requests it decodes for that gateway: which does a client still
    wait for? Decoding goes on for no one when a request's abort (core NATS, at most once)
    was lost, when the gateway placed the rest elsewhere after losing sight of this worker,
    or when the gateway is gone (no one answers on its subject). Answered with
    `OpenStreams`."""

    streams: list[StreamAttempt]


class OpenStreams(Message, frozen=True, kw_only=True):
    """The gateway's answer to `OpenStreamsQuery`: the request ids, of those asked, whose
    attempt a client's stream still follows."""

    request_ids: list[str]


KvLeaseKind = Literal["decode_reservation", "prefix_fetch", "prefill_hold"]


class KvLeaseEvent(Message, frozen=True, kw_only=True):
    """Public fact on `Subjects.kv_lease_event(action)`
    (`halfmoon.<cluster>.v1.events.kv_lease.<action>`, core NATS): a worker (`owner`) holds
    KV blocks on behalf of another party, or stopped holding them. Every such hold is a
    lease with an expiry, renewed while the party is alive and progressing:
        decode_reservation  decode holds blocks for the KV a prefill worker (`party`) will
                            write; renewed by that worker's `KvLeaseRenewal` while the
                            request is queued or computing there
        prefix_fetch        a prefill worker holds cached blocks another (`party`) is reading
                            (or blocks that one is writing into), for one transfer
        prefill_hold        a prefill worker keeps a request's computed KV after its handoff
                            to a decode worker (`party`) failed, while the conductor places
                            the decode side again (bounded by `--kv-hold-s`)
    `action`: granted, released (the hold ended as planned), or expired (the party went
    silent: the blocks are freed, the request, if any, fails)."""

    action: Literal["granted", "released", "expired"]
    kind: KvLeaseKind
    owner: str
    party: str
    request_id: str
    num_blocks: int
    held_s: float = 0.0  # released / expired: how long it was held
    at_s: float = 0.0


class KvLeaseRenewal(Message, frozen=True, kw_only=True):
    """Command from a prefill worker to a decode worker (`Subjects.kv_lease_renewal`), every
    heartbeat: these requests are still queued or computing here, keep their reservations."""

    prefill_worker_id: str
    request_ids: list[str]


class ResumePoint(msgspec.Struct, frozen=True, kw_only=True):
    """One stream to resume: the output index of the first token the gateway still lacks,
    and the attempt of the request it follows (`GenerateRequest.attempt`)."""

    request_id: str
    next_index: int
    attempt: int = 0


class StreamResume(Message, frozen=True, kw_only=True):
    """Command from a gateway to a decode worker (`Subjects.stream_resume`): these streams
    made no progress for a while, so token batches may have been lost (core NATS is at most
    once, e.g. across a NATS restart): send every token from `next_index` on again, as a
    `TokenBatch` to `reply_subject`. Idempotent: the gateway drops what it already has, and
    a worker that holds nothing newer sends nothing.

    `is_unplaced`: the gateway has no placement for these streams either (its `RequestPlaced`
    may have been lost with the rest, as when the gateway's own connection dropped) and asks
    every decode worker: one that holds a stream, on the attempt its point names, announces
    itself with a `RequestPlaced` (`delivery` 0) and then sends the tokens; one that does not
    hold it says nothing (the request may still wait in the queue)."""

    reply_subject: str
    points: list[ResumePoint]
    is_unplaced: bool = False


class ShedLoad(Message, frozen=True, kw_only=True):
    """Command to one decode worker (request/reply, `Subjects.shed_load`), from a conductor's
    planner: hand up to `num_requests` of your running requests back to be placed again, on
    workers with room. Each one's stream fails over as after a lost worker (`RequestFailed`
    with code `moved`, after every token already sent): the gateway re-queues the prompt
    plus the tokens so far, and a prefill worker recomputes their KV. The worker picks the
    requests with the most tokens still owed; it answers `DispatchReply` (its `reason`
    says how many it handed back)."""

    num_requests: int
    reason: str = ""
    requested_by: str = ""


RequestEventKind = Literal["accepted", "placed", "first_token", "kv_committed", "finished",
                           "failed", "migrated"]


class RequestEvent(Message, frozen=True, kw_only=True):
    """Public fact about one request's life, on `Subjects.request_event(kind)`
    (`halfmoon.<cluster>.v1.events.request.<kind>`, core NATS, at most once) for anyone on
    the bus: dashboards, billing, audit. Never carries prompt or output text, only ids,
    counts and timings. Who publishes each kind, and what it fills in:

        accepted      gateway    model, num_prompt_tokens, priority (published before the
                                 request is queued: the first event of every request)
        placed        conductor  prefill_worker_id, decode_worker_id, path, placement_s
        first_token   gateway    worker ids, num_cached_tokens, ttft_s
        kv_committed  prefill    worker ids, num_kv_bytes, transport, kv_seconds,
                                 kv_compression, num_kv_wire_bytes
        finished      gateway    worker ids, token counts, finish_reason ("stop" | "length",
                                 or "abort" when the client left first), ttft_s, e2e_s,
                                 itl_mean_s, itl_max_s, priority
        failed        gateway    error_code, error, e2e_s, priority
        migrated      gateway    attempt, num_output_tokens so far, lost_worker_id (a
                                 continuation is queued after a worker was lost; this
                                 event goes first, its `placed` after)
                      conductor  lost_worker_id, prefill and the new decode_worker_id (a
                                 KV commit failed: the KV went to another decode worker, or
                                 to the same one again when no other was alive)

    `source` is the publisher's instance id; `at_s` its wall clock (Unix seconds). Times
    are the gateway's view (what the client sees) unless the kind says otherwise."""

    kind: RequestEventKind
    request_id: str
    source: str
    at_s: float
    model: str = ""
    prefill_worker_id: str = ""
    decode_worker_id: str = ""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    finish_reason: str = ""
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_mean_s: float | None = None
    itl_max_s: float | None = None
    path: str = ""  # placed: "disaggregated" | "local"
    placement_s: float | None = None  # its delivery pulled to its workers accepted
    num_kv_bytes: int = 0
    transport: str = ""
    kv_seconds: float | None = None
    kv_compression: str = ""
    num_kv_wire_bytes: int = 0
    attempt: int = 0
    lost_worker_id: str = ""
    error_code: str = ""
    error: str = ""
    priority: int = 0  # the request's (`GenerateRequest.priority`)


class CudaIpcHandle(msgspec.Struct, frozen=True, kw_only=True):
    """Where a segment in GPU memory is, for a process of the same host that sees that GPU:
    the device (`device_uuid`, hex, as the CUDA driver reports it), the CUDA IPC handle of
    the allocation holding the segment (`handle`, 64 bytes, hex) and the segment's offset in
    that allocation."""

    device_uuid: str
    handle: str
    offset_bytes: int = 0


class SegmentInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One memory region a transfer engine registered: peers address it by `segment_id` and
    byte offsets. `shm_name` is set when it lives in POSIX shared memory (a same-host peer may
    map it); `rdma_addr`/`rdma_rkey` when it is an RDMA memory region; `cuda_ipc` when it is
    GPU memory that a same-host peer may open (the `cuda` transport); `mirror_shm_name` when it
    is device memory whose host mirror lives in shared memory (a same-host peer may copy to
    and from the mirror, naming the pieces to the owner over tcp, which moves them between
    mirror and device; a peer that does not know the field uses tcp)."""

    name: str
    segment_id: int
    size_bytes: int
    shm_name: str | None = None
    rdma_addr: int | None = None
    rdma_rkey: int | None = None
    cuda_ipc: CudaIpcHandle | None = None
    mirror_shm_name: str | None = None


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
    segments. No KV bytes ever travel on NATS, only this. `incarnation` is new at each start
    of the engine: the addresses a peer was given (segments, offsets, a pool's block ids)
    belong to one incarnation, and a process restarted under the same `engine_id` is
    another; empty from engines that predate it."""

    engine_id: str
    host_id: str
    tcp_host: str
    tcp_port: int
    segments: list[SegmentInfo] = []
    rdma: RdmaPort | None = None
    incarnation: str = ""

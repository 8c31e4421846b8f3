"""The engine protocol: what prefill and decode workers need from a model runner.

Lifecycle: `start()` -> any mix of calls below -> `close()` (safe twice, safe after a failed
start). The engine owns its KV blocks; the worker only names requests.

The protocol is split by role, and one class may implement them together (`Engine`):
  `PrefillEngine`  `prefill(request)` computes the prompt and returns the first token plus the
                   blocks holding its KV; `release(request_id)` once the KV has been handed off.
  `DecodeEngine`   `reserve(request_id, num_tokens)` sets blocks aside for a request whose KV
                   will arrive; `join(request)` adds it to the running batch once the KV is in;
                   `next_step()` waits for the next decode step and returns its tokens;
                   `abort(request_id)` drops the request wherever it is and frees its blocks.
  `PrefixCache`    cached blocks by hash: events for the prefix index, reuse across workers.
  `KvPool`         the pool's byte layout and memory, for the transfer engine.

Implementations never block the event loop: model compute runs in a thread of its own (or,
for the fake engine, is only a sleep).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from shared.errors import HalfmoonError
from shared.messages import FinishReason, KvPoolLayout, SamplingParams, TokenLogprob


@dataclass(frozen=True)
class PrefillRequest:
    """`on_layer(i, block_ids)` is called, from the engine's compute thread, in the step that
    completes the prompt, once layer i's K/V of the whole prompt is in `block_ids` (layer-wise
    KV transfer starts there); it must be quick and thread-safe (hand off to the event loop
    with `call_soon_threadsafe`)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    on_layer: Callable[[int, list[int]], None] | None = None
    output_offset: int = 0  # a continuation: the prompt's last tokens are earlier output
    priority: int = 0  # lower goes first (`engine.scheduler`)


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    first_token_id: int
    block_ids: list[int]
    finish_reason: FinishReason | None = None
    logprob: TokenLogprob | None = None
    num_cached_tokens: int = 0
    compute_s: float = 0.0  # from its first compute step starting to the first token
    prompt_logprobs: list[TokenLogprob] | None = None  # when `sampling` asks for them
    # n > 1: the first token (and logprob, finish) of choices 1..n-1, drawn from the same
    # logits with their own random streams.
    forks: list[FirstToken] = field(default_factory=list)


@dataclass(frozen=True)
class FirstToken:
    token_id: int
    logprob: TokenLogprob | None = None
    finish_reason: FinishReason | None = None


@dataclass(frozen=True)
class DecodeRequest:
    """A request whose KV sits in its reserved blocks and whose first token is out."""

    request_id: str
    prompt_token_ids: list[int]
    first_token_id: int
    sampling: SamplingParams
    is_kv_ready: bool = True  # False: the engine recomputes the prompt's KV itself
    output_offset: int = 0  # a continuation: the prompt's last tokens are earlier output
    # n > 1: every choice's first token, by choice; the engine forks the prompt's KV into
    # one sequence per choice still to decode (`choice_id`), the others left out.
    first_token_ids: list[int] = field(default_factory=list)
    finished_choices: list[int] = field(default_factory=list)
    priority: int = 0  # lower goes first (`engine.scheduler`)


@dataclass(frozen=True)
class TokenOutput:
    """One new token of one request; `index` is its position in the output. A request that
    fails mid-decode yields one output with `error` set and no token."""

    request_id: str
    index: int
    token_id: int
    finish_reason: FinishReason | None = None
    logprob: TokenLogprob | None = None
    error: HalfmoonError | None = None
    num_cached_tokens: int = 0  # on a colocated request's first token: prompt tokens cached
    prompt_logprobs: list[TokenLogprob] | None = None  # on a colocated first token, if asked


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    max_batch_size: int
    prefill_tokens_per_s: float = 0.0  # measured (moving average); 0 before any prefill
    num_waiting_tokens: int = 0  # prompt tokens not yet computed
    decode_step_s: float = 0.0  # measured (moving average); 0 before any decode step
    decode_overhead_s: float = 0.0  # fitted T_decode(b) = overhead + s_per_sequence * b
    decode_s_per_sequence: float = 0.0
    prefill_overhead_s: float = 0.0  # fitted T_prefill(n) = overhead + s_per_token * n
    prefill_s_per_token: float = 0.0
    prefill_fit_age_s: float = 0.0  # since the prefill fit's last step; 0: none yet, or fixed
    busy_s: float = 0.0  # wall time spent in model steps since start (utilization: its rate)
    num_prompt_tokens_computed: int = 0  # since start (prefix-cache hits not included)
    num_preemptions: int = 0  # running sequences whose blocks were taken, since start
    max_model_len: int = 0  # the longest sequence (prompt and output) it holds; 0: no limit
    # Blocks its running sequences hold, by priority: what a more urgent request may take.
    blocks_by_priority: dict[int, int] = field(default_factory=dict)
    # Prompt tokens not yet computed, by priority: what a request of a priority waits behind.
    waiting_tokens_by_priority: dict[int, int] = field(default_factory=dict)


class PrefillEngine(Protocol):
    """What a prefill worker needs: compute prompts, then let their KV go."""

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        """Compute the prompt (batched with other waiting prompts) and sample one token."""

    def release(self, request_id: str) -> None:
        """The prefill KV of `request_id` has been handed off; the engine may reuse it."""


class DecodeEngine(Protocol):
    """What a decode worker needs: hold KV for requests, and decode them in one batch."""

    def check(self, sampling: SamplingParams) -> None:
        """Before `reserve` or `generate`, at once: raises `InvalidRequest` when this engine
        cannot serve the request at all."""

    async def prepare(self, sampling: SamplingParams) -> None:
        """Before `join` or `generate`: ready what the request needs beyond blocks (its
        grammar, compiled: seconds the first time, off the event loop); raises
        `InvalidRequest` when that cannot be done."""

    def reserve(self, request_id: str, num_tokens: int, *, num_choices: int = 1,
                num_prompt_tokens: int = 0) -> list[int]:
        """Set aside blocks for a request that may reach `num_tokens` tokens (prompt and
        output) and, for n > 1, the other choices' own blocks (the prompt's full blocks are
        shared); returns the blocks the prompt's KV goes to first. An engine whose sequences
        grow (the torch engine) takes only the prompt's and a block of headroom. Raises
        `CapacityExhausted`."""

    async def reserve_over(self, request_id: str, num_tokens: int, *, priority: int,
                           num_choices: int = 1, num_prompt_tokens: int = 0) -> list[int]:
        """`reserve`, for a request of `priority` the pool is short for: running requests
        less urgent than it give up their blocks (preempted, computed again later) when
        they hold enough; else `CapacityExhausted`. An engine without priorities (the
        fake and simulated ones) answers as `reserve`."""

    def join(self, request: DecodeRequest) -> None:
        """Add a reserved request to the running decode batch."""

    def generate(self, request: PrefillRequest) -> None:
        """Prefill and decode here (colocated, no KV moves): every token, from index 0,
        comes out of `next_step`."""

    async def next_step(self) -> list[TokenOutput]:
        """Wait until something runs, run one decode step, return its tokens. Finished
        requests leave the batch and their blocks are freed."""

    def abort(self, request_id: str) -> bool:
        """Drop the request wherever it is (prefill or decode); return whether it was
        known."""


class PrefixCache(Protocol):
    """Cached prompt blocks by chain hash: their changes feed the conductors' prefix index,
    and prefix reuse across workers moves them. The holder `hold_prefix`es cached blocks,
    writes them out and `release_blocks`; the fetcher `allocate_blocks`, lets them be
    written, and `cache_blocks` them under their hashes, so its next prefill finds them."""

    def drain_kv_events(self) -> list[tuple[str, bytes]]:
        """Changes since the last call, in order: ("stored" | "removed", hash)."""

    def held_block_hashes(self) -> list[bytes]:
        """Every block hash the cache holds now: its whole state, which a reset announces
        (the events drained before it are superseded; those after it apply on top)."""

    def num_cached_blocks(self, block_hashes: list[bytes]) -> int:
        """How many leading blocks of `block_hashes` the cache holds."""

    def hold_prefix(self, block_hashes: list[bytes]) -> list[int]:
        """The blocks holding the longest cached leading run of `block_hashes`, kept (neither
        evicted nor reused) until `release_blocks`."""

    def release_blocks(self, block_ids: list[int]) -> None:
        """Give back blocks from `hold_prefix` or `allocate_blocks`."""

    def allocate_blocks(self, count: int) -> list[int]:
        """`count` blocks for KV that will be written into them; raises `CapacityExhausted`."""

    def cache_blocks(self, block_ids: list[int], block_hashes: list[bytes]) -> None:
        """Blocks from `allocate_blocks` are written: the first `len(block_hashes)` join the
        cache under those hashes, and all are released."""


class KvPool(Protocol):
    """Where the KV bytes lie, for the transfer engine to move them."""

    def kv_layout(self) -> KvPoolLayout | None:
        """The KV pool's byte layout, or None for an engine with no KV to move."""

    @property
    def kv_device(self) -> str:
        """Where the pool lives: `cpu` (host memory, which `use_kv_buffer` may place in
        shared memory) or a CUDA device (then `kv_pool_tensor` is registered after start())."""

    def use_kv_buffer(self, buffer: memoryview) -> None:
        """Before start(), for a pool in host memory: keep it in `buffer`
        (`kv_layout().size_bytes` long, e.g. transfer-engine shared memory) instead of
        allocating it."""

    def kv_pool_tensor(self) -> Any:
        """After start(): the pool itself (a device tensor, for the transfer engine to move
        through a pinned host mirror)."""


class Engine(PrefillEngine, DecodeEngine, KvPool, Protocol):
    """A model runner with a paged KV cache, in every role; see the module docstring for the
    lifecycle. Its prefix cache may be the engine itself or a part it composes."""

    async def start(self) -> None:
        """Load weights, allocate the KV pool, start the compute thread."""

    async def close(self) -> None:
        """Stop compute and free everything; idempotent."""

    def stats(self) -> EngineStats:
        """Load and measured speed, for heartbeats and metrics."""

    @property
    def prefix_cache(self) -> PrefixCache: ...

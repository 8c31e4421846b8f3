"""The engine protocol: what prefill and decode workers need from a model runner.

Lifecycle: `start()` -> any mix of calls below -> `close()` (safe twice, safe after a failed
start). The engine owns its KV blocks; the worker only names requests.

Prefill side:  `prefill(request)` computes the prompt and returns the first token plus the
               blocks holding its KV; `release(request_id)` once the KV has been handed off.
Decode side:   `reserve(request_id, num_tokens)` sets blocks aside for a request whose KV will
               arrive; `join(request)` adds it to the running batch once the KV is in;
               `next_step()` waits for the next decode step and returns its tokens.
Both:          `abort(request_id)` drops the request wherever it is and frees its blocks.
Prefix reuse across workers (prefill): the holder `hold_prefix`es cached blocks, writes them
               out, `release_blocks`; the fetcher `allocate_blocks`, lets them be written, and
               `cache_blocks` them under their hashes, so its next prefill finds them.

Implementations never block the event loop: model compute runs in a thread of its own (or,
for the fake engine, is only a sleep).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from shared.errors import HalfmoonError
from shared.messages import FinishReason, SamplingParams


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


@dataclass(frozen=True)
class KvLayout:
    """Where a block's K or V of one layer lies in the KV pool's bytes:
    `((layer * 2 + kind) * num_blocks + block_id) * block_bytes`, kind 0 = K, 1 = V."""

    num_layers: int
    num_blocks: int
    block_bytes: int

    @property
    def size_bytes(self) -> int:
        return self.num_layers * 2 * self.num_blocks * self.block_bytes

    def block_offsets(self, layer: int, block_ids: np.ndarray) -> np.ndarray:
        """Byte offsets of `block_ids`' K blocks of `layer`, then of their V blocks."""
        return np.concatenate([((layer * 2 + kind) * self.num_blocks + block_ids)
                               * self.block_bytes for kind in (0, 1)])


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    first_token_id: int
    block_ids: list[int]
    finish_reason: FinishReason | None = None
    logprob: float | None = None
    num_cached_tokens: int = 0
    compute_s: float = 0.0  # from its first compute step starting to the first token


@dataclass(frozen=True)
class DecodeRequest:
    """A request whose KV sits in its reserved blocks and whose first token is out."""

    request_id: str
    prompt_token_ids: list[int]
    first_token_id: int
    sampling: SamplingParams
    is_kv_ready: bool = True  # False: the engine recomputes the prompt's KV itself


@dataclass(frozen=True)
class TokenOutput:
    """One new token of one request; `index` is its position in the output. A request that
    fails mid-decode yields one output with `error` set and no token."""

    request_id: str
    index: int
    token_id: int
    finish_reason: FinishReason | None = None
    logprob: float | None = None
    error: HalfmoonError | None = None
    num_cached_tokens: int = 0  # on a colocated request's first token: prompt tokens cached


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
    prefill_overhead_s: float = 0.0  # fitted T_prefill(n) = overhead + s_per_token * n
    prefill_s_per_token: float = 0.0
    busy_s: float = 0.0  # wall time spent in model steps since start (utilization: its rate)


class Engine(Protocol):
    """A model runner with a paged KV cache. See the module docstring for the lifecycle."""

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    async def start(self) -> None:
        """Load weights, allocate the KV pool, start the compute thread."""

    async def close(self) -> None:
        """Stop compute and free everything; idempotent."""

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        """Compute the prompt (batched with other waiting prompts) and sample one token."""

    def release(self, request_id: str) -> None:
        """The prefill KV of `request_id` has been handed off; the engine may reuse it."""

    def generate(self, request: PrefillRequest) -> None:
        """Prefill and decode here (colocated, no KV moves): every token, from index 0,
        comes out of `next_step`."""

    def reserve(self, request_id: str, num_tokens: int) -> list[int]:
        """Set aside blocks for `num_tokens` tokens; raises `CapacityExhausted`."""

    def join(self, request: DecodeRequest) -> None:
        """Add a reserved request to the running decode batch."""

    async def next_step(self) -> list[TokenOutput]:
        """Wait until something runs, run one decode step, return its tokens. Finished
        requests leave the batch and their blocks are freed."""

    def abort(self, request_id: str) -> bool:
        """Drop the request wherever it is; return whether it was known."""

    def stats(self) -> EngineStats: ...

    def kv_layout(self) -> KvLayout | None:
        """The KV pool's byte layout, or None for an engine with no KV to move."""

    def use_kv_buffer(self, buffer: memoryview) -> None:
        """Before start(): keep the KV pool in `buffer` (`kv_layout().size_bytes` long, e.g.
        transfer-engine shared memory) instead of allocating it."""

    def drain_kv_events(self) -> list[tuple[str, bytes]]:
        """Prefix-cache changes since the last call, in order: ("stored" | "removed", hash)."""

    def num_cached_blocks(self, block_hashes: list[bytes]) -> int:
        """How many leading blocks of `block_hashes` the prefix cache holds."""

    def hold_prefix(self, block_hashes: list[bytes]) -> list[int]:
        """The blocks holding the longest cached leading run of `block_hashes`, kept (neither
        evicted nor reused) until `release_blocks`."""

    def release_blocks(self, block_ids: list[int]) -> None:
        """Give back blocks from `hold_prefix` or `allocate_blocks`."""

    def allocate_blocks(self, count: int) -> list[int]:
        """`count` blocks for KV that will be written into them; raises `CapacityExhausted`."""

    def cache_blocks(self, block_ids: list[int], block_hashes: list[bytes]) -> None:
        """Blocks from `allocate_blocks` are written: the first `len(block_hashes)` join the
        prefix cache under those hashes, and all are released."""

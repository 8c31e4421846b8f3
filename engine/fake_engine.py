"""A deterministic fake engine: no model, same protocol, same batching shape.

Token `i` of a request is a hash of (prompt, seed, i) mapped onto lowercase letters and space,
so outputs are reproducible in any process and readable through the byte tokenizer.

Cost model (sleeps): prefill batches whatever is waiting when the previous batch ends (up to
`max_batch_size`) and costs `prefill_delay_s + prefill_s_per_token x` the batch's uncached
prompt tokens; each decode step costs `token_delay_s`. The engine reports that cost model as
its fitted prefill cost, so the conductor predicts it as it would a real engine's.

KV blocks are counted for real by the engine's `BlockAllocator`, prefix cache included: a
prompt's full blocks are hashed and registered when its prefill completes, later prompts
sharing a prefix skip those blocks (and their cost), and the cache's stored/removed events
feed the conductor's prefix index as the real engine's do. No KV bytes exist, so none move.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from dataclasses import dataclass

from engine.block_allocator import BlockAllocator
from engine.protocol import (
    DecodeRequest,
    EngineStats,
    PrefillRequest,
    PrefillResult,
    TokenOutput,
)
from engine.stopping import finish_reason
from shared.block_hash import block_hashes
from shared.errors import CapacityExhausted, EngineFailure, InvalidRequest
from shared.messages import SamplingParams

ALPHABET = b"abcdefghijklmnopqrstuvwxyz "


def fake_token(prompt_digest: bytes, seed: int | None, index: int) -> int:
    """The fake model's token at output position `index`."""
    seed_bytes = (seed or 0).to_bytes(8, "little", signed=True)
    key = prompt_digest + seed_bytes + index.to_bytes(4, "little")
    value = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return ALPHABET[value % len(ALPHABET)]


def prompt_digest(prompt_token_ids: list[int]) -> bytes:
    data = b"".join(t.to_bytes(4, "little") for t in prompt_token_ids)
    return hashlib.blake2b(data, digest_size=16).digest()


def fake_completion(prompt_token_ids: list[int], seed: int | None, num_tokens: int) -> list[int]:
    """The whole output the fake engine gives (before any stop rule): for tests and tools."""
    digest = prompt_digest(prompt_token_ids)
    return [fake_token(digest, seed, i) for i in range(num_tokens)]


@dataclass
class _PrefillJob:
    request: PrefillRequest
    hashes: list[bytes]  # of the prompt's full blocks; empty without prefix caching
    num_cached: int  # leading prompt tokens found in the prefix cache
    future: asyncio.Future[PrefillResult]

    @property
    def num_uncached(self) -> int:
        return len(self.request.prompt_token_ids) - self.num_cached


@dataclass
class _Running:
    request_id: str
    sampling: SamplingParams
    digest: bytes  # of the prompt: the tokens derive from it
    num_generated: int


class FakeEngine:
    """Implements `engine.protocol.Engine` without a model."""

    def __init__(
        self,
        *,
        num_blocks: int = 4096,
        block_size: int = 16,
        max_batch_size: int = 64,
        prefill_delay_s: float = 0.0,
        prefill_s_per_token: float = 0.0,
        token_delay_s: float = 0.0,
        is_prefix_caching: bool = True,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_batch_size = max_batch_size
        self.prefill_delay_s = prefill_delay_s
        self.prefill_s_per_token = prefill_s_per_token
        self.token_delay_s = token_delay_s
        self.is_prefix_caching = is_prefix_caching
        self._events: list[tuple[str, bytes]] = []
        self._allocator = BlockAllocator(num_blocks, on_event=self._record_event)
        self._owned: dict[str, list[int]] = {}
        self._num_waiting_tokens = 0
        self._prefill_queue: asyncio.Queue[_PrefillJob]
        self._running: dict[str, _Running] = {}
        self._has_work = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._is_closed = False

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return ()

    async def start(self) -> None:
        self._prefill_queue = asyncio.Queue()
        self._task = asyncio.create_task(self._prefill_loop(), name="fake.prefill")

    async def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for request_id in list(self._owned):
            self.abort(request_id)

    # Prefill side.
    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        if self._task is None or self._is_closed:
            raise EngineFailure("engine is not running")
        prompt = request.prompt_token_ids
        if not prompt:
            raise InvalidRequest("empty prompt", param="prompt")
        hashes = block_hashes(prompt, self.block_size) if self.is_prefix_caching else []
        num_cached = self._allocate_prompt(request.request_id, prompt, hashes)
        job = _PrefillJob(request, hashes, num_cached,
                          asyncio.get_running_loop().create_future())
        self._num_waiting_tokens += job.num_uncached
        self._enqueue(job)
        try:
            return await job.future
        except BaseException:
            self.abort(request.request_id)
            raise

    def _enqueue(self, job: _PrefillJob) -> None:
        self._prefill_queue.put_nowait(job)

    def _allocate_prompt(self, request_id: str, prompt: list[int], hashes: list[bytes]) -> int:
        """Take the cached leading blocks of `prompt` and fresh ones for the rest; return how
        many prompt tokens are cached (at least one token is always computed)."""
        cached = self._allocator.match_prefix(hashes)
        needed = math.ceil(len(prompt) / self.block_size) - len(cached)
        try:
            self._owned[request_id] = cached + self._take(needed)
        except CapacityExhausted:
            self._allocator.free(cached)
            raise
        return min(len(cached) * self.block_size, len(prompt) - 1)

    async def _prefill_loop(self) -> None:
        while True:
            batch = [await self._prefill_queue.get()]
            while len(batch) < self.max_batch_size and not self._prefill_queue.empty():
                batch.append(self._prefill_queue.get_nowait())
            num_tokens = sum(job.num_uncached for job in batch)
            delay_s = self.prefill_delay_s + self.prefill_s_per_token * num_tokens
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            self._num_waiting_tokens -= num_tokens
            for job in batch:
                if not job.future.done():
                    self._register(job)
                    job.future.set_result(self._first_token(job, delay_s))

    def _register(self, job: _PrefillJob) -> None:
        """The prompt's full blocks are computed: they join the prefix cache."""
        blocks = self._owned.get(job.request.request_id, [])
        for block, block_hash in zip(blocks, job.hashes, strict=False):
            self._allocator.register(block, block_hash)

    def _first_token(self, job: _PrefillJob, compute_s: float) -> PrefillResult:
        request = job.request
        token = fake_token(prompt_digest(request.prompt_token_ids), request.sampling.seed, 0)
        return PrefillResult(
            request_id=request.request_id,
            first_token_id=token,
            block_ids=list(self._owned.get(request.request_id, [])),
            finish_reason=finish_reason(token, 1, request.sampling, self.eos_token_ids),
            num_cached_tokens=job.num_cached,
            compute_s=compute_s,
        )

    def release(self, request_id: str) -> None:
        self._free(request_id)

    # Decode side.
    def reserve(self, request_id: str, num_tokens: int) -> list[int]:
        return list(self._allocate(request_id, num_tokens))

    def generate(self, request: PrefillRequest) -> None:
        if not request.prompt_token_ids:
            raise InvalidRequest("empty prompt", param="prompt")
        self._allocate(request.request_id,
                       len(request.prompt_token_ids) + request.sampling.max_tokens)
        self._running[request.request_id] = _Running(
            request.request_id, request.sampling, prompt_digest(request.prompt_token_ids),
            num_generated=0)
        self._has_work.set()

    def join(self, request: DecodeRequest) -> None:
        if request.request_id not in self._owned:
            raise InvalidRequest(f"request {request.request_id} has no reserved blocks")
        self._running[request.request_id] = _Running(
            request.request_id, request.sampling, prompt_digest(request.prompt_token_ids),
            num_generated=1)
        self._has_work.set()

    async def next_step(self) -> list[TokenOutput]:
        while not self._running:
            self._has_work.clear()
            await self._has_work.wait()
        await asyncio.sleep(self.token_delay_s)
        batch = list(self._running.values())[: self.max_batch_size]
        return [self._decode_one(state) for state in batch]

    def _decode_one(self, state: _Running) -> TokenOutput:
        token = fake_token(state.digest, state.sampling.seed, state.num_generated)
        state.num_generated += 1
        reason = finish_reason(token, state.num_generated, state.sampling, self.eos_token_ids)
        if reason is not None:
            self.abort(state.request_id)
        return TokenOutput(state.request_id, state.num_generated - 1, token, reason)

    def abort(self, request_id: str) -> bool:
        was_running = self._running.pop(request_id, None) is not None
        return self._free(request_id) or was_running

    def drain_kv_events(self) -> list[tuple[str, bytes]]:
        events, self._events = self._events, []
        return events

    # Prefix reuse across workers: the block bookkeeping is real, the (absent) bytes are not.
    def num_cached_blocks(self, block_hashes: list[bytes]) -> int:
        return self._allocator.peek_prefix(block_hashes)

    def hold_prefix(self, block_hashes: list[bytes]) -> list[int]:
        return self._allocator.match_prefix(block_hashes)

    def release_blocks(self, block_ids: list[int]) -> None:
        self._allocator.free(block_ids)

    def allocate_blocks(self, count: int) -> list[int]:
        return self._take(count)

    def cache_blocks(self, block_ids: list[int], block_hashes: list[bytes]) -> None:
        self._allocator.cache(block_ids, block_hashes)

    def _record_event(self, kind: str, block_hash: bytes) -> None:
        self._events.append((kind, block_hash))

    def kv_layout(self) -> None:
        return None  # no KV exists: decode regenerates its state, nothing is moved

    def use_kv_buffer(self, buffer: memoryview) -> None:
        raise InvalidRequest("the fake engine keeps no KV")

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self._running),
            num_waiting=self._prefill_queue.qsize() if self._task else 0,
            num_free_blocks=self._allocator.num_available,
            num_total_blocks=self.num_blocks,
            max_batch_size=self.max_batch_size,
            num_waiting_tokens=self._num_waiting_tokens,
            decode_step_s=self.token_delay_s,
            prefill_overhead_s=self.prefill_delay_s,
            prefill_s_per_token=self.prefill_s_per_token,
        )

    # Blocks.
    def _allocate(self, request_id: str, num_tokens: int) -> list[int]:
        if request_id not in self._owned:
            self._owned[request_id] = self._take(max(1, math.ceil(num_tokens / self.block_size)))
        return self._owned[request_id]

    def _take(self, count: int) -> list[int]:
        available = self._allocator.num_available
        if count > available:
            raise CapacityExhausted(f"need {count} KV blocks, {available} free",
                                    param="max_tokens")
        return self._allocator.allocate(count)

    def _free(self, request_id: str) -> bool:
        blocks = self._owned.pop(request_id, None)
        if blocks is None:
            return False
        self._allocator.free(blocks)
        return True

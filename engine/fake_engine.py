"""A deterministic fake engine: no model, same protocol, same batching shape.

Token `i` of a request is a hash of (prompt, seed, i) mapped onto lowercase letters and space,
so outputs are reproducible in any process and readable through the byte tokenizer. Prefill
batches whatever is waiting when the previous batch ends (up to `max_batch_size`) and costs
`prefill_delay_s` per batch; each decode step costs `token_delay_s`. KV blocks are counted
for real (a free list), so capacity and leak checks mean the same as with the real engine.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from dataclasses import dataclass

from engine.protocol import (
    DecodeRequest,
    EngineStats,
    PrefillRequest,
    PrefillResult,
    TokenOutput,
)
from engine.stopping import finish_reason
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
        token_delay_s: float = 0.0,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_batch_size = max_batch_size
        self.prefill_delay_s = prefill_delay_s
        self.token_delay_s = token_delay_s
        self._free_blocks = list(range(num_blocks - 1, -1, -1))
        self._owned: dict[str, list[int]] = {}
        self._prefill_queue: asyncio.Queue[tuple[PrefillRequest, asyncio.Future[PrefillResult]]]
        self._running: dict[str, _Running] = {}
        self._has_work = asyncio.Event()
        self._prefill_task: asyncio.Task[None] | None = None
        self._is_closed = False

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return ()

    async def start(self) -> None:
        self._prefill_queue = asyncio.Queue()
        self._prefill_task = asyncio.create_task(self._prefill_loop(), name="fake.prefill")

    async def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        if self._prefill_task is not None:
            self._prefill_task.cancel()
            await asyncio.gather(self._prefill_task, return_exceptions=True)
        for request_id in list(self._owned):
            self.abort(request_id)

    # Prefill side.
    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        if self._prefill_task is None or self._is_closed:
            raise EngineFailure("engine is not running")
        if not request.prompt_token_ids:
            raise InvalidRequest("empty prompt", param="prompt")
        self._allocate(request.request_id, len(request.prompt_token_ids))
        future: asyncio.Future[PrefillResult] = asyncio.get_running_loop().create_future()
        await self._prefill_queue.put((request, future))
        try:
            return await future
        except BaseException:
            self.abort(request.request_id)
            raise

    async def _prefill_loop(self) -> None:
        while True:
            batch = [await self._prefill_queue.get()]
            while len(batch) < self.max_batch_size and not self._prefill_queue.empty():
                batch.append(self._prefill_queue.get_nowait())
            if self.prefill_delay_s > 0:
                await asyncio.sleep(self.prefill_delay_s)
            for request, future in batch:
                if not future.done():
                    future.set_result(self._first_token(request))

    def _first_token(self, request: PrefillRequest) -> PrefillResult:
        token = fake_token(prompt_digest(request.prompt_token_ids), request.sampling.seed, 0)
        return PrefillResult(
            request_id=request.request_id,
            first_token_id=token,
            block_ids=list(self._owned.get(request.request_id, [])),
            finish_reason=finish_reason(token, 1, request.sampling, self.eos_token_ids),
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
        return []  # the fake engine keeps no prefix cache

    def kv_layout(self) -> None:
        return None  # no KV exists: decode regenerates its state, nothing is moved

    def use_kv_buffer(self, buffer: memoryview) -> None:
        raise InvalidRequest("the fake engine keeps no KV")

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self._running),
            num_waiting=self._prefill_queue.qsize() if self._prefill_task else 0,
            num_free_blocks=len(self._free_blocks),
            num_total_blocks=self.num_blocks,
            max_batch_size=self.max_batch_size,
            decode_step_s=self.token_delay_s,
        )

    # Blocks.
    def _allocate(self, request_id: str, num_tokens: int) -> list[int]:
        if request_id in self._owned:
            return self._owned[request_id]
        needed = max(1, math.ceil(num_tokens / self.block_size))
        if needed > len(self._free_blocks):
            raise CapacityExhausted(
                f"need {needed} KV blocks, {len(self._free_blocks)} free", param="max_tokens"
            )
        blocks = [self._free_blocks.pop() for _ in range(needed)]
        self._owned[request_id] = blocks
        return blocks

    def _free(self, request_id: str) -> bool:
        blocks = self._owned.pop(request_id, None)
        if blocks is None:
            return False
        self._free_blocks.extend(blocks)
        return True

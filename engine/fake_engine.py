"""A deterministic fake engine: no model, same protocol, same batching shape.

Each token is a hash of (the context so far, seed) mapped onto lowercase letters and space, so
outputs are reproducible in any process, readable through the byte tokenizer, and, like a
real model's greedy output, continue unchanged after a continuation (prompt + output so far).

Cost model (sleeps): prefill batches whatever is waiting when the previous batch ends (up to
`max_batch_size`) and costs `prefill_delay_s + prefill_s_per_token x` the batch's uncached
prompt tokens; each decode step costs `token_delay_s`. The engine reports that cost model as
its fitted prefill cost, so the conductor predicts it as it would a real engine's.

KV blocks are counted for real by a `BlockLedger` (prefix cache included: later prompts
sharing a prefix skip those blocks and their cost), which is also the engine's
`prefix_cache`. No KV bytes exist, so none move. `PrefillJob`, `FakeSequence` and the token
functions are shared with the simulated engine, which composes the same parts.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass

from engine.block_ledger import BlockLedger
from engine.protocol import (
    DecodeRequest,
    EngineStats,
    PrefillRequest,
    PrefillResult,
    TokenOutput,
)
from engine.stopping import finish_reason
from shared.errors import EngineFailure, InvalidRequest
from shared.messages import SamplingParams

ALPHABET = b"abcdefghijklmnopqrstuvwxyz "


# The fake model's context state: a polynomial hash of every token so far (prompt and
# output alike), so a continuation (prompt + tokens already streamed) continues with exactly
# the tokens the original would have: greedy output survives a failover, as with a real model.
_MODULUS = (1 << 61) - 1
_BASE = 1_000_003


def context_state(token_ids: list[int], state: int = 0) -> int:
    """The state after `token_ids`, continuing from `state`."""
    for token_id in token_ids:
        state = (state * _BASE + token_id + 1) % _MODULUS
    return state


def fake_token(state: int, seed: int | None) -> int:
    """The fake model's next token after a context with this state."""
    key = state.to_bytes(8, "little") + (seed or 0).to_bytes(8, "little", signed=True)
    value = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return ALPHABET[value % len(ALPHABET)]


def fake_completion(prompt_token_ids: list[int], seed: int | None, num_tokens: int) -> list[int]:
    """The whole output the fake engine gives (before any stop rule): for tests and tools."""
    state, output = context_state(prompt_token_ids), []
    for _ in range(num_tokens):
        output.append(fake_token(state, seed))
        state = context_state(output[-1:], state)
    return output


@dataclass
class PrefillJob:
    """A prompt waiting for (or in) a prefill step, and who waits for its result."""

    request: PrefillRequest
    hashes: list[bytes]  # of the prompt's full blocks; empty without prefix caching
    num_cached: int  # leading prompt tokens found in the prefix cache
    future: asyncio.Future[PrefillResult]

    @property
    def num_uncached(self) -> int:
        return len(self.request.prompt_token_ids) - self.num_cached

    def first_token(self, compute_s: float, blocks: list[int],
                    eos_token_ids: tuple[int, ...]) -> PrefillResult:
        """The fake model's first token for this prompt."""
        request = self.request
        token = fake_token(context_state(request.prompt_token_ids), request.sampling.seed)
        return PrefillResult(
            request_id=request.request_id, first_token_id=token, block_ids=blocks,
            finish_reason=finish_reason(token, 1, request.sampling, eos_token_ids),
            num_cached_tokens=self.num_cached, compute_s=compute_s)


@dataclass
class FakeSequence:
    """A request in the decode batch: its next token derives from its context's state."""

    request_id: str
    sampling: SamplingParams
    state: int  # `context_state` of the prompt and the tokens generated so far
    num_generated: int
    prompt_len: int = 0

    @property
    def context_len(self) -> int:
        return self.prompt_len + self.num_generated

    def step(self, eos_token_ids: tuple[int, ...]) -> TokenOutput:
        """The next token; `finish_reason` set when the sequence is done."""
        token = fake_token(self.state, self.sampling.seed)
        self.state = context_state([token], self.state)
        self.num_generated += 1
        reason = finish_reason(token, self.num_generated, self.sampling, eos_token_ids)
        return TokenOutput(self.request_id, self.num_generated - 1, token, reason)


def new_sequence(request_id: str, sampling: SamplingParams, prompt: list[int],
                 num_generated: int) -> FakeSequence:
    """A sequence after `prompt` and the first `num_generated` (0 or 1) tokens, which the
    fake model derives from the prompt (decode recomputes prefill's first token)."""
    state = context_state(prompt)
    if num_generated:
        state = context_state([fake_token(state, sampling.seed)], state)
    return FakeSequence(request_id, sampling, state, num_generated, prompt_len=len(prompt))


def refuse_unserved(sampling: SamplingParams) -> None:
    """A model-less engine can neither keep an output inside a grammar or a token filter
    nor fork choices: say so."""
    if sampling.grammar is not None:
        raise InvalidRequest("structured outputs need the torch engine (this worker has no "
                             "model)", param="response_format")
    for param in ("allowed_token_ids", "bad_words"):
        if getattr(sampling, param):
            raise InvalidRequest(f"{param} needs the torch engine (this worker has no "
                                 "model)", param=param)
    if sampling.n > 1:
        raise InvalidRequest("n > 1 needs the torch engine (this worker has no model)",
                             param="n")


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
        self.max_batch_size = max_batch_size
        self.prefill_delay_s = prefill_delay_s
        self.prefill_s_per_token = prefill_s_per_token
        self.token_delay_s = token_delay_s
        self.ledger = BlockLedger(num_blocks, block_size, is_prefix_caching=is_prefix_caching)
        self._num_waiting_tokens = 0
        self._prefill_queue: asyncio.Queue[PrefillJob]
        self._running: dict[str, FakeSequence] = {}
        self._has_work = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._is_closed = False

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return ()

    @property
    def prefix_cache(self) -> BlockLedger:
        return self.ledger

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
        for request_id in self.ledger.request_ids():
            self.abort(request_id)

    def check(self, sampling: SamplingParams) -> None:
        refuse_unserved(sampling)

    async def prepare(self, sampling: SamplingParams) -> None:
        """Nothing to ready: `check` refuses whatever needs it."""

    # Prefill side.
    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        if self._task is None or self._is_closed:
            raise EngineFailure("engine is not running")
        refuse_unserved(request.sampling)
        if not request.prompt_token_ids:
            raise InvalidRequest("empty prompt", param="prompt")
        blocks = self.ledger.allocate_prompt(request.request_id, request.prompt_token_ids)
        job = PrefillJob(request, blocks.hashes, blocks.num_cached_tokens,
                         asyncio.get_running_loop().create_future())
        self._num_waiting_tokens += job.num_uncached
        self._prefill_queue.put_nowait(job)
        try:
            return await job.future
        except BaseException:
            self.abort(request.request_id)
            raise

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
                    request_id = job.request.request_id
                    self.ledger.register(request_id, job.hashes)
                    job.future.set_result(job.first_token(
                        delay_s, self.ledger.blocks(request_id), self.eos_token_ids))

    def release(self, request_id: str) -> None:
        self.ledger.free(request_id)

    # Decode side.
    def reserve(self, request_id: str, num_tokens: int, *, num_choices: int = 1,
                num_prompt_tokens: int = 0) -> list[int]:
        return self.ledger.reserve(request_id, num_tokens)

    async def reserve_over(self, request_id: str, num_tokens: int, *, priority: int,
                           num_choices: int = 1, num_prompt_tokens: int = 0) -> list[int]:
        """As `reserve`: this engine keeps arrival order, whatever the priority."""
        return self.ledger.reserve(request_id, num_tokens)

    def generate(self, request: PrefillRequest) -> None:
        if not request.prompt_token_ids:
            raise InvalidRequest("empty prompt", param="prompt")
        self.ledger.reserve(request.request_id,
                            len(request.prompt_token_ids) + request.sampling.max_tokens)
        self._start_running(new_sequence(request.request_id, request.sampling,
                                         request.prompt_token_ids, num_generated=0))

    def join(self, request: DecodeRequest) -> None:
        if not self.ledger.owns(request.request_id):
            raise InvalidRequest(f"request {request.request_id} has no reserved blocks")
        self._start_running(new_sequence(request.request_id, request.sampling,
                                         request.prompt_token_ids, num_generated=1))

    def _start_running(self, sequence: FakeSequence) -> None:
        self._running[sequence.request_id] = sequence
        self._has_work.set()

    async def next_step(self) -> list[TokenOutput]:
        while not self._running:
            self._has_work.clear()
            await self._has_work.wait()
        await asyncio.sleep(self.token_delay_s)
        batch = list(self._running.values())[: self.max_batch_size]
        return [self._decode_one(sequence) for sequence in batch]

    def _decode_one(self, sequence: FakeSequence) -> TokenOutput:
        output = sequence.step(self.eos_token_ids)
        if output.finish_reason is not None:
            self.abort(sequence.request_id)
        return output

    def abort(self, request_id: str) -> bool:
        was_running = self._running.pop(request_id, None) is not None
        return self.ledger.free(request_id) or was_running

    def kv_layout(self) -> None:
        return None  # no KV exists: decode regenerates its state, nothing is moved

    kv_device = "cpu"

    def kv_pool_tensor(self) -> None:
        return None

    def use_kv_buffer(self, buffer: memoryview) -> None:
        raise InvalidRequest("the fake engine keeps no KV")

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self._running),
            num_waiting=self._prefill_queue.qsize() if self._task else 0,
            num_free_blocks=self.ledger.num_available,
            num_total_blocks=self.ledger.num_blocks,
            max_batch_size=self.max_batch_size,
            num_waiting_tokens=self._num_waiting_tokens,
            decode_step_s=self.token_delay_s,
            decode_overhead_s=self.token_delay_s,  # a step takes as long at any batch
            prefill_overhead_s=self.prefill_delay_s,
            prefill_s_per_token=self.prefill_s_per_token,
        )

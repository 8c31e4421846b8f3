"""`SimEngine`: the engine protocol on a simulated accelerator (`--engine sim`).

A worker with this engine behaves, to the rest of halfmoon, like one driving a real device of
the chosen profile (`engine/sim_cost.py`): each model step takes the time the cost model
gives for it (times `time_scale`, to slow the whole simulation down when the host is the
bottleneck), so batching, scheduling, admission and KV transfer all run as production code
against realistic step times. It composes the fake engine's parts: tokens are the fake
model's (deterministic letters, `FakeSequence`), blocks are counted for real by a
`BlockLedger`, prefix cache included.

One device per worker, one step at a time, as on a GPU:
  - prefill step: the waiting prompts, first come first served, whole, up to
    `max_batch_tokens` (at least one); costed from FLOPs; layer i's `on_layer` fires when
    i + 1 of the step's layers have elapsed, so layer-wise KV streaming overlaps compute;
  - decode step: every running sequence (up to `max_batch_size`) adds one token; costed from
    the bytes of weights and KV read.
Waiting prompts go first (vLLM's default without chunked prefill), so on a colocated worker
(`generate`) each prefill step stalls every running decode: the interference
disaggregation removes.

The KV pool is real memory in the profile's layout, with each block's bytes divided by
`kv_byte_scale` (the real sizes would not fit this machine); those bytes move through the
transfer engine like a real engine's. `stats().busy_s` is the wall time the device spent in
steps: utilization is its growth over wall time.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.block_ledger import BlockLedger
from engine.fake_engine import FakeSequence, PrefillJob, new_sequence, refuse_unserved
from engine.protocol import (
    DecodeRequest,
    EngineStats,
    PrefillRequest,
    PrefillResult,
    TokenOutput,
)
from engine.sim_cost import SimProfile
from engine.step_cost import StepCostFit
from shared.errors import CapacityExhausted, EngineFailure, InvalidRequest
from shared.messages import KvPoolLayout, SamplingParams


@dataclass(frozen=True)
class SimOptions:
    profile: SimProfile
    time_scale: float = 1.0  # wall seconds per simulated second
    block_size: int = 16
    max_batch_size: int = 256
    max_batch_tokens: int = 8192
    kv_byte_scale: int = 4096  # real KV bytes per byte moved
    is_prefix_caching: bool = True
    # Loading the weights (disk, or another host over the NIC) at this rate: start() takes
    # weight bytes / rate in simulated time; 0: instant.
    load_bytes_per_s: float = 0.0


class SimEngine:
    """Implements `engine.protocol.Engine` on a simulated device."""

    def __init__(self, options: SimOptions) -> None:
        profile = options.profile
        num_blocks = profile.kv_capacity_tokens() // options.block_size  # device memory
        if num_blocks <= 0:
            raise InvalidRequest(f"profile {profile.name}: the weights leave no room for KV")
        self.options = options
        self.profile = profile
        self.max_batch_size = options.max_batch_size
        self.ledger = BlockLedger(num_blocks, options.block_size,
                                  is_prefix_caching=options.is_prefix_caching)
        model = profile.model
        self._layout = KvPoolLayout(
            num_layers=model.num_layers, num_blocks=num_blocks, block_size=options.block_size,
            num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
            dtype=profile.kv_dtype, byte_scale=options.kv_byte_scale)
        self._kv: memoryview | None = None
        self._waiting: deque[PrefillJob] = deque()
        self._num_waiting_tokens = 0
        self._running: dict[str, FakeSequence] = {}
        self._local: dict[str, bool] = {}  # prefilled here to decode here: emit first token?
        self._outputs: asyncio.Queue[list[TokenOutput]] = asyncio.Queue()
        self._has_work = asyncio.Event()
        self._prefill_cost = StepCostFit()
        self._decode_cost = StepCostFit()
        self._decode_step_s = 0.0
        self._task: asyncio.Task[None] | None = None
        self._is_closed = False
        self.busy_s = 0.0

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return ()

    @property
    def prefix_cache(self) -> BlockLedger:
        return self.ledger

    @property
    def load_s(self) -> float:
        """Simulated seconds to load the weights."""
        rate = self.options.load_bytes_per_s
        return self.profile.weight_bytes / rate if rate > 0 else 0.0

    async def start(self) -> None:
        if self._kv is None:
            await asyncio.sleep(self.load_s * self.options.time_scale)
            self._kv = memoryview(bytearray(self._layout.size_bytes))
        self._task = asyncio.create_task(self._device_loop(), name="sim.device")

    async def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        for job in self._waiting:
            if not job.future.done():
                job.future.set_exception(EngineFailure("engine closed"))
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for request_id in self.ledger.request_ids():
            self.abort(request_id)

    def kv_layout(self) -> KvPoolLayout:
        return self._layout

    kv_device = "cpu"

    def kv_pool_tensor(self) -> memoryview | None:
        return self._kv

    def use_kv_buffer(self, buffer: memoryview) -> None:
        if len(buffer) < self._layout.size_bytes:
            raise InvalidRequest(f"KV buffer of {len(buffer)} bytes, need "
                                 f"{self._layout.size_bytes}")
        self._kv = buffer

    # Work in.
    def check(self, sampling: SamplingParams) -> None:
        refuse_unserved(sampling)

    async def prepare(self, sampling: SamplingParams) -> None:
        """Nothing to ready: `check` refuses whatever needs it."""

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        refuse_unserved(request.sampling)
        if self._task is None or self._is_closed:
            raise EngineFailure("engine is not running")
        job = self._new_job(request)
        self._num_waiting_tokens += job.num_uncached
        self._enqueue(job)
        try:
            return await job.future
        except BaseException:
            self.abort(request.request_id)
            raise

    def _new_job(self, request: PrefillRequest) -> PrefillJob:
        if not request.prompt_token_ids:
            raise InvalidRequest("empty prompt", param="prompt")
        blocks = self.ledger.allocate_prompt(request.request_id, request.prompt_token_ids)
        return PrefillJob(request, blocks.hashes, blocks.num_cached_tokens,
                          asyncio.get_running_loop().create_future())

    def _enqueue(self, job: PrefillJob) -> None:
        self._waiting.append(job)
        self._has_work.set()

    def release(self, request_id: str) -> None:
        self.ledger.free(request_id)

    def reserve(self, request_id: str, num_tokens: int, *, num_choices: int = 1,
                num_prompt_tokens: int = 0) -> list[int]:
        return self.ledger.reserve(request_id, num_tokens)

    async def reserve_over(self, request_id: str, num_tokens: int, *, priority: int,
                           num_choices: int = 1, num_prompt_tokens: int = 0) -> list[int]:
        """As `reserve`: this engine keeps arrival order, whatever the priority."""
        return self.ledger.reserve(request_id, num_tokens)

    def generate(self, request: PrefillRequest) -> None:
        job = self._new_job(request)
        try:
            self.ledger.grow(request.request_id,
                             len(request.prompt_token_ids) + request.sampling.max_tokens)
        except CapacityExhausted:
            self.ledger.free(request.request_id)
            raise
        self._queue_local(job, is_first_token_out=True)

    def join(self, request: DecodeRequest) -> None:
        if not self.ledger.owns(request.request_id):
            raise InvalidRequest(f"request {request.request_id} has no reserved blocks")
        if request.is_kv_ready:
            self._start_running(new_sequence(request.request_id, request.sampling,
                                             request.prompt_token_ids, num_generated=1))
            return
        # The KV did not come: recompute it into the reserved blocks, then decode.
        prefill = PrefillRequest(request.request_id, request.prompt_token_ids, request.sampling)
        self._queue_local(PrefillJob(prefill, [], 0, asyncio.get_running_loop().create_future()),
                          is_first_token_out=False)

    def _queue_local(self, job: PrefillJob, *, is_first_token_out: bool) -> None:
        """A prompt prefilled here to be decoded here: no result waits on it; it joins the
        running batch when computed (and its first token goes out if `is_first_token_out`)."""
        self._local[job.request.request_id] = is_first_token_out
        self._num_waiting_tokens += job.num_uncached
        self._enqueue(job)

    def _start_running(self, sequence: FakeSequence) -> None:
        self._running[sequence.request_id] = sequence
        self._has_work.set()

    def abort(self, request_id: str) -> bool:
        self._local.pop(request_id, None)
        was_running = self._running.pop(request_id, None) is not None
        return self.ledger.free(request_id) or was_running

    # The device.
    async def _device_loop(self) -> None:
        while True:
            while not self._waiting and not self._running:
                self._has_work.clear()
                await self._has_work.wait()
            # Admit prompts while the batch has room (vLLM's max_num_seqs); a full batch
            # decodes until a sequence leaves.
            if self._waiting and len(self._running) < self.max_batch_size:
                await self._prefill_step()
            else:
                await self._decode_step()

    def _next_prefill_batch(self) -> list[PrefillJob]:
        batch: list[PrefillJob] = []
        budget = self.options.max_batch_tokens
        while self._waiting and len(batch) < self.max_batch_size:
            job = self._waiting[0]
            if not self.ledger.owns(job.request.request_id):  # aborted while waiting
                self._waiting.popleft()
                self._num_waiting_tokens -= job.num_uncached
                continue
            if batch and job.num_uncached > budget:
                break
            batch.append(self._waiting.popleft())
            budget -= job.num_uncached
        return batch

    async def _prefill_step(self) -> None:
        batch = self._next_prefill_batch()
        if not batch:
            return
        num_tokens = sum(job.num_uncached for job in batch)
        duration_s = self.profile.prefill_s([(job.num_uncached, job.num_cached)
                                             for job in batch])
        callbacks = [(job.request.on_layer, job.request.request_id) for job in batch
                     if job.request.on_layer is not None]
        wall_s = await self._run(duration_s, callbacks)
        self._prefill_cost.observe(num_tokens, wall_s)
        self._num_waiting_tokens -= num_tokens
        first_tokens = [output for job in batch
                        if (output := self._prefilled(job, wall_s)) is not None]
        if first_tokens:
            self._outputs.put_nowait(first_tokens)

    def _prefilled(self, job: PrefillJob, wall_s: float) -> TokenOutput | None:
        """A prompt is computed: answer its waiter, or start decoding it here; return the
        first token when it goes out of `next_step`."""
        request = job.request
        if not self.ledger.owns(request.request_id):
            return None  # aborted during the step
        self.ledger.register(request.request_id, job.hashes)
        result = job.first_token(wall_s, self.ledger.blocks(request.request_id),
                                 self.eos_token_ids)
        is_local = self._local.pop(request.request_id, None)
        if is_local is None:
            if not job.future.done():
                job.future.set_result(result)
            return None
        self._start_running(new_sequence(request.request_id, request.sampling,
                                         request.prompt_token_ids, num_generated=1))
        if not is_local:
            return None
        if result.finish_reason is not None:
            self.abort(request.request_id)
        return TokenOutput(request.request_id, 0, result.first_token_id, result.finish_reason,
                           num_cached_tokens=job.num_cached)

    async def _decode_step(self) -> None:
        batch = list(self._running.values())[: self.max_batch_size]
        duration_s = self.profile.decode_s(sequence.context_len for sequence in batch)
        wall_s = await self._run(duration_s, [])
        self._decode_cost.observe(len(batch), wall_s)
        old = self._decode_step_s
        self._decode_step_s = wall_s if old == 0 else 0.8 * old + 0.2 * wall_s
        outputs = [self._decode_one(sequence) for sequence in batch
                   if sequence.request_id in self._running]
        # Rotate, so that past max_batch_size every sequence gets its turn.
        for sequence in batch:
            if self._running.pop(sequence.request_id, None) is not None:
                self._running[sequence.request_id] = sequence
        if outputs:
            self._outputs.put_nowait(outputs)

    def _decode_one(self, sequence: FakeSequence) -> TokenOutput:
        output = sequence.step(self.eos_token_ids)
        if output.finish_reason is not None:
            self.abort(sequence.request_id)
        return output

    async def _run(self, duration_s: float,
                   callbacks: list[tuple[Callable[[int, list[int]], None], str]]) -> float:
        """Hold the device for `duration_s` simulated seconds; return the wall time."""
        wall_s = duration_s * self.options.time_scale
        loop = asyncio.get_running_loop()
        started = loop.time()
        num_layers = self._layout.num_layers if callbacks else 1
        for layer in range(num_layers):
            await asyncio.sleep(max(0.0, started + wall_s * (layer + 1) / num_layers
                                    - loop.time()))
            for on_layer, request_id in callbacks:
                if self.ledger.owns(request_id):
                    on_layer(layer, self.ledger.blocks(request_id))
        self.busy_s += wall_s
        return wall_s

    async def next_step(self) -> list[TokenOutput]:
        return await self._outputs.get()

    def stats(self) -> EngineStats:
        overhead_s, s_per_token = self._prefill_cost.coefficients()
        decode_overhead_s, s_per_sequence = self._decode_cost.coefficients()
        return EngineStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            num_free_blocks=self.ledger.num_available,
            num_total_blocks=self.ledger.num_blocks,
            max_batch_size=self.max_batch_size,
            num_waiting_tokens=self._num_waiting_tokens,
            decode_step_s=self._decode_step_s,
            decode_overhead_s=decode_overhead_s,
            decode_s_per_sequence=s_per_sequence,
            prefill_overhead_s=overhead_s,
            prefill_s_per_token=s_per_token,
            prefill_fit_age_s=self._prefill_cost.age_s(),
            prefill_tokens_per_s=1 / s_per_token if s_per_token else 0.0,
            busy_s=self.busy_s,
        )

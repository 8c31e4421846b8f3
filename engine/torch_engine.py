"""`TorchEngine`: the real engine, a torch model on a paged KV cache behind the `Engine`
protocol.

Threading: all model compute and all scheduler state live in one engine thread, in
`EngineCore` (`engine.engine_core`); this class is the asyncio side, owning the futures and
the output queue. It talks to the thread through `EngineThread` (the only bridge): it submits
commands (closures run in the thread between steps) and receives results posted back with
`call_soon_threadsafe` (`LoopSide`).
Block allocation is the one thing both sides touch (`reserve` must answer at once), so the
allocator is guarded by a lock that is never held across a model step.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import torch

from engine.block_allocator import LockedAllocator
from engine.block_growth import BlockGrowth
from engine.bridge import EngineThread
from engine.compute_threads import serial_torch
from engine.engine_core import EngineCore, StepTimes, by_priority, choice_blocks, new_sequence
from engine.grammar import Grammars
from engine.kv_budget import pool_blocks
from engine.kv_cache import KvCache
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.protocol import (
    DecodeRequest,
    EngineStats,
    PrefillRequest,
    PrefillResult,
    TokenOutput,
)
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.torch_setup import (
    EngineOptions,
    context_length,
    decode_graphs,
    device_for,
    kv_storage,
    load_model,
)
from shared.errors import EngineFailure, HalfmoonError, InvalidRequest
from shared.messages import KvPoolLayout, SamplingParams, choice_id, request_of


class TorchEngine:
    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self.config = ModelConfig.from_dir(options.model_dir)
        self.device = device_for(options)
        layout = KvPoolLayout(
            num_layers=self.config.num_layers, num_blocks=options.num_blocks,
            block_size=options.block_size, num_kv_heads=self.config.num_kv_heads,
            head_dim=self.config.head_dim, dtype=str(options.dtype).removeprefix("torch."))
        self.num_blocks = pool_blocks(
            self.config, layout, device=self.device,
            kv_cache_memory_gb=options.kv_cache_memory_gb,
            gpu_memory_utilization=options.gpu_memory_utilization)
        self._kv_layout = msgspec.structs.replace(layout, num_blocks=self.num_blocks)
        self.max_model_len = context_length(self.config, options, self.num_blocks)
        self.allocator = LockedAllocator(self.num_blocks)
        self.grammars = Grammars(options.model_dir, self.config.vocab_size,
                                 self.config.eos_token_ids)
        self.scheduler = Scheduler(max_batch_tokens=options.max_batch_tokens,
                                   max_batch_size=options.max_batch_size,
                                   max_wait_s=options.max_wait_s)
        self.kv: KvCache | None = None
        self._core: EngineCore | None = None  # the engine thread's, once started
        self._thread: EngineThread | None = None
        # A prefill's run, by request id: its sequence (a run placed again after an abort
        # makes a new one) and the future its caller awaits.
        self._prefills: dict[str, tuple[Sequence, asyncio.Future[PrefillResult]]] = {}
        self._reserving: set[asyncio.Future[list[int]]] = set()  # `reserve_over`s under way
        self._reserved: dict[str, list[int]] = {}
        self._local: set[str] = set()  # colocated requests (generate)
        self._choices: dict[str, list[str]] = {}  # n > 1: a request's choice ids
        self._outputs: asyncio.Queue[list[TokenOutput]] = asyncio.Queue()
        self._crash: BaseException | None = None
        self._times = StepTimes()
        self._kv_buffer: memoryview | None = None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.config.eos_token_ids

    # Lifecycle.
    async def start(self) -> None:
        """Load the model and set up in the engine thread: the one thread of the process
        that computes on all cores (`engine.compute_threads`); the loop's thread computes
        serially from now on."""
        serial_torch()
        self._thread = EngineThread(asyncio.get_running_loop(), self._step, self._on_crash,
                                    name="engine")
        self._thread.start()
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def set_up() -> None:
            try:
                self._core = self._set_up()
            except BaseException as exc:  # (raised to start's caller, not the thread's)
                self._post(_settle, done, exc)
            else:
                self._post(_settle, done, None)

        self._thread.submit(set_up)
        try:
            await done
        except BaseException:
            await self.close()
            raise

    def _set_up(self) -> EngineCore:
        """In the engine thread: the model, the KV pool, compiled kernels, decode graphs."""
        model = load_model(self.config, self.options, self.device, self.max_model_len)
        self.kv = KvCache(
            num_layers=self.config.num_layers, num_blocks=self.num_blocks,
            block_size=self.options.block_size, num_kv_heads=self.config.num_kv_heads,
            head_dim=self.config.head_dim, dtype=self.options.dtype, device=self.device,
            storage=None if self._kv_buffer is None else kv_storage(self._kv_buffer,
                                                                    self._kv_layout),
        )
        if model.attention is not None:  # (set by load_model) compiles, once a process
            model.attention.warm_up(self.kv)
        runner = ModelRunner(model, self.kv, self.allocator, device=self.device,
                             is_prefix_caching=self.options.is_prefix_caching,
                             eos_token_ids=self.eos_token_ids)
        runner.graphs = decode_graphs(model, self.kv, self.allocator, self.options,
                                      self.max_model_len)
        growth = BlockGrowth(runner, self.scheduler, self.allocator,
                             max_model_len=self.max_model_len,
                             is_up_front=self.options.kv_reservation == "up-front")
        if runner.graphs is not None:  # before anything else runs on the device
            runner.graphs.capture_all()
        return EngineCore(runner, growth, self.scheduler, self.grammars,
                          max_model_len=self.max_model_len, times=self._times,
                          loop_side=self, post=self._post)

    def _step(self) -> bool:
        return self._core.step() if self._core is not None else False

    @property
    def num_decode_graphs(self) -> int:
        """Decode graphs captured (at start; 0 without `decode_graphs`)."""
        graphs = self._core.runner.graphs if self._core is not None else None
        return graphs.num_captured if graphs is not None else 0

    @property
    def prefix_cache(self) -> TorchEngine:
        """This engine is its own prefix cache (its allocator's, over the real KV pool)."""
        return self

    def kv_layout(self) -> KvPoolLayout:
        return self._kv_layout

    @property
    def kv_device(self) -> str:
        return str(self.device)

    def kv_pool_tensor(self) -> torch.Tensor:
        if self.kv is None:
            raise EngineFailure("engine is not started")
        return self.kv.data

    def use_kv_buffer(self, buffer: memoryview) -> None:
        if self.device.type != "cpu":
            raise InvalidRequest("an external KV buffer is host memory; the engine runs on "
                                 f"{self.device}")
        if buffer.nbytes < self.kv_layout().size_bytes:
            raise InvalidRequest(f"KV buffer of {buffer.nbytes} bytes is smaller than the "
                                 f"pool ({self.kv_layout().size_bytes} bytes)")
        self._kv_buffer = buffer

    async def close(self) -> None:
        if self._thread is not None:
            await self._thread.stop()
            self._thread = None
        for future in [run for _, run in self._prefills.values()] + list(self._reserving):
            if not future.done():
                future.set_exception(EngineFailure("engine closed"))
        self._prefills.clear()

    def check(self, sampling: SamplingParams) -> None:
        """Every sampling control is served here (a grammar's own faults show in `prepare`)."""

    async def prepare(self, sampling: SamplingParams) -> None:
        """Compile the request's grammar off the engine thread (cached per spec), so that
        the step that admits it only builds a matcher; raises `InvalidRequest`."""
        if sampling.grammar is not None:
            await asyncio.to_thread(self.grammars.compile, sampling.grammar)

    # Prefill side.
    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        self._check_prompt(request.prompt_token_ids)
        await self.prepare(request.sampling)
        future: asyncio.Future[PrefillResult] = asyncio.get_running_loop().create_future()
        seq = new_sequence(request.request_id, request.prompt_token_ids, request.sampling,
                                 request.output_offset, request.priority)
        seq.is_prefill_only = True
        seq.on_layer = request.on_layer
        self._prefills[request.request_id] = (seq, future)
        self._submit(lambda: self.core.admit(seq))
        try:
            return await future
        except asyncio.CancelledError:  # its caller gave up on it: stop it, free its blocks
            self._submit(lambda: self.core.drop_sequence(seq))
            raise
        finally:
            if self._prefills.get(request.request_id, (None,))[0] is seq:
                del self._prefills[request.request_id]  # not a run placed again since

    def generate(self, request: PrefillRequest) -> None:
        """Prefill and decode here (colocated): every token, from index 0, comes out of
        `next_step`."""
        self._check_prompt(request.prompt_token_ids)
        n = request.sampling.n
        seq = new_sequence(choice_id(request.request_id, 0, n), request.prompt_token_ids,
                                 request.sampling, request.output_offset, request.priority)
        if n > 1:  # the other choices fork from it at its first token
            self._choices[request.request_id] = [
                choice_id(request.request_id, j, n) for j in range(n)]
        self._local.update(self._choices.get(request.request_id, [request.request_id]))
        self._submit(lambda: self.core.admit(seq))

    def release(self, request_id: str) -> None:
        self._submit(lambda: self.core.release_parked(request_id))

    # Decode side.
    def reserve(self, request_id: str, num_tokens: int, *, num_choices: int = 1,
                num_prompt_tokens: int = 0) -> list[int]:
        """The prompt's blocks and a block of headroom per choice, not `num_tokens`: the
        rest is taken as the choices grow (`BlockGrowth`)."""
        per_choice, own = choice_blocks(self.options.block_size, num_prompt_tokens, num_tokens)
        blocks = self.allocator.allocate(per_choice + (num_choices - 1) * own)
        self._reserved[request_id] = blocks
        return list(blocks)

    async def reserve_over(self, request_id: str, num_tokens: int, *, priority: int,
                           num_choices: int = 1, num_prompt_tokens: int = 0) -> list[int]:
        """`reserve` in the engine thread, between steps, preempting running sequences less
        urgent than `priority` when the pool is short (`BlockGrowth.allocate_over`): the
        blocks they free go to the reservation before any step takes them back."""
        per_choice, own = choice_blocks(self.options.block_size, num_prompt_tokens, num_tokens)
        count = per_choice + (num_choices - 1) * own
        future: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._reserving.add(future)
        self._submit(lambda: self.core.take_over(future, count, priority))
        try:
            blocks = await future
        finally:
            self._reserving.discard(future)
        self._reserved[request_id] = blocks
        return list(blocks)

    def join(self, request: DecodeRequest) -> None:
        blocks = self._reserved.pop(request.request_id, None)
        if blocks is None:
            raise InvalidRequest(f"request {request.request_id} has no reserved blocks")
        n = request.sampling.n
        if n > 1 and not request.is_kv_ready:
            self.allocator.free(blocks)
            raise InvalidRequest("n > 1 needs the prompt's KV from prefill")
        first_tokens = request.first_token_ids or [request.first_token_id]
        per_choice, _ = choice_blocks(self.options.block_size,
            len(request.prompt_token_ids),
            len(request.prompt_token_ids) + request.sampling.max_tokens)
        sequences = []
        for choice, token in enumerate(first_tokens):
            seq = new_sequence(choice_id(request.request_id, choice, n),
                                     [*request.prompt_token_ids, token], request.sampling,
                                     priority=request.priority)
            if seq.seed is not None and choice:
                seq.seed = sequences[0].seed + choice
            seq.num_prompt_tokens = len(request.prompt_token_ids)
            seq.output_start = seq.num_prompt_tokens - request.output_offset
            seq.num_generated = 1
            if request.is_kv_ready:
                seq.num_computed = seq.num_prompt_tokens
            sequences.append(seq)
        sequences[0].block_ids = blocks[:per_choice]
        own = blocks[per_choice:]
        if n > 1:
            self._choices[request.request_id] = [s.request_id for s in sequences]
        finished = set(request.finished_choices)
        self._submit(lambda: self.core.join(sequences, own, finished,
                                        is_kv_ready=request.is_kv_ready))

    async def next_step(self) -> list[TokenOutput]:
        outputs = await self._outputs.get()
        if self._crash is not None:
            raise EngineFailure(f"engine thread crashed: {self._crash!r}") from self._crash
        for output in outputs:
            if output.finish_reason is not None or output.error is not None:
                self._local.discard(output.request_id)
                self._forget_choice(output.request_id)
        return outputs

    def _forget_choice(self, request_id: str) -> None:
        parent = request_of(request_id)
        choices = self._choices.get(parent)
        if choices is not None and request_id in choices:
            choices.remove(request_id)
            if not choices:
                del self._choices[parent]

    def abort(self, request_id: str) -> bool:
        choices = self._choices.pop(request_id, [])
        for choice in choices:
            self.abort(choice)
        known = bool(choices) or (
            request_id in self._prefills or request_id in self._reserved
            or request_id in self._local
            or (self._core is not None and request_id in self._core.parked))
        self._local.discard(request_id)
        blocks = self._reserved.pop(request_id, None)
        if blocks is not None:
            self.allocator.free(blocks)
        run = self._prefills.pop(request_id, None)
        if run is not None and not run[1].done():
            run[1].cancel()
        self._submit(lambda: self.core.drop(request_id))
        return known

    def drain_kv_events(self) -> list[tuple[str, bytes]]:
        return self.allocator.drain_events()

    def held_block_hashes(self) -> list[bytes]:
        return self.allocator.held_hashes()

    # Prefix reuse across workers: blocks only, no compute; safe beside the engine thread
    # (the allocator is locked, and held or allocated blocks are no one else's).
    def num_cached_blocks(self, block_hashes: list[bytes]) -> int:
        return self.allocator.peek_prefix(block_hashes)

    def hold_prefix(self, block_hashes: list[bytes]) -> list[int]:
        return self.allocator.match_prefix(block_hashes)

    def release_blocks(self, block_ids: list[int]) -> None:
        self.allocator.free(block_ids)

    def allocate_blocks(self, count: int) -> list[int]:
        return self.allocator.allocate(count)

    def cache_blocks(self, block_ids: list[int], block_hashes: list[bytes]) -> None:
        self.allocator.cache(block_ids, block_hashes)

    def stats(self) -> EngineStats:
        overhead, per_token = self._times.prefill_cost.coefficients()
        decode_overhead, per_sequence = self._times.decode_cost.coefficients()
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_free_blocks=self.allocator.num_available,
            num_total_blocks=self.allocator.num_blocks,
            max_batch_size=self.options.max_batch_size,
            prefill_tokens_per_s=self._times.prefill_tokens_per_s,
            num_waiting_tokens=sum(s.num_uncomputed for s in list(self.scheduler.waiting)),
            decode_step_s=self._times.decode_step_s,
            decode_overhead_s=decode_overhead, decode_s_per_sequence=per_sequence,
            prefill_overhead_s=overhead, prefill_s_per_token=per_token,
            prefill_fit_age_s=self._times.prefill_cost.age_s(),
            busy_s=self._times.busy_s, num_prompt_tokens_computed=self._times.num_prompt_computed,
            num_preemptions=self._core.growth.num_preemptions if self._core is not None else 0,
            max_model_len=self.max_model_len,
            blocks_by_priority=by_priority(list(self.scheduler.running),
                                            lambda seq: len(seq.block_ids)),
            waiting_tokens_by_priority=by_priority(list(self.scheduler.waiting),
                                                    lambda seq: seq.num_uncomputed),
        )

    @property
    def core(self) -> EngineCore:
        if self._core is None:
            raise EngineFailure("engine is not started")
        return self._core

    @property
    def runner(self) -> ModelRunner:
        return self.core.runner

    # Helpers on the event-loop side.
    def _check_prompt(self, prompt: list[int]) -> None:
        if not prompt:
            raise InvalidRequest("empty prompt", param="prompt")
        if len(prompt) >= self.max_model_len:
            raise InvalidRequest(f"prompt of {len(prompt)} tokens does not fit the context of "
                                 f"{self.max_model_len}", param="prompt")
        if max(prompt) >= self.config.vocab_size or min(prompt) < 0:
            raise InvalidRequest(f"token ids must lie in [0, {self.config.vocab_size})",
                                 param="prompt")

    def _submit(self, command: Any) -> None:
        if self._thread is None:
            raise EngineFailure("engine is not running")
        self._thread.submit(command)

    def _post(self, callback: Any, *args: Any) -> None:
        """From the engine thread: `callback(*args)` on the event loop."""
        if self._thread is not None:
            self._thread.post(callback, *args)

    # Back on the event loop: the engine core's results (`LoopSide`).
    def put_outputs(self, outputs: list[TokenOutput]) -> None:
        self._outputs.put_nowait(outputs)

    def resolve_prefill(self, seq: Sequence, result: PrefillResult) -> None:
        run = self._prefills.get(seq.request_id)
        if run is not None and run[0] is seq and not run[1].done():
            run[1].set_result(result)
        else:  # aborted meanwhile, maybe placed here again since: the result is no one's
            self._submit(lambda: self.core.drop_sequence(seq))

    def hand_over(self, future: asyncio.Future[list[int]], blocks: list[int],
                  error: HalfmoonError | None) -> None:
        if future.done():  # its caller gave up (cancelled), or the engine closed
            self.allocator.free(blocks)
        elif error is not None:
            future.set_exception(error)
        else:
            future.set_result(blocks)

    def reject_prefill(self, seq: Sequence, error: HalfmoonError) -> None:
        run = self._prefills.get(seq.request_id)
        if run is not None and run[0] is seq and not run[1].done():
            run[1].set_exception(error)

    def _on_crash(self, exc: BaseException) -> None:
        self._crash = exc
        self._outputs.put_nowait([])
        for future in [run for _, run in self._prefills.values()] + list(self._reserving):
            if not future.done():
                future.set_exception(EngineFailure(f"engine thread crashed: {exc!r}"))


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():  # (its awaiter was cancelled)
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)

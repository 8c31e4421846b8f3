"""`TorchEngine`: the real engine, a torch model on a paged KV cache behind the `Engine`
protocol.

Threading: all model compute and all scheduler state live in one engine thread. The asyncio
side talks to it through `EngineThread` (the only bridge): it submits commands (closures run
in the thread between steps) and receives results posted back with `call_soon_threadsafe`.
Block allocation is the one thing both sides touch (`reserve` must answer at once), so the
allocator is guarded by a lock that is never held across a model step.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.block_allocator import BlockAllocator
from engine.bridge import EngineThread
from engine.kv_cache import KvCache
from engine.linear import policy_for
from engine.model import CausalLM
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner, Sampled
from engine.prefill_cost import PrefillCostFit
from engine.protocol import (
    DecodeRequest,
    EngineStats,
    KvLayout,
    PrefillRequest,
    PrefillResult,
    TokenOutput,
)
from engine.sampler import make_generator
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.stopping import finish_reason
from engine.weights import load_weights
from shared.errors import EngineFailure, HalfmoonError, InvalidRequest


@dataclass(frozen=True)
class EngineOptions:
    model_dir: Path
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    num_blocks: int = 1024
    block_size: int = 16
    max_batch_size: int = 64
    max_batch_tokens: int = 2048
    max_wait_s: float = 0.01
    max_model_len: int | None = None
    is_prefix_caching: bool = True


class LockedAllocator(BlockAllocator):
    """The allocator, safe to call from the event loop and the engine thread."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks, on_event=self._record)
        self.lock = threading.RLock()
        self._events: list[tuple[str, bytes]] = []

    def _record(self, kind: str, block_hash: bytes) -> None:
        self._events.append((kind, block_hash))  # called under self.lock

    def drain_events(self) -> list[tuple[str, bytes]]:
        with self.lock:
            events, self._events = self._events, []
        return events

    def allocate(self, count: int) -> list[int]:
        with self.lock:
            return super().allocate(count)

    def free(self, block_ids: Any) -> None:
        with self.lock:
            super().free(block_ids)

    def match_prefix(self, hashes: Any) -> list[int]:
        with self.lock:
            return super().match_prefix(hashes)

    def register(self, block: int, block_hash: bytes) -> None:
        with self.lock:
            super().register(block, block_hash)

    def peek_prefix(self, hashes: Any) -> int:
        with self.lock:
            return super().peek_prefix(hashes)

    def cache(self, block_ids: Any, hashes: Any) -> None:
        with self.lock:  # reentrant: cache() calls register() and free()
            super().cache(block_ids, hashes)


class TorchEngine:
    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self.config = ModelConfig.from_dir(options.model_dir)
        self.device = torch.device(options.device)
        # Full attention equals sliding-window attention only inside the window: cap there.
        self.max_model_len = min(options.max_model_len or self.config.max_position_embeddings,
                                 self.config.max_position_embeddings,
                                 self.config.sliding_window or self.config.max_position_embeddings)
        self.allocator = LockedAllocator(options.num_blocks)
        self.scheduler = Scheduler(max_batch_tokens=options.max_batch_tokens,
                                   max_batch_size=options.max_batch_size,
                                   max_wait_s=options.max_wait_s)
        self.kv: KvCache | None = None
        self._runner: ModelRunner | None = None
        self._thread: EngineThread | None = None
        self._prefills: dict[str, asyncio.Future[PrefillResult]] = {}
        self._parked: dict[str, Sequence] = {}  # prefilled, KV held until release()
        self._reserved: dict[str, list[int]] = {}
        self._local: set[str] = set()  # colocated requests (generate)
        self._outputs: asyncio.Queue[list[TokenOutput]] = asyncio.Queue()
        self._crash: BaseException | None = None
        self._prefill_tokens_per_s = 0.0
        self._decode_step_s = 0.0
        self._busy_s = 0.0
        self._prefill_cost = PrefillCostFit()
        self._kv_buffer: memoryview | None = None
        itemsize = torch.empty((), dtype=options.dtype).element_size()
        self._kv_layout = KvLayout(
            num_layers=self.config.num_layers, num_blocks=options.num_blocks,
            block_bytes=options.block_size * self.config.num_kv_heads * self.config.head_dim
            * itemsize)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.config.eos_token_ids

    # Lifecycle.
    async def start(self) -> None:
        model = await asyncio.to_thread(self._load_model)
        self.kv = KvCache(
            num_layers=self.config.num_layers, num_blocks=self.options.num_blocks,
            block_size=self.options.block_size, num_kv_heads=self.config.num_kv_heads,
            head_dim=self.config.head_dim, dtype=self.options.dtype, device=self.device,
            storage=self._kv_storage(),
        )
        self._runner = ModelRunner(model, self.kv, self.allocator, device=self.device,
                                   is_prefix_caching=self.options.is_prefix_caching)
        self._thread = EngineThread(asyncio.get_running_loop(), self._step, self._on_crash,
                                    name="engine")
        self._thread.start()

    def kv_layout(self) -> KvLayout:
        return self._kv_layout

    def use_kv_buffer(self, buffer: memoryview) -> None:
        if self.device.type != "cpu":
            raise InvalidRequest("an external KV buffer is host memory; the engine runs on "
                                 f"{self.device}")
        if buffer.nbytes < self.kv_layout().size_bytes:
            raise InvalidRequest(f"KV buffer of {buffer.nbytes} bytes is smaller than the "
                                 f"pool ({self.kv_layout().size_bytes} bytes)")
        self._kv_buffer = buffer

    def _kv_storage(self) -> torch.Tensor | None:
        if self._kv_buffer is None:
            return None
        shape = (self.config.num_layers, 2, self.options.num_blocks, self.options.block_size,
                 self.config.num_kv_heads, self.config.head_dim)
        flat = torch.frombuffer(self._kv_buffer, dtype=torch.uint8)
        return flat[:self.kv_layout().size_bytes].view(self.options.dtype).view(shape)

    def _load_model(self) -> CausalLM:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = CausalLM(self.config)
        model = model.to_empty(device=self.device).to(self.options.dtype)
        load_weights(model, self.options.model_dir, self.options.dtype)
        model.set_gemm_policy(policy_for(self.device, self.options.dtype))
        model.init_rope(self.max_model_len, self.device)
        return model.eval()

    async def close(self) -> None:
        if self._thread is not None:
            await self._thread.stop()
            self._thread = None
        for future in self._prefills.values():
            if not future.done():
                future.set_exception(EngineFailure("engine closed"))
        self._prefills.clear()

    # Prefill side.
    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        self._check_prompt(request.prompt_token_ids)
        future: asyncio.Future[PrefillResult] = asyncio.get_running_loop().create_future()
        self._prefills[request.request_id] = future
        seq = self._new_sequence(request.request_id, request.prompt_token_ids, request.sampling)
        seq.is_prefill_only = True
        seq.on_layer = request.on_layer
        self._submit(lambda: self._admit(seq))
        try:
            return await future
        finally:
            self._prefills.pop(request.request_id, None)

    def generate(self, request: PrefillRequest) -> None:
        """Prefill and decode here (colocated): every token, from index 0, comes out of
        `next_step`."""
        self._check_prompt(request.prompt_token_ids)
        seq = self._new_sequence(request.request_id, request.prompt_token_ids, request.sampling)
        self._local.add(request.request_id)
        self._submit(lambda: self._admit(seq))

    def release(self, request_id: str) -> None:
        self._submit(lambda: self._release_parked(request_id))

    # Decode side.
    def reserve(self, request_id: str, num_tokens: int) -> list[int]:
        blocks = self.allocator.allocate(math.ceil(num_tokens / self.options.block_size))
        self._reserved[request_id] = blocks
        return list(blocks)

    def join(self, request: DecodeRequest) -> None:
        blocks = self._reserved.pop(request.request_id, None)
        if blocks is None:
            raise InvalidRequest(f"request {request.request_id} has no reserved blocks")
        seq = self._new_sequence(request.request_id,
                                 [*request.prompt_token_ids, request.first_token_id],
                                 request.sampling)
        seq.num_prompt_tokens = len(request.prompt_token_ids)
        seq.num_generated = 1
        seq.block_ids = blocks
        if request.is_kv_ready:
            seq.num_computed = seq.num_prompt_tokens
            self._submit(lambda: self.scheduler.add_running(seq))
        else:
            self._submit(lambda: self.scheduler.add_waiting(seq))

    async def next_step(self) -> list[TokenOutput]:
        outputs = await self._outputs.get()
        if self._crash is not None:
            raise EngineFailure(f"engine thread crashed: {self._crash!r}") from self._crash
        for output in outputs:
            if output.finish_reason is not None or output.error is not None:
                self._local.discard(output.request_id)
        return outputs

    def abort(self, request_id: str) -> bool:
        known = (request_id in self._prefills or request_id in self._reserved
                 or request_id in self._parked or request_id in self._local)
        self._local.discard(request_id)
        blocks = self._reserved.pop(request_id, None)
        if blocks is not None:
            self.allocator.free(blocks)
        future = self._prefills.pop(request_id, None)
        if future is not None and not future.done():
            future.cancel()
        self._submit(lambda: self._drop(request_id))
        return known

    def drain_kv_events(self) -> list[tuple[str, bytes]]:
        return self.allocator.drain_events()

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
        overhead, per_token = self._prefill_cost.coefficients()
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_free_blocks=self.allocator.num_available,
            num_total_blocks=self.allocator.num_blocks,
            max_batch_size=self.options.max_batch_size,
            prefill_tokens_per_s=self._prefill_tokens_per_s,
            num_waiting_tokens=sum(s.num_uncomputed for s in list(self.scheduler.waiting)),
            decode_step_s=self._decode_step_s,
            prefill_overhead_s=overhead, prefill_s_per_token=per_token, busy_s=self._busy_s,
        )

    @property
    def runner(self) -> ModelRunner:
        if self._runner is None:
            raise EngineFailure("engine is not started")
        return self._runner

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

    def _new_sequence(self, request_id: str, token_ids: list[int], sampling: Any) -> Sequence:
        return Sequence(request_id=request_id, token_ids=list(token_ids),
                        num_prompt_tokens=len(token_ids), sampling=sampling,
                        generator=make_generator(sampling, self.device),
                        arrived_at_s=time.monotonic())

    def _submit(self, command: Any) -> None:
        if self._thread is None:
            raise EngineFailure("engine is not running")
        self._thread.submit(command)

    # In the engine thread.
    def _admit(self, seq: Sequence) -> None:
        try:
            reserve = seq.num_tokens if seq.is_prefill_only else min(
                self.max_model_len, seq.num_prompt_tokens + seq.sampling.max_tokens)
            self.runner.admit(seq, reserve)
        except HalfmoonError as exc:
            if seq.is_prefill_only:
                self._post_prefill_error(seq.request_id, exc)
            else:
                self._post(self._outputs.put_nowait,
                           [TokenOutput(seq.request_id, 0, -1, None, error=exc)])
            return
        self.scheduler.add_waiting(seq)

    def _step(self) -> bool:
        """Run one scheduled batch; False when there is nothing to do."""
        batch = self.scheduler.schedule(time.monotonic())
        if batch is None:
            return False
        started = time.perf_counter()
        if batch.is_prefill:  # a prompt's compute time is read when it completes
            for seq in batch.sequences:
                seq.compute_started_at = seq.compute_started_at or started
        try:
            sampled = self.runner.execute(batch)
        except HalfmoonError as exc:
            self._fail_batch(batch.sequences, exc)
            return True
        self._measure(batch.is_prefill, sum(batch.num_new_tokens),
                      time.perf_counter() - started)
        outputs = [out for s in sampled if (out := self._on_sampled(s)) is not None]
        if outputs:
            self._post(self._outputs.put_nowait, outputs)
        return True

    def _measure(self, is_prefill: bool, num_tokens: int, elapsed_s: float) -> None:
        """Moving averages the conductor's cost model reads from heartbeats."""
        self._busy_s += elapsed_s
        if is_prefill:
            self._prefill_cost.observe(num_tokens, elapsed_s)
            rate = num_tokens / max(elapsed_s, 1e-9)
            old = self._prefill_tokens_per_s
            self._prefill_tokens_per_s = rate if old == 0 else 0.8 * old + 0.2 * rate
        else:
            old = self._decode_step_s
            self._decode_step_s = elapsed_s if old == 0 else 0.8 * old + 0.2 * elapsed_s

    def _on_sampled(self, sampled: Sampled) -> TokenOutput | None:
        seq = sampled.seq
        if seq in self.scheduler.waiting:
            self.scheduler.finish_prefill(seq)
            if not seq.is_prefill_only:
                self.scheduler.add_running(seq)
        seq.token_ids.append(sampled.token_id)
        seq.num_generated += 1
        reason = finish_reason(sampled.token_id, seq.num_generated, seq.sampling,
                               self.eos_token_ids)
        if reason is None and seq.num_tokens >= self.max_model_len:
            reason = "length"
        if seq.is_prefill_only:
            self._parked[seq.request_id] = seq
            result = PrefillResult(seq.request_id, sampled.token_id, list(seq.block_ids),
                                   reason, sampled.logprob, seq.num_cached,
                                   time.perf_counter() - seq.compute_started_at)
            self._post(self._resolve_prefill, result)
            return None
        if reason is not None:
            self.scheduler.remove(seq.request_id)
            self.runner.free(seq)
        return TokenOutput(seq.request_id, seq.num_generated - 1, sampled.token_id, reason,
                           sampled.logprob,
                           num_cached_tokens=seq.num_cached if seq.num_generated == 1 else 0)

    def _fail_batch(self, sequences: list[Sequence], error: HalfmoonError) -> None:
        outputs = []
        for seq in sequences:
            self.scheduler.remove(seq.request_id)
            self.runner.free(seq)
            if seq.is_prefill_only:
                self._post_prefill_error(seq.request_id, error)
            else:
                outputs.append(TokenOutput(seq.request_id, seq.num_generated, -1, None,
                                           error=error))
        if outputs:
            self._post(self._outputs.put_nowait, outputs)

    def _release_parked(self, request_id: str) -> None:
        seq = self._parked.pop(request_id, None)
        if seq is not None:
            self.runner.free(seq)

    def _drop(self, request_id: str) -> None:
        seq = self.scheduler.remove(request_id) or self._parked.pop(request_id, None)
        if seq is not None:
            self.runner.free(seq)

    def _post(self, callback: Any, *args: Any) -> None:
        if self._thread is not None:
            self._thread.post(callback, *args)

    def _post_prefill_error(self, request_id: str, error: HalfmoonError) -> None:
        self._post(self._reject_prefill, request_id, error)

    # Back on the event loop.
    def _resolve_prefill(self, result: PrefillResult) -> None:
        future = self._prefills.get(result.request_id)
        if future is not None and not future.done():
            future.set_result(result)
        elif future is None:  # aborted meanwhile
            self.release(result.request_id)

    def _on_crash(self, exc: BaseException) -> None:
        self._crash = exc
        self._outputs.put_nowait([])
        for future in self._prefills.values():
            if not future.done():
                future.set_exception(EngineFailure(f"engine thread crashed: {exc!r}"))

    def _reject_prefill(self, request_id: str, error: HalfmoonError) -> None:
        future = self._prefills.get(request_id)
        if future is not None and not future.done():
            future.set_exception(error)

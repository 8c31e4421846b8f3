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
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch

from engine.block_allocator import LockedAllocator
from engine.block_growth import BlockGrowth
from engine.bridge import EngineThread
from engine.decode_graphs import DecodeGraphs, cuda_capture, eager_capture
from engine.grammar import Grammars
from engine.kv_budget import pool_blocks
from engine.kv_cache import KvCache
from engine.linear import policy_for
from engine.model import CausalLM
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner, Sampled
from engine.prefill_cost import PrefillCostFit
from engine.protocol import (
    DecodeRequest,
    EngineStats,
    FirstToken,
    PrefillRequest,
    PrefillResult,
    TokenOutput,
)
from engine.sampler import Pick, base_seed
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.stopping import finish_reason
from engine.weights import load_weights
from shared.errors import (
    ConfigError,
    EngineFailure,
    HalfmoonError,
    InvalidRequest,
)
from shared.logs import get_logger
from shared.messages import FinishReason, KvPoolLayout, SamplingParams, choice_id, request_of

log = get_logger(__name__)


@dataclass(frozen=True)
class EngineOptions:
    model_dir: Path
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    attention_backend: str = "auto"  # engine.attention.BACKENDS
    cpu_weights: str = "packed"  # engine.linear.policy_for
    num_blocks: int = 1024  # unless a memory budget below sizes the pool (engine.kv_budget)
    kv_cache_memory_gb: float = 0.0
    gpu_memory_utilization: float = 0.0
    # A colocated request's blocks: taken as it grows ("growth"), or for prompt + max_tokens
    # when it is admitted ("up-front": the engine's earlier policy, the memory benchmark's
    # baseline; it never preempts).
    kv_reservation: str = "growth"
    block_size: int = 16
    max_batch_size: int = 64
    max_batch_tokens: int = 2048
    max_wait_s: float = 0.01
    max_model_len: int | None = None
    is_prefix_caching: bool = True
    # Decode steps replayed as CUDA graphs ("cuda", `--cuda-graphs`), or through the same
    # static buffers without a graph ("eager": how they are checked on a CPU).
    decode_graphs: str = "off"


class TorchEngine:
    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self.config = ModelConfig.from_dir(options.model_dir)
        self.device = torch.device(options.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"--device {options.device}: this torch build sees no CUDA device "
                              f"(torch {torch.__version__})")
        if options.decode_graphs == "cuda" and self.device.type != "cuda":  # before any load
            raise ConfigError(f"--cuda-graphs needs a CUDA device, not {self.device}")
        # Full attention equals sliding-window attention only inside the window: cap there.
        self.max_model_len = min(options.max_model_len or self.config.max_position_embeddings,
                                 self.config.max_position_embeddings,
                                 self.config.sliding_window or self.config.max_position_embeddings)
        layout = KvPoolLayout(
            num_layers=self.config.num_layers, num_blocks=options.num_blocks,
            block_size=options.block_size, num_kv_heads=self.config.num_kv_heads,
            head_dim=self.config.head_dim, dtype=str(options.dtype).removeprefix("torch."))
        self.num_blocks = pool_blocks(
            self.config, layout, device=self.device,
            kv_cache_memory_gb=options.kv_cache_memory_gb,
            gpu_memory_utilization=options.gpu_memory_utilization)
        self._kv_layout = msgspec.structs.replace(layout, num_blocks=self.num_blocks)
        self.max_model_len = self._fit_to_pool(self.max_model_len)
        self.allocator = LockedAllocator(self.num_blocks)
        self.grammars = Grammars(options.model_dir, self.config.vocab_size,
                                 self.config.eos_token_ids)
        self.scheduler = Scheduler(max_batch_tokens=options.max_batch_tokens,
                                   max_batch_size=options.max_batch_size,
                                   max_wait_s=options.max_wait_s)
        self.kv: KvCache | None = None
        self._runner: ModelRunner | None = None
        self._growth: BlockGrowth | None = None
        self._thread: EngineThread | None = None
        # A prefill's run, by request id: its sequence (a run placed again after an abort
        # makes a new one) and the future its caller awaits.
        self._prefills: dict[str, tuple[Sequence, asyncio.Future[PrefillResult]]] = {}
        self._reserving: set[asyncio.Future[list[int]]] = set()  # `reserve_over`s under way
        self._parked: dict[str, Sequence] = {}  # prefilled, KV held until release()
        self._reserved: dict[str, list[int]] = {}
        self._local: set[str] = set()  # colocated requests (generate)
        self._choices: dict[str, list[str]] = {}  # n > 1: a request's choice ids
        self._outputs: asyncio.Queue[list[TokenOutput]] = asyncio.Queue()
        self._crash: BaseException | None = None
        self._prefill_tokens_per_s = 0.0
        self._decode_step_s = 0.0
        self._busy_s = 0.0
        self._num_prompt_computed = 0
        self._prefill_cost = PrefillCostFit()
        self._kv_buffer: memoryview | None = None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.config.eos_token_ids

    def _fit_to_pool(self, max_model_len: int) -> int:
        """The context capped at what the whole KV pool holds: a sequence that outgrew the
        pool could only preempt itself, and then wait forever to be computed again."""
        pool_tokens = self.num_blocks * self.options.block_size
        if pool_tokens >= max_model_len:
            return max_model_len
        log.warning("engine.max_model_len_capped", max_model_len=pool_tokens,
                    model_max_model_len=max_model_len, num_blocks=self.num_blocks,
                    block_size=self.options.block_size)
        return pool_tokens

    # Lifecycle.
    async def start(self) -> None:
        model = await asyncio.to_thread(self._load_model)
        self.kv = KvCache(
            num_layers=self.config.num_layers, num_blocks=self.num_blocks,
            block_size=self.options.block_size, num_kv_heads=self.config.num_kv_heads,
            head_dim=self.config.head_dim, dtype=self.options.dtype, device=self.device,
            storage=self._kv_storage(),
        )
        self._runner = ModelRunner(model, self.kv, self.allocator, device=self.device,
                                   is_prefix_caching=self.options.is_prefix_caching,
                                   eos_token_ids=self.eos_token_ids)
        self._runner.graphs = self._decode_graphs(model, self.kv)
        self._growth = BlockGrowth(self._runner, self.scheduler, self.allocator,
                                   max_model_len=self.max_model_len,
                                   is_up_front=self.options.kv_reservation == "up-front")
        if self._runner.graphs is not None:  # before anything else runs on the device
            await asyncio.to_thread(self._runner.graphs.capture_all)
        self._thread = EngineThread(asyncio.get_running_loop(), self._step, self._on_crash,
                                    name="engine")
        self._thread.start()

    def _decode_graphs(self, model: CausalLM, kv: KvCache) -> DecodeGraphs | None:
        mode = self.options.decode_graphs
        if mode == "off":
            return None
        if model.attention is None or model.attention.name != "torch" or self.config.moe:
            raise ConfigError("decode graphs need --attention-backend torch and a dense model "
                              "(mixture-of-experts routing has data-dependent shapes)")
        # Never freed: the padding rows of every graph write their K/V here.
        pad_block = self.allocator.allocate(1)[0]
        capture = cuda_capture(torch.cuda.graph_pool_handle()) if mode == "cuda" \
            else eager_capture
        return DecodeGraphs(lambda ids, positions, meta: model(ids, positions, meta, kv), kv,
                            self.device, pad_block,
                            max_batch_size=self.options.max_batch_size,
                            max_context=self.max_model_len, capture=capture)

    @property
    def num_decode_graphs(self) -> int:
        """Decode graphs captured (at start; 0 without `decode_graphs`)."""
        graphs = self._runner.graphs if self._runner is not None else None
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

    def _kv_storage(self) -> torch.Tensor | None:
        if self._kv_buffer is None:
            return None
        shape = (self.config.num_layers, 2, self.num_blocks, self.options.block_size,
                 self.config.num_kv_heads, self.config.head_dim)
        flat = torch.frombuffer(self._kv_buffer, dtype=torch.uint8)
        return flat[:self.kv_layout().size_bytes].view(self.options.dtype).view(shape)

    def _load_model(self) -> CausalLM:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = CausalLM(self.config)
        model = model.to_empty(device=self.device).to(self.options.dtype)
        load_weights(model, self.options.model_dir, self.options.dtype)
        model.set_gemm_policy(policy_for(self.device, self.options.dtype,
                                         self.options.cpu_weights))
        model.init_runtime(self.max_model_len, self.device, self.options.attention_backend)
        return model.eval()

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
        seq = self._new_sequence(request.request_id, request.prompt_token_ids, request.sampling,
                                 request.output_offset, request.priority)
        seq.is_prefill_only = True
        seq.on_layer = request.on_layer
        self._prefills[request.request_id] = (seq, future)
        self._submit(lambda: self._admit(seq))
        try:
            return await future
        except asyncio.CancelledError:  # its caller gave up on it: stop it, free its blocks
            self._submit(lambda: self._drop_sequence(seq))
            raise
        finally:
            if self._prefills.get(request.request_id, (None,))[0] is seq:
                del self._prefills[request.request_id]  # not a run placed again since

    def generate(self, request: PrefillRequest) -> None:
        """Prefill and decode here (colocated): every token, from index 0, comes out of
        `next_step`."""
        self._check_prompt(request.prompt_token_ids)
        n = request.sampling.n
        seq = self._new_sequence(choice_id(request.request_id, 0, n), request.prompt_token_ids,
                                 request.sampling, request.output_offset, request.priority)
        if n > 1:  # the other choices fork from it at its first token
            self._choices[request.request_id] = [
                choice_id(request.request_id, j, n) for j in range(n)]
        self._local.update(self._choices.get(request.request_id, [request.request_id]))
        self._submit(lambda: self._admit(seq))

    def release(self, request_id: str) -> None:
        self._submit(lambda: self._release_parked(request_id))

    # Decode side.
    def reserve(self, request_id: str, num_tokens: int, *, num_choices: int = 1,
                num_prompt_tokens: int = 0) -> list[int]:
        """The prompt's blocks and a block of headroom per choice, not `num_tokens`: the
        rest is taken as the choices grow (`BlockGrowth`)."""
        per_choice, own = self._choice_blocks(num_prompt_tokens, num_tokens)
        blocks = self.allocator.allocate(per_choice + (num_choices - 1) * own)
        self._reserved[request_id] = blocks
        return list(blocks)

    async def reserve_over(self, request_id: str, num_tokens: int, *, priority: int,
                           num_choices: int = 1, num_prompt_tokens: int = 0) -> list[int]:
        """`reserve` in the engine thread, between steps, preempting running sequences less
        urgent than `priority` when the pool is short (`BlockGrowth.allocate_over`): the
        blocks they free go to the reservation before any step takes them back."""
        per_choice, own = self._choice_blocks(num_prompt_tokens, num_tokens)
        count = per_choice + (num_choices - 1) * own
        future: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._reserving.add(future)
        self._submit(lambda: self._take_over(future, count, priority))
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
        per_choice, _ = self._choice_blocks(
            len(request.prompt_token_ids),
            len(request.prompt_token_ids) + request.sampling.max_tokens)
        sequences = []
        for choice, token in enumerate(first_tokens):
            seq = self._new_sequence(choice_id(request.request_id, choice, n),
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
        self._submit(lambda: self._join(sequences, own, finished,
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

    def _choice_blocks(self, num_prompt_tokens: int, num_tokens: int) -> tuple[int, int]:
        """The first blocks of a choice that may reach `num_tokens` (prompt and output): the
        prompt's and one block of headroom, all of them, and its own (beyond the full prompt
        blocks it shares with the request's other choices). It grows from there."""
        first = num_tokens if num_prompt_tokens == 0 else min(  # 0: unknown, all of it
            num_tokens, num_prompt_tokens + self.options.block_size)
        per_choice = math.ceil(first / self.options.block_size)
        return per_choice, per_choice - num_prompt_tokens // self.options.block_size

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
            or request_id in self._parked or request_id in self._local)
        self._local.discard(request_id)
        blocks = self._reserved.pop(request_id, None)
        if blocks is not None:
            self.allocator.free(blocks)
        run = self._prefills.pop(request_id, None)
        if run is not None and not run[1].done():
            run[1].cancel()
        self._submit(lambda: self._drop(request_id))
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
            num_prompt_tokens_computed=self._num_prompt_computed,
            num_preemptions=self._growth.num_preemptions if self._growth is not None else 0,
            max_model_len=self.max_model_len,
            blocks_by_priority=_by_priority(list(self.scheduler.running),
                                            lambda seq: len(seq.block_ids)),
            waiting_tokens_by_priority=_by_priority(list(self.scheduler.waiting),
                                                    lambda seq: seq.num_uncomputed),
        )

    @property
    def runner(self) -> ModelRunner:
        if self._runner is None:
            raise EngineFailure("engine is not started")
        return self._runner

    @property
    def growth(self) -> BlockGrowth:
        if self._growth is None:
            raise EngineFailure("engine is not started")
        return self._growth

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

    def _new_sequence(self, request_id: str, token_ids: list[int], sampling: Any,
                      output_offset: int = 0, priority: int = 0) -> Sequence:
        return Sequence(request_id=request_id, token_ids=list(token_ids),
                        num_prompt_tokens=len(token_ids), sampling=sampling,
                        seed=base_seed(sampling),
                        arrived_at_s=time.monotonic(),
                        output_start=len(token_ids) - output_offset, priority=priority)

    def _submit(self, command: Any) -> None:
        if self._thread is None:
            raise EngineFailure("engine is not running")
        self._thread.submit(command)

    # In the engine thread.
    def _attach_grammar(self, seq: Sequence) -> None:
        """The sequence's grammar matcher, past the output it already has (a decode
        worker's first token from prefill, a continuation's streamed tokens)."""
        if seq.sampling.grammar is not None:
            seq.matcher = self.grammars.matcher(seq.sampling.grammar,
                                                seq.token_ids[seq.output_start:])

    def _join(self, sequences: list[Sequence], own_blocks: list[int], finished: set[int], *,
              is_kv_ready: bool) -> None:
        """The request's KV is in the first sequence's blocks: fork it to the other choices
        (`_fork`, taking their blocks from `own_blocks`), and run every choice still open."""
        first = sequences[0]
        per_fork = len(own_blocks) // max(1, len(sequences) - 1)
        for index, seq in enumerate(sequences[1:]):
            self._fork(first, seq, own_blocks[index * per_fork:(index + 1) * per_fork])
        for choice, seq in enumerate(sequences):
            self.growth.mark_admitted(seq)
            if choice in finished:
                self.runner.free(seq)
                continue
            try:
                self._attach_grammar(seq)
            except HalfmoonError as exc:
                self.runner.free(seq)
                self._post(self._outputs.put_nowait, [
                    TokenOutput(seq.request_id, seq.num_generated, -1, None, error=exc)])
                continue
            if is_kv_ready:
                self.scheduler.add_running(seq)
            else:
                self.scheduler.add_waiting(seq)

    def _fork(self, source: Sequence, fork: Sequence, own_blocks: list[int]) -> None:
        """Give `fork` the prompt KV of `source`: its full prompt blocks shared (one more
        reference each), the partly filled last one copied into the fork's first own block
        (both will write into it), then the fork's own blocks to grow into."""
        num_full = source.num_prompt_tokens // self.options.block_size
        shared = source.block_ids[:num_full]
        self.allocator.share(shared)
        if source.num_prompt_tokens % self.options.block_size and self.kv is not None:
            self.kv.copy_block(source.block_ids[num_full], own_blocks[0])
        fork.block_ids = [*shared, *own_blocks]

    def _admit(self, seq: Sequence) -> None:
        """Queue a new prompt; it takes blocks when its steps run (`BlockGrowth`). None
        outgrows the pool alone: the context is capped at it (`_fit_to_pool`)."""
        try:
            self._attach_grammar(seq)
        except HalfmoonError as exc:
            if seq.is_prefill_only:
                self._post(self._reject_prefill, seq, exc)
            else:
                self._post(self._outputs.put_nowait,
                           [TokenOutput(seq.request_id, 0, -1, None, error=exc)])
            return
        self.scheduler.add_waiting(seq)

    def _step(self) -> bool:
        """Run one scheduled batch; False when there is nothing to do (or nothing can run
        until blocks are freed: a release, an abort or a join wakes the thread)."""
        batch = self.scheduler.schedule(time.monotonic())
        if batch is not None and batch.is_prefill:
            batch = self.growth.secure(batch) or self.scheduler.decode_batch()
        if batch is not None and not batch.is_prefill:
            batch = self.growth.secure(batch)
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
        outputs = [out for s in sampled for out in self._on_sampled(s)]
        if outputs:
            self._post(self._outputs.put_nowait, outputs)
        return True

    def _measure(self, is_prefill: bool, num_tokens: int, elapsed_s: float) -> None:
        """Moving averages the conductor's cost model reads from heartbeats."""
        self._busy_s += elapsed_s
        if is_prefill:
            self._num_prompt_computed += num_tokens
            self._prefill_cost.observe(num_tokens, elapsed_s)
            rate = num_tokens / max(elapsed_s, 1e-9)
            old = self._prefill_tokens_per_s
            self._prefill_tokens_per_s = rate if old == 0 else 0.8 * old + 0.2 * rate
        else:
            old = self._decode_step_s
            self._decode_step_s = elapsed_s if old == 0 else 0.8 * old + 0.2 * elapsed_s

    def _on_sampled(self, sampled: Sampled) -> list[TokenOutput]:
        seq = sampled.seq
        if seq in self.scheduler.waiting:
            self.scheduler.finish_prefill(seq)
            if not seq.is_prefill_only:
                self.scheduler.add_running(seq)
        # Colocated n > 1: the other choices fork off the prompt before it grows.
        forks = ([] if seq.is_prefill_only or not sampled.forks
                 else self._fork_choices(seq, sampled.forks))
        seq.token_ids.append(sampled.token_id)
        seq.num_generated += 1
        reason = self._finish_reason(seq, sampled.token_id)
        prompt_logprobs = (seq.prompt_logprobs if seq.sampling.prompt_logprobs is not None
                           and seq.num_generated == 1 else None)
        if seq.is_prefill_only:
            self._parked[seq.request_id] = seq
            result = PrefillResult(
                seq.request_id, sampled.token_id, list(seq.block_ids), reason, sampled.logprob,
                seq.num_cached, time.perf_counter() - seq.compute_started_at, prompt_logprobs,
                forks=[FirstToken(p.token_id, p.logprob, finish_reason(
                    p.token_id, 1, seq.sampling, self.eos_token_ids)) for p in sampled.forks])
            self._post(self._resolve_prefill, seq, result)
            return []
        if reason is not None:
            self.scheduler.remove(seq.request_id)
            self.runner.free(seq)
        return [TokenOutput(seq.request_id, seq.num_generated - 1, sampled.token_id, reason,
                            sampled.logprob,
                            num_cached_tokens=seq.num_cached if seq.num_generated == 1 else 0,
                            prompt_logprobs=prompt_logprobs), *forks]

    def _finish_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        reason = finish_reason(token_id, seq.num_generated, seq.sampling, self.eos_token_ids)
        if reason is None and seq.matcher is not None and seq.matcher.is_terminated:
            reason = "stop"  # the output is complete in its grammar
        if reason is None and seq.num_tokens >= self.max_model_len:
            reason = "length"
        return reason

    def _fork_choices(self, seq: Sequence, picks: list[Pick]) -> list[TokenOutput]:
        """Colocated n > 1, at the first token: choices 1..n-1 of `seq` (choice 0), each
        with the prompt's KV (`_fork`), blocks of its own, and its first token."""
        parent, n = request_of(seq.request_id), seq.sampling.n
        num_prompt = seq.num_prompt_tokens
        _, num_own = self._choice_blocks(
            num_prompt, min(self.max_model_len, num_prompt + seq.sampling.max_tokens))
        outputs = []
        for choice, pick in enumerate(picks, start=1):
            fork = self._new_sequence(choice_id(parent, choice, n), seq.token_ids[:num_prompt],
                                      seq.sampling, priority=seq.priority)
            fork.seed = None if seq.seed is None else seq.seed + choice
            fork.output_start, fork.num_cached = seq.output_start, seq.num_cached
            try:
                own = self.growth.allocate(num_own, keep=seq)
            except HalfmoonError as exc:
                outputs.append(TokenOutput(fork.request_id, 0, -1, None, error=exc))
                continue
            self._fork(seq, fork, own)
            self.growth.mark_admitted(fork)
            fork.num_computed = num_prompt
            fork.token_ids.append(pick.token_id)
            fork.num_generated = 1
            self._attach_grammar(fork)
            reason = self._finish_reason(fork, pick.token_id)
            if reason is None:
                self.scheduler.add_running(fork)
            else:
                self.runner.free(fork)
            outputs.append(TokenOutput(fork.request_id, 0, pick.token_id, reason, pick.logprob,
                                       num_cached_tokens=seq.num_cached))
        return outputs

    def _fail_batch(self, sequences: list[Sequence], error: HalfmoonError) -> None:
        outputs = []
        for seq in sequences:
            self.scheduler.remove(seq.request_id)
            self.runner.free(seq)
            if seq.is_prefill_only:
                self._post(self._reject_prefill, seq, error)
            else:
                outputs.append(TokenOutput(seq.request_id, seq.num_generated, -1, None,
                                           error=error))
        if outputs:
            self._post(self._outputs.put_nowait, outputs)

    def _release_parked(self, request_id: str) -> None:
        seq = self._parked.pop(request_id, None)
        if seq is not None:
            self.runner.free(seq)

    def _drop_sequence(self, seq: Sequence) -> None:
        """Free this run of a request wherever it is, queued or parked; a later run of the
        same request is not touched."""
        if self._parked.get(seq.request_id) is seq:
            del self._parked[seq.request_id]
        elif not self.scheduler.discard(seq):
            return
        self.runner.free(seq)

    def _take_over(self, future: asyncio.Future[list[int]], count: int, priority: int) -> None:
        try:
            self._post(self._hand_over, future, self.growth.allocate_over(count, priority), None)
        except HalfmoonError as exc:
            self._post(self._hand_over, future, [], exc)

    def _drop(self, request_id: str) -> None:
        seq = self.scheduler.remove(request_id) or self._parked.pop(request_id, None)
        if seq is not None:
            self.runner.free(seq)

    def _post(self, callback: Any, *args: Any) -> None:
        if self._thread is not None:
            self._thread.post(callback, *args)

    # Back on the event loop.
    def _resolve_prefill(self, seq: Sequence, result: PrefillResult) -> None:
        run = self._prefills.get(seq.request_id)
        if run is not None and run[0] is seq and not run[1].done():
            run[1].set_result(result)
        else:  # aborted meanwhile, maybe placed here again since: the result is no one's
            self._submit(lambda: self._drop_sequence(seq))

    def _hand_over(self, future: asyncio.Future[list[int]], blocks: list[int],
                   error: HalfmoonError | None) -> None:
        if future.done():  # its caller gave up (cancelled), or the engine closed
            self.allocator.free(blocks)
        elif error is not None:
            future.set_exception(error)
        else:
            future.set_result(blocks)

    def _on_crash(self, exc: BaseException) -> None:
        self._crash = exc
        self._outputs.put_nowait([])
        for future in [run for _, run in self._prefills.values()] + list(self._reserving):
            if not future.done():
                future.set_exception(EngineFailure(f"engine thread crashed: {exc!r}"))

    def _reject_prefill(self, seq: Sequence, error: HalfmoonError) -> None:
        run = self._prefills.get(seq.request_id)
        if run is not None and run[0] is seq and not run[1].done():
            run[1].set_exception(error)


def _by_priority(sequences: list[Sequence], count: Callable[[Sequence], int]
                 ) -> dict[int, int]:
    """`count` summed over the sequences of each priority."""
    totals: dict[int, int] = {}
    for seq in sequences:
        totals[seq.priority] = totals.get(seq.priority, 0) + count(seq)
    return totals

"""`EngineCore`: what runs in the torch engine's thread (vLLM's name for the same job).

Between commands from the event loop (`engine.bridge`), the core schedules a batch, secures
its blocks (`BlockGrowth`: growth, preemption), runs the model and turns each sampled token
into the request's next `TokenOutput`, or a prefill-only request's `PrefillResult`. Nothing
here awaits or touches asyncio: every result goes back through `post` to the engine's event
loop side (`LoopSide`), which owns the futures and the output queue.

A request's choices (n > 1) share its prompt's KV: a decode worker's join forks the prompt's
blocks to every choice (`join`); colocated, choice 0 prefills and the others fork off it at
its first token (`_fork_choices`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Protocol

from engine.block_allocator import BlockAllocator
from engine.block_growth import BlockGrowth
from engine.grammar import Grammars
from engine.kv_cache import KvCache
from engine.model_runner import ModelRunner, Sampled
from engine.protocol import FirstToken, PrefillResult, TokenOutput
from engine.sampler import Pick, base_seed
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.step_cost import StepCostFit
from engine.stopping import finish_reason
from shared.errors import HalfmoonError
from shared.messages import FinishReason, SamplingParams, choice_id, request_of


class LoopSide(Protocol):
    """Where the core's results land, on the event loop (each call posted there)."""

    def put_outputs(self, outputs: list[TokenOutput]) -> None:
        """Tokens (or errors) of running requests, for `next_step`."""

    def resolve_prefill(self, seq: Sequence, result: PrefillResult) -> None:
        """A prefill-only run is done; its KV stays parked until released."""

    def reject_prefill(self, seq: Sequence, error: HalfmoonError) -> None:
        """A prefill-only run failed."""

    def hand_over(self, future: asyncio.Future[list[int]], blocks: list[int],
                  error: HalfmoonError | None) -> None:
        """A reservation taken in the thread (`take_over`), or why it could not be."""


class StepTimes:
    """Moving averages of the steps, for the conductor's cost model (heartbeats)."""

    def __init__(self) -> None:
        self.prefill_tokens_per_s = 0.0
        self.decode_step_s = 0.0
        self.busy_s = 0.0
        self.num_prompt_computed = 0
        self.prefill_cost = StepCostFit()  # by prompt tokens
        self.decode_cost = StepCostFit()  # by sequences

    def observe(self, is_prefill: bool, num_tokens: int, elapsed_s: float) -> None:
        self.busy_s += elapsed_s
        if is_prefill:
            self.num_prompt_computed += num_tokens
            self.prefill_cost.observe(num_tokens, elapsed_s)
            rate = num_tokens / max(elapsed_s, 1e-9)
            old = self.prefill_tokens_per_s
            self.prefill_tokens_per_s = rate if old == 0 else 0.8 * old + 0.2 * rate
        else:
            self.decode_cost.observe(num_tokens, elapsed_s)  # a token per sequence
            old = self.decode_step_s
            self.decode_step_s = elapsed_s if old == 0 else 0.8 * old + 0.2 * elapsed_s


def new_sequence(request_id: str, token_ids: list[int], sampling: SamplingParams,
                 output_offset: int = 0, priority: int = 0) -> Sequence:
    return Sequence(request_id=request_id, token_ids=list(token_ids),
                    num_prompt_tokens=len(token_ids), sampling=sampling,
                    seed=base_seed(sampling), arrived_at_s=time.monotonic(),
                    output_start=len(token_ids) - output_offset, priority=priority)


def choice_blocks(block_size: int, num_prompt_tokens: int, num_tokens: int) -> tuple[int, int]:
    """The first blocks of a choice that may reach `num_tokens` (prompt and output): the
    prompt's and one block of headroom, all of them, and its own (beyond the full prompt
    blocks it shares with the request's other choices). It grows from there."""
    first = num_tokens if num_prompt_tokens == 0 else min(  # 0: unknown, all of it
        num_tokens, num_prompt_tokens + block_size)
    per_choice = math.ceil(first / block_size)
    return per_choice, per_choice - num_prompt_tokens // block_size


class EngineCore:
    def __init__(self, runner: ModelRunner, growth: BlockGrowth, scheduler: Scheduler,
                 grammars: Grammars, *, max_model_len: int, times: StepTimes,
                 loop_side: LoopSide, post: Callable[..., None]) -> None:
        self.runner = runner
        self.growth = growth
        self.scheduler = scheduler
        self.grammars = grammars
        self.max_model_len = max_model_len
        self.times = times
        self._loop_side = loop_side
        self._post = post
        self.parked: dict[str, Sequence] = {}  # prefilled, KV held until released

    @property
    def allocator(self) -> BlockAllocator:
        return self.runner.allocator

    @property
    def kv(self) -> KvCache:
        return self.runner.kv

    @property
    def block_size(self) -> int:
        return self.runner.block_size

    # Commands from the event loop, run between steps.
    def admit(self, seq: Sequence) -> None:
        """Queue a new prompt; it takes blocks when its steps run (`BlockGrowth`). None
        outgrows the pool alone: the context is capped at it."""
        try:
            self._attach_grammar(seq)
        except HalfmoonError as exc:
            if seq.is_prefill_only:
                self._post(self._loop_side.reject_prefill, seq, exc)
            else:
                self._post(self._loop_side.put_outputs,
                           [TokenOutput(seq.request_id, 0, -1, None, error=exc)])
            return
        self.scheduler.add_waiting(seq)

    def join(self, sequences: list[Sequence], own_blocks: list[int], finished: set[int], *,
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
                self._post(self._loop_side.put_outputs, [
                    TokenOutput(seq.request_id, seq.num_generated, -1, None, error=exc)])
                continue
            if is_kv_ready:
                self.scheduler.add_running(seq)
            else:
                self.scheduler.add_waiting(seq)

    def release_parked(self, request_id: str) -> None:
        seq = self.parked.pop(request_id, None)
        if seq is not None:
            self.runner.free(seq)

    def drop_sequence(self, seq: Sequence) -> None:
        """Free this run of a request wherever it is, queued or parked; a later run of the
        same request is not touched."""
        if self.parked.get(seq.request_id) is seq:
            del self.parked[seq.request_id]
        elif not self.scheduler.discard(seq):
            return
        self.runner.free(seq)

    def drop(self, request_id: str) -> None:
        seq = self.scheduler.remove(request_id) or self.parked.pop(request_id, None)
        if seq is not None:
            self.runner.free(seq)

    def take_over(self, future: asyncio.Future[list[int]], count: int, priority: int) -> None:
        """`count` blocks for a reservation, preempting running sequences less urgent than
        `priority` when the pool is short (`BlockGrowth.allocate_over`)."""
        try:
            self._post(self._loop_side.hand_over, future,
                       self.growth.allocate_over(count, priority), None)
        except HalfmoonError as exc:
            self._post(self._loop_side.hand_over, future, [], exc)

    # The step.
    def step(self) -> bool:
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
        self.times.observe(batch.is_prefill, sum(batch.num_new_tokens),
                           time.perf_counter() - started)
        outputs = [out for s in sampled for out in self._on_sampled(s)]
        if outputs:
            self._post(self._loop_side.put_outputs, outputs)
        return True

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
            self.parked[seq.request_id] = seq
            result = PrefillResult(
                seq.request_id, sampled.token_id, list(seq.block_ids), reason, sampled.logprob,
                seq.num_cached, time.perf_counter() - seq.compute_started_at, prompt_logprobs,
                forks=[FirstToken(p.token_id, p.logprob, finish_reason(
                    p.token_id, 1, seq.sampling, self.runner.eos_token_ids))
                    for p in sampled.forks])
            self._post(self._loop_side.resolve_prefill, seq, result)
            return []
        if reason is not None:
            self.scheduler.remove(seq.request_id)
            self.runner.free(seq)
        return [TokenOutput(seq.request_id, seq.num_generated - 1, sampled.token_id, reason,
                            sampled.logprob,
                            num_cached_tokens=seq.num_cached if seq.num_generated == 1 else 0,
                            prompt_logprobs=prompt_logprobs), *forks]

    def _finish_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        reason = finish_reason(token_id, seq.num_generated, seq.sampling,
                               self.runner.eos_token_ids)
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
        _, num_own = choice_blocks(self.block_size, num_prompt,
                                   min(self.max_model_len, num_prompt + seq.sampling.max_tokens))
        outputs = []
        for choice, pick in enumerate(picks, start=1):
            fork = new_sequence(choice_id(parent, choice, n), seq.token_ids[:num_prompt],
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

    def _fork(self, source: Sequence, fork: Sequence, own_blocks: list[int]) -> None:
        """Give `fork` the prompt KV of `source`: its full prompt blocks shared (one more
        reference each), the partly filled last one copied into the fork's first own block
        (both will write into it), then the fork's own blocks to grow into."""
        num_full = source.num_prompt_tokens // self.block_size
        shared = source.block_ids[:num_full]
        self.allocator.share(shared)
        if source.num_prompt_tokens % self.block_size:
            self.kv.copy_block(source.block_ids[num_full], own_blocks[0])
        fork.block_ids = [*shared, *own_blocks]

    def _attach_grammar(self, seq: Sequence) -> None:
        """The sequence's grammar matcher, past the output it already has (a decode
        worker's first token from prefill, a continuation's streamed tokens)."""
        if seq.sampling.grammar is not None:
            seq.matcher = self.grammars.matcher(seq.sampling.grammar,
                                                seq.token_ids[seq.output_start:])

    def _fail_batch(self, sequences: list[Sequence], error: HalfmoonError) -> None:
        outputs = []
        for seq in sequences:
            self.scheduler.remove(seq.request_id)
            self.runner.free(seq)
            if seq.is_prefill_only:
                self._post(self._loop_side.reject_prefill, seq, error)
            else:
                outputs.append(TokenOutput(seq.request_id, seq.num_generated, -1, None,
                                           error=error))
        if outputs:
            self._post(self._loop_side.put_outputs, outputs)


def by_priority(sequences: list[Sequence], count: Callable[[Sequence], int]) -> dict[int, int]:
    """`count` summed over the sequences of each priority."""
    totals: dict[int, int] = {}
    for seq in sequences:
        totals[seq.priority] = totals.get(seq.priority, 0) + count(seq)
    return totals

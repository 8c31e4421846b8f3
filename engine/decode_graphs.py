"""CUDA graphs for decode steps (`--cuda-graphs`): a decode step replays a captured graph
instead of launching each layer's kernels from Python.

A graph has fixed shapes, so a step is padded to a bucket: its sequences to the next batch
size of `BATCH_SIZES` and its longest context to the next power of two of blocks (at least
`MIN_CONTEXT_BLOCKS`, at most `MAX_CONTEXT_TOKENS`: the padded attention gathers K/V for the
whole bucket, so longer steps run eagerly). Every bucket's graph is captured when the engine
starts (`capture_all`), before any transfer runs: capturing while another thread queues CUDA
work (the transfer engine's staging copies, which order themselves after the legacy default
stream) would invalidate the capture. They share one memory pool: they are never replayed
concurrently, and each keeps its output alive. Each has static inputs (token ids, positions,
the slots their K/V go to, the attention plan's block table and mask) that a step fills
before the replay, and a static output (the final hidden states); sampling stays outside the
graph.

Padding rows are harmless by construction: they write their K/V into a block reserved for
them at start (`pad_block`, never handed to a sequence) and attend to its first slot alone;
a real row's keys past its context are masked. Only steps where every sequence decodes one token run
here, with the batched `torch` attention backend and a dense model (a mixture-of-experts
layer routes tokens by data-dependent shapes, which a graph cannot hold); anything else runs
eagerly, as do steps past the largest bucket.

`capture` is where CUDA comes in (`cuda_capture`); `eager_capture` runs the same static
buffers without a graph, which is how the padding and buffers are checked on a CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata, PaddedPlan, SequenceSlice, context_blocks
from engine.kv_cache import KvCache

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
MIN_CONTEXT_BLOCKS = 16
MAX_CONTEXT_TOKENS = 4096

# Runs the forward once for the graph's static inputs; returns its static output and what
# computes it again in place.
Capture = Callable[[Callable[[], torch.Tensor]], tuple[torch.Tensor, Callable[[], None]]]
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def eager_capture(forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Callable[[], None]]:
    output = forward()
    return output, lambda: output.copy_(forward())


def cuda_capture(pool: object) -> Capture:
    """Capture into a CUDA graph (warmed up on a side stream first, as capture requires)."""

    def capture(forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Callable[[], None]]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            output = forward()
        return output, graph.replay

    return capture


def _context_sizes(block_size: int, max_context: int) -> list[int]:
    """Powers of two of blocks from MIN_CONTEXT_BLOCKS, the last cut to `max_context` (in whole
    blocks)."""
    last = -(-max_context // block_size) * block_size
    sizes, size = [], block_size * MIN_CONTEXT_BLOCKS
    while size < last:
        sizes.append(size)
        size *= 2
    return [*sizes, last]


@dataclass
class _Graph:
    input_ids: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]
    slot_mapping: torch.Tensor  # [B]
    plan: PaddedPlan  # blocks [B, L / block_size], mask [B, 1, 1, L]
    hidden: torch.Tensor  # [B, hidden], written by each replay
    replay: Callable[[], None]


class DecodeGraphs:
    def __init__(self, forward: Forward, kv: KvCache, device: torch.device, pad_block: int, *,
                 max_batch_size: int, max_context: int, capture: Capture) -> None:
        self._forward = forward
        self._kv = kv
        self._device = device
        self._pad_block = pad_block
        self._pad_slot = pad_block * kv.block_size
        self._batch_sizes = [size for size in BATCH_SIZES if size < max_batch_size] + [
            max_batch_size]
        self._max_context = min(max_context, MAX_CONTEXT_TOKENS)
        self._contexts = _context_sizes(kv.block_size, self._max_context)
        self._capture = capture
        self._graphs: dict[tuple[int, int], _Graph] = {}

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every (batch, context) bucket's graph (once, at start)."""
        for batch in self._batch_sizes:
            for context in self._contexts:
                if (batch, context) not in self._graphs:
                    self._graphs[(batch, context)] = self._new_graph(batch, context)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            slices: list[SequenceSlice]) -> torch.Tensor | None:
        """The step's hidden states (`[len(slices), hidden]`, valid until the next step), or
        None when the step does not fit a graph (run it eagerly)."""
        if any(piece.query_len != 1 for piece in slices):
            return None
        longest = max(piece.context_len for piece in slices)
        if len(slices) > self._batch_sizes[-1] or longest > self._max_context:
            return None
        graph = self._graphs.get((self._bucket(len(slices)), self._context_bucket(longest)))
        if graph is None:  # (not captured: capture_all was not called)
            return None
        self._fill(graph, input_ids, positions, slot_mapping, slices)
        graph.replay()
        return graph.hidden[:len(slices)]

    def _bucket(self, num_sequences: int) -> int:
        return next(size for size in self._batch_sizes if size >= num_sequences)

    def _context_bucket(self, num_tokens: int) -> int:
        return next(size for size in self._contexts if size >= num_tokens)

    def _new_graph(self, batch: int, context: int) -> _Graph:
        device = self._device
        pad = torch.full((batch,), self._pad_slot, dtype=torch.long, device=device)
        plan = PaddedPlan(query_rows=torch.arange(batch, device=device)[:, None],
                          is_query=torch.ones(batch, 1, dtype=torch.bool, device=device),
                          blocks=torch.full((batch, context // self._kv.block_size),
                                            self._pad_block, dtype=torch.long, device=device),
                          num_keys=context,
                          mask=torch.zeros(batch, 1, 1, context, dtype=torch.bool,
                                           device=device),
                          is_causal=False, is_dense=True)
        plan.mask[..., 0] = True  # as every padding row: the pad block's first slot alone
        ids = torch.zeros(batch, dtype=torch.long, device=device)
        positions = torch.zeros(batch, dtype=torch.long, device=device)
        # Captured with every row a padding row: the capture's own writes land in the pad slot.
        meta = AttentionMetadata(pad, [], plan=plan)
        hidden, replay = self._capture(lambda: self._forward(ids, positions, meta))
        return _Graph(ids, positions, pad, plan, hidden, replay)

    def _fill(self, graph: _Graph, input_ids: torch.Tensor, positions: torch.Tensor,
              slot_mapping: torch.Tensor, slices: list[SequenceSlice]) -> None:
        count = len(slices)
        graph.input_ids[:count].copy_(input_ids)
        graph.input_ids[count:].zero_()
        graph.positions[:count].copy_(positions)
        graph.positions[count:].zero_()
        graph.slot_mapping[:count].copy_(slot_mapping)
        graph.slot_mapping[count:].fill_(self._pad_slot)
        blocks, lengths = context_blocks(AttentionMetadata(slot_mapping, slices),
                                         self._kv.block_size, self._device)
        plan = graph.plan
        plan.blocks.fill_(self._pad_block)
        plan.blocks[:count, :blocks.shape[1]].copy_(blocks)
        keys = torch.arange(plan.mask.shape[-1], device=self._device)
        plan.mask[:count, 0, 0].copy_(keys < lengths[:, None])
        plan.mask[count:, 0, 0].copy_(keys == 0)

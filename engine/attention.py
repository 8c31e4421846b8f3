"""Attention over the paged KV pool: one call per layer for the whole flattened batch.

A step's batch is flattened (`[T]` new tokens: prefill chunks and decode tokens mixed, each
sequence's K/V in scattered blocks). A backend turns the step's `AttentionMetadata` into a
plan once per step (indices, masks: shared by every layer), then attends each layer in one
call. Every backend reads K/V after the layer has written this step's tokens into the pool.

* `torch`: one `scaled_dot_product_attention` call on CPU or CUDA. Per step it picks the
  layout that computes fewer scores: *padded* (`[B, H, Qmax, Lmax]`, each sequence one batch
  row; best when every query is short, as in decode) or *packed* (`[1, H, T, Tk]`, all
  sequences end to end under a block-diagonal causal mask; best when one long chunk shares
  the step with many short ones). On a CPU without AMX it computes in fp32.
* `inductor` (CPU): `torch`, but a decode step (one query per sequence) of at least
  `KERNEL_MIN_SEQUENCES` sequences runs a kernel compiled by inductor that reads the pool's
  blocks in place (`engine.paged_decode`); plain `torch` where inductor cannot build it.
* `flex`: `flex_attention` with a block mask over the packed layout, compiled.
* `flashinfer`: FlashInfer's paged kernels (CUDA), reading the pool in place.
* `reference`: a loop over sequences, one call each; the other backends are tested against it.

`auto` (`auto_backend`): FlashInfer on CUDA when it imports; `inductor` for a bf16 pool on a
CPU without AMX; else `torch`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from engine.kv_cache import KvCache
from engine.linear import cpu_has_amx
from engine.paged_decode import PagedDecode
from shared.errors import ConfigError
from shared.logs import get_logger

log = get_logger(__name__)

BACKENDS = ("auto", "torch", "inductor", "flex", "flashinfer", "reference")


@dataclass(frozen=True)
class SequenceSlice:
    """One sequence's share of a flattened batch."""

    query_start: int  # its first new token in the batch
    query_len: int
    context_len: int  # tokens in the pool once this step's tokens are written
    block_ids: list[int]  # its block table: token t lives in block_ids[t // block_size]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T]: where each new token's K/V goes
    sequences: list[SequenceSlice]
    plan: Any = field(default=None)  # the backend's, made once per step


class AttentionBackend(Protocol):
    """One attention call per layer for a flattened batch."""

    name: str

    def plan(self, meta: AttentionMetadata, kv: KvCache) -> Any:
        """What every layer of this step shares (indices, masks, kernel plans)."""

    def attend(self, q: torch.Tensor, kv: KvCache, layer: int, plan: Any) -> torch.Tensor:
        """Causal attention of the step's queries (`[T, Hq, D]`) over each one's own
        sequence's context in `layer` of the pool; `[T, Hq, D]`."""

    def warm_up(self, kv: KvCache) -> None:
        """Build what the backend compiles for this pool, before the first step."""


def context_blocks(meta: AttentionMetadata, block_size: int, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's context blocks, padded to the longest (`[B, max_blocks]`; pads are
    block 0), and each one's context length in tokens (`[B]`)."""
    lengths = torch.tensor([s.context_len for s in meta.sequences], device=device)
    max_blocks = max(-(-s.context_len // block_size) for s in meta.sequences)
    table = torch.zeros(len(meta.sequences), max_blocks, dtype=torch.long)
    for row, seq in enumerate(meta.sequences):
        used = -(-seq.context_len // block_size)
        table[row, :used] = torch.tensor(seq.block_ids[:used])
    return table.to(device), lengths


def context_slots(meta: AttentionMetadata, block_size: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's context slots, padded to the longest (`[B, Lmax]`; pads are slot 0),
    and each one's context length (`[B]`)."""
    table, lengths = context_blocks(meta, block_size, device)
    positions = torch.arange(int(lengths.max()), device=device)
    slots = table[:, positions // block_size] * block_size + positions % block_size
    return slots.masked_fill(positions >= lengths[:, None], 0), lengths


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          is_causal: bool = False) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _gather(kv: KvCache, layer: int, slots: torch.Tensor, dtype: torch.dtype | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V at `slots` (`[..., L]`) as `[..., Hkv, L, D]` (SDPA's layout, contiguous), in
    `dtype` (default: the pool's)."""
    k, v = kv.gather(layer, slots.flatten())
    shape = (*slots.shape, *k.shape[1:])
    return (k.view(shape).transpose(-3, -2).to(dtype, memory_format=torch.contiguous_format),
            v.view(shape).transpose(-3, -2).to(dtype, memory_format=torch.contiguous_format))


def _gather_blocks(kv: KvCache, layer: int, blocks: torch.Tensor, num_keys: int,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `num_keys` keys of each row's blocks (`[B, n]` ids), K and V as
    `[B, Hkv, num_keys, D]` in `dtype`. A block's tokens are one contiguous row of the pool,
    so this gathers block_size times fewer, larger rows than `_gather` over their slots;
    what lies past a row's context is garbage that the mask hides."""
    k, v = kv.gather_blocks(layer, blocks.flatten())
    shape = (blocks.shape[0], -1, *k.shape[2:])
    return (k.view(shape)[:, :num_keys].transpose(1, 2).to(
                dtype, memory_format=torch.contiguous_format),
            v.view(shape)[:, :num_keys].transpose(1, 2).to(
                dtype, memory_format=torch.contiguous_format))


def compute_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """What attention computes in: fp32 on a CPU without AMX, else the pool's dtype (the K/V
    gather copies anyway). CPU bf16 SDPA ran 2-5x slower than fp32 without bf16 units (an
    AVX2 EPYC), and with AVX512-BF16 but no AMX (a Zen 4 EPYC) 5x: decode at batch 32 over
    144 keys, 5.1 against 1.0 ms a call, 59 % of a bf16 step."""
    if device.type == "cpu" and dtype != torch.float32 and not cpu_has_amx():
        return torch.float32
    return dtype


@dataclass(frozen=True)
class PaddedPlan:
    query_rows: torch.Tensor  # [B, Qmax]: each row's queries in the flat batch (pads: 0)
    is_query: torch.Tensor  # [B, Qmax]: which of them are real
    blocks: torch.Tensor  # [B, n]: each row's context blocks
    # Keys per row: the longest context (as many as a slot-wise gather took: the same sums,
    # so a request's numbers do not depend on which block its context ends in).
    num_keys: int
    mask: torch.Tensor | None  # [B, 1, Qmax, num_keys]; None: one sequence, plainly causal
    is_causal: bool
    # Every row has Qmax queries (a decode batch): outputs are reshaped, not picked by a
    # boolean index, whose data-dependent shape costs a device sync (and breaks graphs).
    is_dense: bool = False


@dataclass(frozen=True)
class PackedPlan:
    slots: torch.Tensor  # [Tk]: every context end to end
    mask: torch.Tensor  # [T, Tk]


# The fewest sequences a decode step has for `PagedDecode` to run it: smaller steps go
# through SDPA, whose copies of K and V are small then, where the kernel's call (its guards
# and C++ wrapper, each layer) costs more. One bf16 engine in a worker-like process, the
# kernel and SDPA in turns over eight rounds, medians, tok/s: 1 sequence 32.5 against SDPA's
# 35.6, 2: 60.8 / 63.5, 4: 144.2 / 148.3; 6: 192.3 / 183.2, 8: 223.1 / 211.9.
KERNEL_MIN_SEQUENCES = 6


class TorchAttention:
    """One SDPA call per layer, padded or packed (whichever computes fewer scores); with
    `decode` (the `inductor` backend) a decode step of at least `kernel_min_sequences`
    through it (built at `warm_up`, or at the first decode step; dropped where it cannot
    be built)."""

    def __init__(self, device: torch.device, decode: PagedDecode | None = None,
                 kernel_min_sequences: int = KERNEL_MIN_SEQUENCES) -> None:
        self.device = device
        self.name = "torch" if decode is None else "inductor"
        self._decode = decode
        self._is_decode_built = False
        self._kernel_min_sequences = kernel_min_sequences

    @property
    def is_decode_kernel_built(self) -> bool:
        return self._is_decode_built

    def warm_up(self, kv: KvCache) -> None:
        if self._decode is not None and not self._is_decode_built:
            self._is_decode_built = self._decode.compile(kv.data)
            if not self._is_decode_built:
                self._decode = None

    def plan(self, meta: AttentionMetadata, kv: KvCache) -> PaddedPlan | PackedPlan:
        seqs = meta.sequences
        num_queries = sum(s.query_len for s in seqs)
        max_query = max(s.query_len for s in seqs)
        max_context = max(s.context_len for s in seqs)
        padded = len(seqs) * max_query * max_context
        packed = num_queries * sum(s.context_len for s in seqs)
        if packed < padded:
            return self.packed(meta, kv)
        return self.padded(meta, kv, max_query)

    def padded(self, meta: AttentionMetadata, kv: KvCache, max_query: int) -> PaddedPlan:
        seqs, device = meta.sequences, self.device
        blocks, lengths = context_blocks(meta, kv.block_size, device)
        starts = torch.tensor([s.query_start for s in seqs], device=device)
        query_lens = torch.tensor([s.query_len for s in seqs], device=device)
        offsets = torch.arange(max_query, device=device)
        is_query = offsets < query_lens[:, None]
        query_rows = torch.where(is_query, starts[:, None] + offsets, 0)
        is_dense = all(s.query_len == max_query for s in seqs)
        only = seqs[0]
        if len(seqs) == 1 and only.query_len == only.context_len:
            return PaddedPlan(query_rows, is_query, blocks, only.context_len, None,
                              only.query_len > 1, is_dense)
        # Query i of a sequence sits at position context_len - query_len + i.
        positions = (lengths - query_lens)[:, None] + offsets  # [B, Qmax]
        num_keys = max(s.context_len for s in seqs)
        keys = torch.arange(num_keys, device=device)
        mask = keys <= positions[:, :, None]  # [B, Qmax, Lmax]; within the context, as
        mask &= keys < lengths[:, None, None]  # a pad row's keys (row 0 stays: no NaN)
        mask[:, :, 0] = True
        return PaddedPlan(query_rows, is_query, blocks, num_keys, mask[:, None], False,
                          is_dense)

    def packed(self, meta: AttentionMetadata, kv: KvCache) -> PackedPlan:
        seqs, device = meta.sequences, self.device
        slots, lengths = context_slots(meta, kv.block_size, device)
        is_key = torch.arange(slots.shape[1], device=device) < lengths[:, None]
        owners = torch.repeat_interleave(torch.arange(len(seqs), device=device),
                                         torch.tensor([s.query_len for s in seqs],
                                                      device=device))
        query_positions = torch.cat([
            torch.arange(s.context_len - s.query_len, s.context_len, device=device)
            for s in seqs])
        key_owners = torch.arange(len(seqs), device=device)[:, None].expand_as(slots)[is_key]
        key_positions = torch.arange(slots.shape[1], device=device).expand_as(slots)[is_key]
        mask = ((owners[:, None] == key_owners[None, :])
                & (key_positions[None, :] <= query_positions[:, None]))
        return PackedPlan(slots[is_key], mask)

    def attend(self, q: torch.Tensor, kv: KvCache, layer: int,
               plan: PaddedPlan | PackedPlan) -> torch.Tensor:
        dtype = compute_dtype(q.device, q.dtype)
        if isinstance(plan, PackedPlan):
            k, v = _gather(kv, layer, plan.slots, dtype)
            out = _sdpa(q.to(dtype).transpose(0, 1).unsqueeze(0), k.unsqueeze(0),
                        v.unsqueeze(0), plan.mask)
            return out[0].transpose(0, 1).to(q.dtype)
        num_rows, max_query = plan.query_rows.shape
        if self._decode is not None and plan.is_dense and max_query == 1 \
                and num_rows >= self._kernel_min_sequences:
            self.warm_up(kv)
            if self._decode is not None:
                mask = plan.mask if plan.mask is not None else torch.ones(
                    1, 1, 1, plan.num_keys, dtype=torch.bool, device=q.device)
                return self._decode(q, *kv.pools(layer), plan.blocks, mask)
        k, v = _gather_blocks(kv, layer, plan.blocks, plan.num_keys, dtype)
        # [B, Hq, Qmax, D]; a dense batch's rows are consecutive: a view, not a gather.
        rows = q.view(*plan.query_rows.shape, *q.shape[1:]) if plan.is_dense \
            else q[plan.query_rows]
        queries = rows.to(dtype).transpose(1, 2)
        out = _sdpa(queries, k, v, plan.mask, plan.is_causal).transpose(1, 2)
        out = out.flatten(0, 1) if plan.is_dense else out[plan.is_query]
        return out.to(q.dtype)


class ReferenceAttention:
    """The plain loop, as the engine ran before the batched backends: one SDPA call per
    sequence over its own context (read in place when its blocks are consecutive)."""

    name = "reference"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def plan(self, meta: AttentionMetadata, kv: KvCache) -> tuple[list[SequenceSlice],
                                                                   torch.Tensor]:
        return meta.sequences, context_slots(meta, kv.block_size, self.device)[0]

    def warm_up(self, kv: KvCache) -> None:
        pass

    def attend(self, q: torch.Tensor, kv: KvCache, layer: int,
               plan: tuple[list[SequenceSlice], torch.Tensor]) -> torch.Tensor:
        seqs, slots = plan
        out = torch.empty_like(q)
        for row, seq in enumerate(seqs):
            span = slice(seq.query_start, seq.query_start + seq.query_len)
            used = seq.block_ids[:-(-seq.context_len // kv.block_size)]
            if used == list(range(used[0], used[0] + len(used))):  # consecutive: no copy
                k, v = kv.view(layer, used[0] * kv.block_size, seq.context_len)
                k, v = k.transpose(0, 1), v.transpose(0, 1)
            else:
                k, v = _gather(kv, layer, slots[row, :seq.context_len])
            queries = q[span].transpose(0, 1).unsqueeze(0)
            mask = None
            if 1 < seq.query_len < seq.context_len:  # a chunk after cached context
                rows = torch.arange(seq.query_len, device=q.device)[:, None]
                mask = (torch.arange(seq.context_len, device=q.device)[None, :]
                        <= rows + seq.context_len - seq.query_len)
            attended = _sdpa(queries, k.unsqueeze(0), v.unsqueeze(0), mask,
                             is_causal=1 < seq.query_len == seq.context_len)
            out[span] = attended[0].transpose(0, 1)
        return out


class FlexAttention:
    """`flex_attention` over the packed layout with a block-sparse document-causal mask,
    compiled with dynamic shapes. Where inductor fails to build it (torch 2.13's CPU
    template does for some shapes: a C++ compile error), it runs eager from then on: the
    same result, unfused."""

    name = "flex"

    def __init__(self, device: torch.device) -> None:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        self.device = device
        self._torch = TorchAttention(device)  # its packed layout, under a block mask here
        self._create_block_mask = create_block_mask
        self._eager = flex_attention
        self._flex: Any = torch.compile(flex_attention, dynamic=True)

    def plan(self, meta: AttentionMetadata, kv: KvCache) -> tuple[torch.Tensor, Any]:
        packed = self._torch.packed(meta, kv)
        dense = packed.mask

        def document_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return dense[q_idx, kv_idx]

        block_mask = self._create_block_mask(document_causal, None, None, dense.shape[0],
                                             dense.shape[1], device=str(self.device))
        return packed.slots, block_mask

    def warm_up(self, kv: KvCache) -> None:
        pass  # (compiled at the first step: its block masks are made per step)

    def attend(self, q: torch.Tensor, kv: KvCache, layer: int,
               plan: tuple[torch.Tensor, Any]) -> torch.Tensor:
        slots, block_mask = plan
        k, v = _gather(kv, layer, slots)
        args = (q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0))
        options = {"block_mask": block_mask, "enable_gqa": q.shape[1] != k.shape[0]}
        try:
            out = self._flex(*args, **options)
        except Exception as exc:  # inductor's own failure to build the kernel
            if self._flex is self._eager:
                raise
            log.warning("attention.flex_not_compiled", error=str(exc).splitlines()[0][:200])
            self._flex = self._eager
            out = self._flex(*args, **options)
        return out[0].transpose(0, 1)


class FlashInferAttention:
    """FlashInfer's batch prefill kernel over the paged pool in place (NHD layout: a layer
    of the pool is `[2, blocks, block_size, Hkv, D]`, FlashInfer's paged K and V); decode
    tokens are prefill chunks of one query. CUDA only; not run on this project's CPU CI."""

    name = "flashinfer"

    def __init__(self, device: torch.device, num_heads: int) -> None:
        import flashinfer

        if device.type != "cuda":
            raise ConfigError("the flashinfer attention backend needs a CUDA device")
        self.device, self.num_heads = device, num_heads
        workspace = torch.empty(128 * 2**20, dtype=torch.uint8, device=device)
        self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")

    def plan(self, meta: AttentionMetadata, kv: KvCache) -> None:
        seqs, block_size = meta.sequences, kv.block_size
        used = [-(-s.context_len // block_size) for s in seqs]
        as_int = {"dtype": torch.int32, "device": self.device}
        qo_indptr = torch.tensor([0, *_cumsum([s.query_len for s in seqs])], **as_int)
        kv_indptr = torch.tensor([0, *_cumsum(used)], **as_int)
        kv_indices = torch.tensor([b for s, n in zip(seqs, used, strict=True)
                                   for b in s.block_ids[:n]], **as_int)
        last_page_len = torch.tensor([s.context_len - (n - 1) * block_size
                                      for s, n in zip(seqs, used, strict=True)], **as_int)
        _, _, _, num_kv_heads, head_dim = kv.data.shape[1:]
        self._wrapper.plan(qo_indptr, kv_indptr, kv_indices, last_page_len,
                           self.num_heads, num_kv_heads, head_dim, block_size,
                           causal=True, q_data_type=kv.data.dtype)

    def warm_up(self, kv: KvCache) -> None:
        pass

    def attend(self, q: torch.Tensor, kv: KvCache, layer: int, plan: None) -> torch.Tensor:
        layer_pool = kv.data[layer]
        return self._wrapper.run(q.contiguous(), (layer_pool[0], layer_pool[1]))


def _cumsum(values: list[int]) -> list[int]:
    total, out = 0, []
    for value in values:
        total += value
        out.append(total)
    return out


def auto_backend(device: torch.device, dtype: torch.dtype) -> str:
    """FlashInfer on CUDA when it imports; on a CPU, `inductor` where SDPA would compute in
    another dtype than the pool's (a bf16 pool without AMX: SDPA needs a copy of K and V in
    fp32 a layer, which the kernel saves), else `torch` (an fp32 pool on a Zen 4 host,
    each engine in a process of its own: the kernel 0.90x SDPA at batch 1, 0.94x at 8,
    1.17x at 32; not worth compiling in every fp32 worker, which otherwise never imports
    torch's compiler, ~1 s and ~100 MB)."""
    if device.type == "cuda":
        return "flashinfer" if importlib.util.find_spec("flashinfer") else "torch"
    return "inductor" if compute_dtype(device, dtype) != dtype else "torch"


def make_backend(name: str, device: torch.device, num_heads: int,
                 dtype: torch.dtype = torch.float32) -> AttentionBackend:
    """The backend called `name` (one of `BACKENDS`) for `device` and a pool in `dtype`."""
    if name == "auto":
        name = auto_backend(device, dtype)
    if name == "torch":
        return TorchAttention(device)
    if name == "inductor":
        if device.type != "cpu":
            raise ConfigError("the inductor attention backend's decode kernel is built for "
                              f"CPUs, not {device}")
        return TorchAttention(device, PagedDecode(num_heads))
    if name == "reference":
        return ReferenceAttention(device)
    if name == "flex":
        return FlexAttention(device)
    if name == "flashinfer":
        if importlib.util.find_spec("flashinfer") is None:
            raise ConfigError("the flashinfer attention backend needs the flashinfer package")
        return FlashInferAttention(device, num_heads)
    raise ConfigError(f"unknown attention backend {name!r}; one of {', '.join(BACKENDS)}")

"""Decode attention on a CPU that reads K and V from the paged pool in place.

A decode step has one query per sequence. Through SDPA, each layer gathers every
sequence's blocks and copies them into SDPA's layout, in fp32 for a bf16 pool on a CPU
without AMX, before SDPA reads them once more. This kernel, compiled by inductor, does it in
one pass: for each sequence and KV head it reads each key and value from its block,
upcasts, scores, softmaxes and sums, computing in fp32 whatever the pool's dtype. Profiled
in the engine (the bench's 254 M Llama, bf16, batch 32, ~140 keys, a Zen 4 host): 3.8 ms a
layer through SDPA (gather 0.7, copies 2.0, SDPA 1.3), 1.9 through this kernel. For an fp32
pool it is faster only at large batches (`engine.attention.auto_backend`), and for a few
sequences SDPA is faster in either dtype (`engine.attention.KERNEL_MIN_SEQUENCES`).

Inductor needs a C++ compiler: where it cannot build the kernel, `compile()` says so and
the caller keeps SDPA. One kernel serves every batch: the batch's sizes (sequences, blocks,
keys) are traced as unbacked symbols (dynamo would specialize a size of 1 and compile
again), without duck sizing (else sizes equal at the first call would be guarded equal and
compiled again when they differ); the model's sizes are constants. It is compiled in the
thread that runs it (inductor builds a CPU kernel for the calling thread's OpenMP threads).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.fx.experimental._config as fx_config

from shared.logs import get_logger

log = get_logger(__name__)


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 blocks: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's one query over its keys.

    q `[B, Hkv, G, D]` (the G query heads that share KV head h at `[:, h]`); pools
    `[num_blocks, block_size, Hkv, D]`; blocks `[B, n]`, each row's context blocks; mask
    `[B, 1, 1, L]`, which of the first L keys a row attends (at least one each).
    `[B, Hkv, G, D]` in q's dtype. Written to be fused by inductor: run eagerly it
    materializes `[B, Hkv, G, L, D]` products."""
    block_size = k_pool.shape[1]
    positions = torch.arange(mask.shape[-1], device=q.device)
    rows, offsets = blocks[:, positions // block_size], positions % block_size  # [B, L], [L]
    k = k_pool[rows, offsets].permute(0, 2, 1, 3).float()[:, :, None]  # [B, Hkv, 1, L, D]
    v = v_pool[rows, offsets].permute(0, 2, 1, 3).float()[:, :, None]
    scores = (q.float()[:, :, :, None] * k).sum(-1) * q.shape[-1] ** -0.5  # [B, Hkv, G, L]
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return (weights[..., None] * v).sum(-2).to(q.dtype)


class PagedDecode:
    """`paged_decode` compiled once per process (shared by every engine in it)."""

    _lock = threading.Lock()
    _compiled: Any = None
    _failure: str | None = None

    def __init__(self, num_heads: int) -> None:
        self.num_heads = num_heads  # query heads

    def compile(self, kv_pool: torch.Tensor) -> bool:
        """Build the kernel for a pool (`[layers, 2, blocks, block_size, Hkv, D]`) on a
        throwaway batch; False (and logged once) where inductor cannot."""
        cls = type(self)
        with cls._lock:
            if cls._compiled is None and cls._failure is None:
                cls._compiled = torch.compile(paged_decode, dynamic=False)
            if cls._failure is not None:
                return False
            try:
                for layer in {0, kv_pool.shape[0] - 1}:  # the first K starts the pool
                    self._trace(kv_pool[layer, 0], kv_pool[layer, 1])
            except Exception as exc:  # inductor's: no compiler, a failed build
                cls._failure = str(exc).splitlines()[0][:300] if str(exc) else repr(exc)
                log.warning("attention.paged_decode_not_compiled", error=cls._failure,
                            fallback="sdpa")
                return False
            return True

    def _trace(self, k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
        """One call whose batch sizes (sequences, blocks, keys; the pool's blocks) are traced
        as symbols: model sizes (heads, head size, block size) stay constants, so the block
        size divides as a shift and the head loops unroll."""
        q = torch.zeros(2, self.num_heads, k_pool.shape[-1], dtype=k_pool.dtype)
        blocks = torch.zeros(2, 2, dtype=torch.long)
        mask = torch.ones(2, 1, 1, 2, dtype=torch.bool)
        with fx_config.patch(use_duck_shape=False), torch.inference_mode():
            args = self._inputs(q, blocks, mask, k_pool.shape[2])
            for tensor, dims in zip(args, ((0,), (0, 1), (0, 3)), strict=True):
                for dim in dims:
                    torch._dynamo.decorators.mark_unbacked(tensor, dim)
            torch._dynamo.mark_dynamic(k_pool, 0)
            torch._dynamo.mark_dynamic(v_pool, 0)
            type(self)._compiled(args[0], k_pool, v_pool, *args[1:])

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 blocks: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q `[B, Hq, D]`, one query per row; `[B, Hq, D]`."""
        with torch.inference_mode():
            queries, blocks, mask = self._inputs(q, blocks, mask, k_pool.shape[2])
            out = type(self)._compiled(queries, k_pool, v_pool, blocks, mask)
        return out.reshape(q.shape)

    @staticmethod
    def _inputs(q: torch.Tensor, blocks: torch.Tensor, mask: torch.Tensor, num_kv_heads: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kernel's q, blocks and mask: copies made in inference mode whoever calls (a
        guard tells inference tensors from others)."""
        rows, num_heads, head_dim = q.shape
        queries = q.reshape(rows, num_kv_heads, num_heads // num_kv_heads, head_dim).clone()
        blocks, mask = blocks.clone(), mask.clone()
        return queries, blocks, mask

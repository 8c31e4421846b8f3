"""The paged KV pool: `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`.

One layer of one request is a set of block rows, so contiguous block ids are contiguous bytes
and a transfer can move them in one piece. Token `t` of a request lives in slot
`block_table[t // block_size] * block_size + t % block_size`.
"""

from __future__ import annotations

import torch


class KvCache:
    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device,
                 storage: torch.Tensor | None = None) -> None:
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        if storage is None:
            storage = torch.zeros(shape, dtype=dtype, device=device)
        elif tuple(storage.shape) != shape:
            raise ValueError(f"KV storage has shape {tuple(storage.shape)}, expected {shape}")
        self.data = storage
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Per layer: [2, num_blocks * block_size, heads, dim], views of `data`.
        self._slots = [storage[layer].view(2, num_blocks * block_size, num_kv_heads, head_dim)
                       for layer in range(num_layers)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K and V (`[T, heads, dim]`) of T tokens at `slots` (`[T]`)."""
        flat = self._slots[layer]
        flat[0].index_copy_(0, slots, k)
        flat[1].index_copy_(0, slots, v)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V (`[len(slots), heads, dim]`) stored at `slots`."""
        flat = self._slots[layer]
        return flat[0].index_select(0, slots), flat[1].index_select(0, slots)

    def gather_blocks(self, layer: int, block_ids: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V (`[len(block_ids), block_size, heads, dim]`) of whole blocks."""
        k, v = self.pools(layer)
        return k.index_select(0, block_ids), v.index_select(0, block_ids)

    def pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every block in `layer` (`[num_blocks, block_size, heads, dim]`, views)."""
        return self.data[layer, 0], self.data[layer, 1]

    def copy_block(self, source: int, target: int) -> None:
        """Every layer's K and V of block `source` into block `target`."""
        self.data[:, :, target] = self.data[:, :, source]

    def view(self, layer: int, first_slot: int, length: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `length` consecutive slots, as views (no copy)."""
        flat = self._slots[layer]
        return flat[0, first_slot:first_slot + length], flat[1, first_slot:first_slot + length]

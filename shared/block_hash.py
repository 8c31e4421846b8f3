"""Prefix-cache block hashes, identical in every process and on every machine.

A block's hash chains its parent's: hash(parent hash, the block's token ids, salt). Two prompts
share a block hash only if they share every token up to the end of that block. blake2b over a
fixed little-endian encoding, never Python's `hash`. Used by the engine (local prefix cache)
and the conductor (global prefix index).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes
HASH_BYTES = 16


def _encode(token_ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


_ROOT = b"\x00" * HASH_BYTES


def _hash(parent: BlockHash | None, encoded_block: bytes, salt: bytes) -> BlockHash:
    # One call over parent + block: the same digest as two updates, fewer Python steps.
    data = (parent or _ROOT) + encoded_block
    return hashlib.blake2b(data, digest_size=HASH_BYTES, key=salt[:64]).digest()


def chain_hash(parent: BlockHash | None, token_ids: Sequence[int], salt: bytes = b"") -> BlockHash:
    """The hash of one block of token ids (4-byte little-endian each) after `parent`."""
    return _hash(parent, _encode(token_ids), salt)


def block_hashes(token_ids: Sequence[int], block_size: int, salt: bytes = b"") -> list[BlockHash]:
    """Hashes of every full block of `token_ids`; a trailing partial block has none."""
    num_full = len(token_ids) // block_size
    encoded = _encode(token_ids[: num_full * block_size])  # one pack for the whole prompt
    stride = 4 * block_size
    hashes: list[BlockHash] = []
    parent = None
    for start in range(0, num_full * stride, stride):
        parent = _hash(parent, encoded[start:start + stride], salt)
        hashes.append(parent)
    return hashes

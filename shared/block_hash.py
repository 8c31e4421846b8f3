"""Prefix-cache block hashes, identical in every process and on every machine.

A block's hash chains its parent's: hash(parent hash, the block's token ids, salt). Two prompts
share a block hash only if they share every token up to the end of that block. blake2b over a
fixed little-endian encoding, never Python's `hash`. Used by the engine (local prefix cache)
and the conductor (global prefix index).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

BlockHash = bytes
HASH_BYTES = 16


def chain_hash(parent: BlockHash | None, token_ids: Sequence[int], salt: bytes = b"") -> BlockHash:
    digest = hashlib.blake2b(digest_size=HASH_BYTES, key=salt[:64])
    digest.update(parent or b"\x00" * HASH_BYTES)
    digest.update(b"".join(t.to_bytes(4, "little") for t in token_ids))
    return digest.digest()


def block_hashes(token_ids: Sequence[int], block_size: int, salt: bytes = b"") -> list[BlockHash]:
    """Hashes of every full block of `token_ids`; a trailing partial block has none."""
    hashes: list[BlockHash] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[start:start + block_size], salt)
        hashes.append(parent)
    return hashes

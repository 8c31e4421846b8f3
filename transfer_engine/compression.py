"""FP8 (e4m3) and INT8 quantization of float payloads on the wire, with per-block scales.

A piece of `n` elements is cut into blocks of `block_elems`; each block is scaled so that its
largest magnitude maps to the format's largest value, then rounded. On the wire a piece is its
float32 scales followed by its 1-byte codes: `n + 4 * ceil(n / block_elems)` bytes.

Error bounds, per element x of a block with scale s = max|block| / qmax (before rounding to
the target dtype): int8 |x - x'| <= s / 2; fp8 e4m3 |x - x'| <= 2**-4 * |x| + 2**-10 * s
(3 mantissa bits; the second term covers e4m3's subnormals).

Quantizing costs CPU on both ends; it pays where the network is slower than the quantizer
(TCP across hosts), never on shared memory, which ignores it.
"""

from __future__ import annotations

import warnings
from typing import Any

from transfer_engine.errors import InvalidTransfer
from transfer_engine.wire import Compression

SCHEMES = ("fp8", "int8")
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_BLOCK_ELEMS = 256
_QMAX = {"fp8": 448.0, "int8": 127.0}
_SCALE_BYTES = 4


def make(scheme: str, dtype: str, block_elems: int = DEFAULT_BLOCK_ELEMS) -> Compression:
    if scheme not in SCHEMES:
        raise InvalidTransfer(f"unknown compression {scheme!r}; use one of {SCHEMES}")
    if dtype not in DTYPES:
        raise InvalidTransfer(f"cannot compress {dtype!r} payloads; use one of {DTYPES}")
    if block_elems <= 0:
        raise InvalidTransfer(f"block_elems must be positive, not {block_elems}")
    return Compression(scheme=scheme, dtype=dtype, block_elems=block_elems)


def check_lengths(lengths: Any, compression: Compression) -> None:
    """`InvalidTransfer` unless every piece length is whole elements of the dtype."""
    itemsize = _itemsize(compression)
    bad = lengths % itemsize != 0
    if bad.any():
        raise InvalidTransfer(f"a {compression.dtype} piece cannot be "
                              f"{int(lengths[bad][0])} bytes long")


def compressed_size(num_bytes: int, compression: Compression) -> int:
    num_elems = _num_elems(num_bytes, compression)
    return num_elems + _SCALE_BYTES * -(-num_elems // compression.block_elems)


def compress(source: memoryview, compression: Compression) -> bytes:
    """Scales then codes of one piece (`compressed_size` bytes)."""
    import torch

    num_elems = _num_elems(source.nbytes, compression)
    values = _as_tensor(source, getattr(torch, compression.dtype)).float()
    blocks = _padded_blocks(values, num_elems, compression.block_elems)
    amax = blocks.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny)
    scales = amax / _QMAX[compression.scheme]
    scaled = blocks / scales[:, None]
    if compression.scheme == "fp8":
        codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        codes = scaled.round().clamp(-127, 127).to(torch.int8).view(torch.uint8)
    return scales.numpy().tobytes() + codes.reshape(-1)[:num_elems].numpy().tobytes()


def decompress_into(payload: memoryview, compression: Compression,
                    target: memoryview) -> None:
    """Dequantize one piece's wire bytes into `target` (its uncompressed place)."""
    import torch

    num_elems = _num_elems(target.nbytes, compression)
    num_blocks = -(-num_elems // compression.block_elems)
    if payload.nbytes != num_elems + _SCALE_BYTES * num_blocks:
        raise InvalidTransfer("compressed piece has the wrong size")
    scales = _as_tensor(payload[:_SCALE_BYTES * num_blocks], torch.float32)
    code_type = torch.float8_e4m3fn if compression.scheme == "fp8" else torch.int8
    codes = _as_tensor(payload[_SCALE_BYTES * num_blocks:], torch.uint8).view(code_type)
    blocks = _padded_blocks(codes.float(), num_elems, compression.block_elems)
    values = (blocks * scales[:, None]).reshape(-1)[:num_elems]
    out = _as_tensor(target, getattr(torch, compression.dtype))
    out.copy_(values)


def _num_elems(num_bytes: int, compression: Compression) -> int:
    itemsize = _itemsize(compression)
    if num_bytes % itemsize:
        raise InvalidTransfer(f"a {compression.dtype} piece cannot be {num_bytes} bytes long")
    return num_bytes // itemsize


def _itemsize(compression: Compression) -> int:
    return 4 if compression.dtype == "float32" else 2


def _as_tensor(view: memoryview, dtype: Any) -> Any:
    import torch

    with warnings.catch_warnings():
        # Read-only sources are only read; torch warns about any non-writable buffer.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=dtype)


def _padded_blocks(values: Any, num_elems: int, block_elems: int) -> Any:
    import torch

    num_padded = -(-num_elems // block_elems) * block_elems
    if num_padded != num_elems:
        values = torch.nn.functional.pad(values, (0, num_padded - num_elems))
    return values.view(-1, block_elems)

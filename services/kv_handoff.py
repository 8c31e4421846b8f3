"""The KV handoff: how a prefill worker moves a request's KV into the decode worker's
reserved blocks. Here an engine's KV pool meets the transfer engine, which knows only bytes,
segments and peers.

The prefill service opens a stream per request before prefill starts, passes the stream's
`on_layer` to the engine, and calls `finish(result)` once the engine returned the first
token; the report (bytes, seconds, transport, the tail: last layer computed to last byte
landed, and the wire compression with the bytes that crossed) travels in `KvCommitted`.
With `--kv-transfer-dtype fp8|int8` every write is quantized on the wire and dequantized
into decode's pool (TCP; shared memory moves the bytes as they are).

`LayerwiseKvHandoff` writes each layer's K and V blocks as soon as the engine reports the
layer done (or, with `is_layerwise=False`, all layers after the last one: the baseline that
layer-wise streaming is measured against). The decode side's `KvTarget` (its blocks and pool
layout) may arrive while prefill computes; layers wait for it, compute does not.

When tracing, the stream's `kv.transfer` span runs from the first write to the last byte
landed; the report carries its context, and `KvCommitted` carries that in its headers, so the
decode side's `decode.stream` follows the transfer in the request's trace. (No notification
crosses the transfer engine for it: on shared memory that would be a TCP round trip of its
own per request.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec
import numpy as np
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, StatusCode

from engine.protocol import PrefillResult
from engine.sim_link import SimulatedLink
from shared import tracing
from shared.messages import KvPoolLayout, KvTarget
from transfer_engine.batch import PieceArrays
from transfer_engine.engine import TransferEngine
from transfer_engine.errors import InvalidTransfer, TransferTimeout
from transfer_engine.wire import Compression

KV_SEGMENT = "kv"

@dataclass(frozen=True)
class HandoffReport:
    num_bytes: int
    seconds: float  # from the first write starting to the last byte landed
    transport: str
    tail_s: float = 0.0  # from the last layer computed to its KV landed at decode
    compression: str = "none"  # on the wire: `fp8`, `int8` (TCP only) or none
    wire_bytes: int = 0  # what crossed: `num_bytes` unless compressed
    # The `kv.transfer` span, as the context `KvCommitted` goes out in (when tracing).
    trace_context: otel_context.Context | None = None


class KvStream(Protocol):
    on_layer: Callable[[int, list[int]], None] | None

    async def finish(self, result: PrefillResult, timeout_s: float) -> HandoffReport:
        """Wait until every layer of `result`'s KV landed at decode; raise `TransferFailed`
        or `TransferTimeout`."""

    def cancel(self) -> None: ...


class KvHandoff(Protocol):
    def open(self, request_id: str, target: asyncio.Future[KvTarget]) -> KvStream:
        """A stream for one request; `target` resolves when decode names its blocks."""

    async def close(self) -> None: ...


class NoKvHandoff:
    """For engines that keep no KV to move (the fake engine): the decode side regenerates
    its state from the prompt, so nothing crosses and the report says so."""

    def open(self, request_id: str, target: asyncio.Future[KvTarget]) -> KvStream:
        return _NoStream()

    async def close(self) -> None:
        return None


class _NoStream:
    on_layer = None

    async def finish(self, result: PrefillResult, timeout_s: float) -> HandoffReport:
        return HandoffReport(num_bytes=0, seconds=0.0, transport="none")

    def cancel(self) -> None:
        return None


def piece_offsets(layout: KvPoolLayout, layer: int, block_ids: np.ndarray) -> np.ndarray:
    """Byte offsets in the pool of `block_ids`' K pieces of `layer`, then of their V pieces."""
    return np.concatenate([((layer * 2 + kind) * layout.num_blocks + block_ids)
                           * layout.layer_block_bytes for kind in (0, 1)])


def kv_pieces(local: KvPoolLayout, remote: KvPoolLayout,
              layers: Sequence[tuple[int, Sequence[int], Sequence[int]]]) -> PieceArrays:
    """One batch moving, for each (layer, local block ids, remote block ids), that layer's K
    and V pieces between two KV pools (segment `kv` on both sides)."""
    local_offsets = np.concatenate([piece_offsets(local, layer, np.asarray(ids, np.int64))
                                    for layer, ids, _ in layers])
    remote_offsets = np.concatenate([piece_offsets(remote, layer, np.asarray(ids, np.int64))
                                     for layer, _, ids in layers])
    lengths = np.full(len(local_offsets), local.layer_block_bytes, dtype=np.int64)
    return PieceArrays(KV_SEGMENT, KV_SEGMENT, local_offsets, remote_offsets, lengths)


def peer_layout(local: KvPoolLayout, peer_id: str, layout: KvPoolLayout | None,
                num_blocks: int, layer_block_bytes: int) -> KvPoolLayout:
    """The peer's pool, checked against ours before any byte moves: its whole `layout`, or,
    from a peer that predates `KvPoolLayout`, its block count and piece size."""
    if layout is None:  # an older peer: only the piece size can be compared
        if layer_block_bytes != local.layer_block_bytes:
            raise InvalidTransfer(
                f"{peer_id} has KV pieces of {layer_block_bytes} bytes, this worker "
                f"{local.layer_block_bytes}: they must run the same model, dtype and block "
                "size")
        return msgspec.structs.replace(local, num_blocks=num_blocks)
    mismatch = local.mismatch(layout)
    if mismatch is not None:
        raise InvalidTransfer(f"{peer_id}'s KV pool does not match this worker's ({mismatch}):"
                              " they must run the same model, dtype and block size")
    return layout


class LayerwiseKvHandoff:
    def __init__(self, transfer: TransferEngine, layout: KvPoolLayout, *,
                 is_layerwise: bool = True, link: SimulatedLink | None = None,
                 compression: Compression | None = None) -> None:
        self._transfer = transfer
        self._layout = layout
        self._is_layerwise = is_layerwise
        self._link = link
        self._compression = compression

    def open(self, request_id: str, target: asyncio.Future[KvTarget]) -> KvStream:
        return _LayerStream(request_id, self._transfer, self._layout, target,
                            self._is_layerwise, self._link, self._compression)

    async def close(self) -> None:
        return None  # the worker owns and closes the transfer engine


class _LayerStream:
    def __init__(self, request_id: str, transfer: TransferEngine, layout: KvPoolLayout,
                 target: asyncio.Future[KvTarget], is_layerwise: bool,
                 link: SimulatedLink | None = None,
                 compression: Compression | None = None) -> None:
        self._request_id = request_id
        self._link = link
        self._compression = compression
        self._applied = "none"  # the compression the transfers used (none on shm)
        self._wire_bytes = 0
        self._transfer = transfer
        self._layout = layout
        self._target = target
        self._is_layerwise = is_layerwise
        self._loop = asyncio.get_running_loop()
        self._layers: asyncio.Queue[tuple[int, list[int]]] = asyncio.Queue()
        self._last_layer_at = 0.0
        self._num_bytes = 0
        self._transport = "none"
        self._first_write_at = 0.0
        self._span: Span | None = None  # kv.transfer, when tracing
        self._task = self._loop.create_task(self._run())

    def on_layer(self, layer: int, block_ids: list[int]) -> None:
        """Engine thread: layer `layer` of the prompt is in `block_ids`."""
        if layer == self._layout.num_layers - 1:
            self._last_layer_at = time.perf_counter()
        self._loop.call_soon_threadsafe(self._layers.put_nowait, (layer, block_ids))

    async def finish(self, result: PrefillResult, timeout_s: float) -> HandoffReport:
        try:
            landed_at = await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
        except TimeoutError:
            self._task.cancel()
            raise TransferTimeout(f"KV of {result.request_id} not at decode within "
                                  f"{timeout_s:g} s") from None
        return HandoffReport(num_bytes=self._num_bytes,
                             seconds=landed_at - self._first_write_at,
                             transport=self._transport,
                             tail_s=max(0.0, landed_at - self._last_layer_at),
                             compression=self._applied, wire_bytes=self._wire_bytes,
                             trace_context=None if self._span is None
                             else trace.set_span_in_context(self._span))

    def cancel(self) -> None:
        self._task.cancel()

    async def _run(self) -> float:
        target = await self._target
        remote = peer_layout(self._layout, target.decode_worker_id, target.kv_layout,
                             target.kv_num_blocks, target.kv_block_bytes)
        pending: list[tuple[int, list[int]]] = []
        try:
            for _ in range(self._layout.num_layers):
                pending.append(await self._layers.get())
                if self._is_layerwise or len(pending) == self._layout.num_layers:
                    if self._span is None and tracing.is_traced():
                        self._span = tracing.tracer(__name__).start_span("kv.transfer")
                    await self._write(pending, target, remote)
                    pending = []
        except BaseException as exc:
            if self._span is not None:
                self._span.record_exception(exc)
                self._span.set_status(StatusCode.ERROR)
            raise
        finally:
            if self._span is not None:
                self._describe(self._span, target)
                self._span.end()
        return time.perf_counter()

    def _describe(self, span: Span, target: KvTarget) -> None:
        seconds = time.perf_counter() - self._first_write_at if self._first_write_at else 0.0
        span.set_attributes({
            "halfmoon.request_id": self._request_id,
            "halfmoon.decode_worker": target.decode_worker_id,
            "kv.bytes": self._num_bytes, "kv.seconds": seconds,
            "kv.gbps": self._num_bytes / seconds / 1e9 if seconds > 0 else 0.0,
            "kv.transport": self._transport, "kv.compression": self._applied,
            "kv.wire_bytes": self._wire_bytes,
            "kv.layerwise": self._is_layerwise,
        })

    async def _write(self, layers: list[tuple[int, list[int]]], target: KvTarget,
                     remote: KvPoolLayout) -> None:
        """One transfer of these layers' K and V pieces into decode's reserved blocks."""
        for _, block_ids in layers:
            if len(block_ids) > len(target.block_ids):
                raise InvalidTransfer(f"decode reserved {len(target.block_ids)} blocks for a "
                                      f"prompt that fills {len(block_ids)}")
        pieces = kv_pieces(self._layout, remote, [
            (layer, block_ids, target.block_ids[:len(block_ids)]) for layer, block_ids in layers])
        started_at = time.perf_counter()
        self._first_write_at = self._first_write_at or started_at
        result = await self._transfer.write(target.decode_worker_id, pieces,
                                            compression=self._compression,
                                            incarnation=target.engine_incarnation)
        if self._link is not None:
            await self._link.carry(result.wire_bytes, started_at)
        self._num_bytes += result.num_bytes
        self._wire_bytes += result.wire_bytes
        self._transport = result.transport
        self._applied = result.compression or "none"

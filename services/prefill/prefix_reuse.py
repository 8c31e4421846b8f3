"""Prefix reuse across prefill workers: fetch cached KV blocks instead of computing them.

The conductor names, in `PrefillTask.prefix_source`, a worker whose prefix cache holds more of
the prompt than the chosen worker's, when moving those blocks is cheaper than computing them.
The chosen worker (the fetcher) then, before prefill:
  1. hashes the prompt's blocks, skips those its own cache holds, and allocates blocks for
     the rest;
  2. sends `PrefixFetch` (request/reply) to the holder, naming those blocks' hashes and ids;
  3. the holder holds the leading run of them it still has (so they are neither evicted nor
     reused meanwhile), writes every layer's K and V straight into the fetcher's blocks
     through the transfer engine, releases them and answers `PrefixFetched`;
  4. the fetcher caches the written blocks under their hashes: its prefill finds them in its
     own prefix cache, computes only the rest, and streams the whole prompt's KV to decode.
A failed fetch costs only time: prefill computes what was not fetched. KV bytes never travel
on NATS, only hashes and block ids.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from nats.aio.client import Client as NatsClient

from engine.protocol import Engine, KvLayout
from shared import tracing
from shared.block_hash import block_hashes
from shared.errors import CapacityExhausted, HalfmoonError, InvalidRequest
from shared.logs import get_logger
from shared.messages import PrefixFetch, PrefixFetched, PrefixSource
from shared.metrics import PrefillMetrics
from shared.nats_client import fetch_prefix
from shared.subjects import Subjects
from transfer_engine.engine import TransferEngine
from transfer_engine.errors import InvalidTransfer
from transfer_engine.handoff import kv_pieces

log = get_logger(__name__)


@dataclass(kw_only=True)
class PrefixSharing:
    """Both sides of prefix reuse for one prefill worker with a KV pool."""

    worker_id: str
    engine: Engine
    layout: KvLayout
    transfer: TransferEngine
    nc: NatsClient
    subjects: Subjects
    block_size: int
    timeout_s: float  # a fetch's, and the holder's transfer's (the transfer engine's)
    metrics: PrefillMetrics

    # The fetcher.
    async def fetch(self, request_id: str, prompt_token_ids: list[int], source: PrefixSource
                    ) -> int:
        """Fetch the prompt's cached blocks this worker lacks from `source` into its own
        prefix cache; return how many blocks arrived (0 when the fetch failed)."""
        with tracing.span(__name__, "prefix.fetch", attributes={
                "halfmoon.holder": source.worker_id}) as span:
            num_blocks, outcome = await self._fetch(request_id, prompt_token_ids, source)
            self.metrics.prefix_fetches.labels(outcome).inc()
            if span is not None:
                span.set_attributes({"halfmoon.fetched_blocks": num_blocks,
                                     "halfmoon.outcome": outcome})
            return num_blocks

    async def _fetch(self, request_id: str, prompt_token_ids: list[int], source: PrefixSource
                     ) -> tuple[int, str]:
        """(blocks fetched, outcome: fetched | held | skipped | failed)."""
        hashes = block_hashes(prompt_token_ids, self.block_size)[:source.num_blocks]
        wanted = hashes[self.engine.num_cached_blocks(hashes):]
        if not wanted:
            return 0, "held"
        try:
            block_ids = self.engine.allocate_blocks(len(wanted))
        except CapacityExhausted as exc:
            log.info("prefix.fetch_skipped", request_id=request_id, reason=exc.message)
            return 0, "skipped"
        started = time.perf_counter()
        try:
            reply = await fetch_prefix(self.nc, self.subjects.prefix_fetch(source.worker_id),
                                       PrefixFetch(
                                           request_id=request_id, requester_id=self.worker_id,
                                           block_hashes=[h.hex() for h in wanted],
                                           block_ids=block_ids,
                                           kv_num_blocks=self.layout.num_blocks,
                                           kv_block_bytes=self.layout.block_bytes),
                                       self.timeout_s)
        except BaseException as exc:
            # The holder may still be writing into these blocks: give them back only once
            # its transfer has surely ended (it times out after `timeout_s` too).
            asyncio.get_running_loop().call_later(self.timeout_s, self.engine.release_blocks,
                                                  block_ids)
            if isinstance(exc, HalfmoonError):
                log.warning("prefix.fetch_failed", request_id=request_id,
                            holder=source.worker_id, error=exc.message)
                return 0, "failed"
            raise
        num_blocks = min(reply.num_blocks, len(wanted))
        self.engine.cache_blocks(block_ids, wanted[:num_blocks])
        log.info("prefix.fetched", request_id=request_id, holder=source.worker_id,
                 num_blocks=num_blocks, kv_bytes=reply.num_bytes, transport=reply.transport,
                 seconds=round(time.perf_counter() - started, 6))
        if reply.num_bytes:
            self.metrics.observe_transfer(reply.transport, reply.num_bytes,
                                          time.perf_counter() - started)
        return num_blocks, "fetched"

    # The holder.
    async def serve(self, fetch: PrefixFetch) -> PrefixFetched:
        """Write the leading run of the requested blocks this worker holds."""
        if fetch.kv_block_bytes != self.layout.block_bytes:
            raise InvalidTransfer(f"{fetch.requester_id} has KV blocks of "
                                  f"{fetch.kv_block_bytes} bytes, this worker "
                                  f"{self.layout.block_bytes}")
        try:
            hashes = [bytes.fromhex(h) for h in fetch.block_hashes[:len(fetch.block_ids)]]
        except ValueError as exc:
            raise InvalidRequest(f"block hashes must be hex: {exc}") from exc
        held = self.engine.hold_prefix(hashes)
        try:
            if not held:
                return PrefixFetched(worker_id=self.worker_id, num_blocks=0)
            remote = KvLayout(self.layout.num_layers, fetch.kv_num_blocks, fetch.kv_block_bytes)
            pieces = kv_pieces(self.layout, remote, [
                (layer, held, fetch.block_ids[:len(held)])
                for layer in range(self.layout.num_layers)])
            result = await self.transfer.write(fetch.requester_id, pieces)
        finally:
            self.engine.release_blocks(held)
        return PrefixFetched(worker_id=self.worker_id, num_blocks=len(held),
                             num_bytes=result.num_bytes, transport=result.transport)

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

import time
from dataclasses import dataclass

from nats.aio.client import Client as NatsClient

from engine.protocol import PrefixCache
from services.kv_handoff import kv_pieces, peer_layout
from services.kv_leases import LeaseTable
from shared import tracing
from shared.block_hash import block_hashes
from shared.errors import CapacityExhausted, HalfmoonError, InvalidRequest
from shared.logs import get_logger
from shared.messages import KvPoolLayout, PrefixFetch, PrefixFetched, PrefixSource
from shared.metrics import PrefillMetrics
from shared.nats_client import fetch_prefix
from shared.subjects import Subjects
from transfer_engine.engine import TransferEngine
from transfer_engine.wire import Compression

log = get_logger(__name__)


@dataclass(kw_only=True)
class PrefixSharing:
    """Both sides of prefix reuse for one prefill worker with a KV pool."""

    worker_id: str
    cache: PrefixCache
    layout: KvPoolLayout
    transfer: TransferEngine
    nc: NatsClient
    subjects: Subjects
    block_size: int
    timeout_s: float  # a fetch's, and the holder's transfer's (the transfer engine's)
    metrics: PrefillMetrics
    leases: LeaseTable  # both sides hold blocks for the other under a `prefix_fetch` lease
    compression: Compression | None = None  # how the blocks this holder serves go on the wire

    # The fetcher.
    async def fetch(self, request_id: str, prompt_token_ids: list[int], source: PrefixSource
                    ) -> int:
        """Fetch the prompt's cached blocks this worker lacks from `source` into its own
        prefix cache; return how many blocks arrived (0 when the fetch failed)."""
        with tracing.continued_span(__name__, "prefix.fetch", attributes={
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
        wanted = hashes[self.cache.num_cached_blocks(hashes):]
        if not wanted:
            return 0, "held"
        try:
            block_ids = self.cache.allocate_blocks(len(wanted))
        except CapacityExhausted as exc:
            log.info("prefix.fetch_skipped", request_id=request_id, reason=exc.message)
            return 0, "skipped"
        started = time.perf_counter()
        # Held for the holder's transfer; on success its blocks join our cache.
        self.leases.grant("prefix_fetch", request_id, source.worker_id, len(block_ids),
                          self.timeout_s, block_ids)
        try:
            reply = await fetch_prefix(self.nc, self.subjects.prefix_fetch(source.worker_id),
                                       PrefixFetch(
                                           request_id=request_id, requester_id=self.worker_id,
                                           block_hashes=[h.hex() for h in wanted],
                                           block_ids=block_ids,
                                           kv_num_blocks=self.layout.num_blocks,
                                           kv_block_bytes=self.layout.layer_block_bytes,
                                           kv_layout=self.layout,
                                           engine_incarnation=self.transfer.incarnation),
                                       self.timeout_s)
        except BaseException as exc:
            # The holder may still be writing into these blocks: the lease keeps them until
            # its transfer has surely ended (it times out after `timeout_s` too); its expiry
            # frees them.
            if isinstance(exc, HalfmoonError):
                log.warning("prefix.fetch_failed", request_id=request_id,
                            holder=source.worker_id, error=exc.message)
                return 0, "failed"
            raise
        self.leases.release("prefix_fetch", request_id)
        num_blocks = min(reply.num_blocks, len(wanted))
        self.cache.cache_blocks(block_ids, wanted[:num_blocks])
        log.debug("prefix.fetched", request_id=request_id, holder=source.worker_id,
                  num_blocks=num_blocks, kv_bytes=reply.num_bytes, transport=reply.transport,
                  kv_compression=reply.compression,
                  seconds=round(time.perf_counter() - started, 6))
        if reply.num_bytes:
            self.metrics.observe_transfer(reply.transport, reply.num_bytes,
                                          time.perf_counter() - started)
        return num_blocks, "fetched"

    # The holder.
    async def serve(self, fetch: PrefixFetch) -> PrefixFetched:
        """Write the leading run of the requested blocks this worker holds."""
        remote = peer_layout(self.layout, fetch.requester_id, fetch.kv_layout,
                             fetch.kv_num_blocks, fetch.kv_block_bytes)
        try:
            hashes = [bytes.fromhex(h) for h in fetch.block_hashes[:len(fetch.block_ids)]]
        except ValueError as exc:
            raise InvalidRequest(f"block hashes must be hex: {exc}") from exc
        held = self.cache.hold_prefix(hashes)
        if not held:
            return PrefixFetched(worker_id=self.worker_id, num_blocks=0)
        self.leases.grant("prefix_fetch", fetch.request_id, fetch.requester_id, len(held),
                          self.timeout_s)
        try:
            pieces = kv_pieces(self.layout, remote, [
                (layer, held, fetch.block_ids[:len(held)])
                for layer in range(self.layout.num_layers)])
            result = await self.transfer.write(fetch.requester_id, pieces,
                                               compression=self.compression,
                                               incarnation=fetch.engine_incarnation)
        finally:
            self.leases.release("prefix_fetch", fetch.request_id)
            self.cache.release_blocks(held)
        return PrefixFetched(worker_id=self.worker_id, num_blocks=len(held),
                             num_bytes=result.num_bytes, transport=result.transport,
                             compression=result.compression or "none")

"""Where transfer engines find each other's descriptors (`TransferEndpoint`).

`NatsEndpointRegistry` keeps them in a NATS KV bucket, one key per engine. A peer that is not
in any registry can still be reached by address: the TCP handshake returns its descriptor.
"""

from __future__ import annotations

import re
from typing import Protocol

import msgspec
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from shared.jetstream_assets import answered, ensure_bucket
from shared.messages import TransferEndpoint
from transfer_engine.errors import InvalidTransfer

_KEY = re.compile(r"^[-/_=.a-zA-Z0-9]+$")
_decoder = msgspec.json.Decoder(TransferEndpoint)


class EndpointRegistry(Protocol):
    async def put(self, endpoint: TransferEndpoint) -> None: ...

    async def get(self, engine_id: str) -> TransferEndpoint | None:
        """The engine's descriptor, or None if it has none registered."""

    async def delete(self, engine_id: str) -> None: ...


class NatsEndpointRegistry:
    """Descriptors in a NATS KV bucket (`Subjects.transfer_bucket`), keyed by engine id."""

    def __init__(self, bucket: KeyValue) -> None:
        self._bucket = bucket

    @classmethod
    async def open(cls, js: JetStreamContext, bucket: str, *, replicas: int = 1
                   ) -> NatsEndpointRegistry:
        """The registry in `bucket`, created if missing (with `replicas` copies). No TTL: a
        dead engine's descriptor stays until it is replaced, and reaching it fails fast with
        `TransferFailed`."""
        return cls(await ensure_bucket(js, bucket, ttl_s=0, replicas=replicas))

    async def put(self, endpoint: TransferEndpoint) -> None:
        await answered(lambda: self._bucket.put(_key(endpoint.engine_id),
                                                msgspec.json.encode(endpoint)),
                       f"descriptor of {endpoint.engine_id}")

    async def get(self, engine_id: str) -> TransferEndpoint | None:
        try:
            entry = await self._bucket.get(_key(engine_id))
        except nats.js.errors.KeyNotFoundError:
            return None
        if not entry.value:
            return None
        return _decoder.decode(entry.value)

    async def delete(self, engine_id: str) -> None:
        await self._bucket.delete(_key(engine_id))


class LocalEndpointRegistry:
    """A registry in this process (tests; single-process deployments)."""

    def __init__(self) -> None:
        self._endpoints: dict[str, TransferEndpoint] = {}

    async def put(self, endpoint: TransferEndpoint) -> None:
        self._endpoints[endpoint.engine_id] = endpoint

    async def get(self, engine_id: str) -> TransferEndpoint | None:
        return self._endpoints.get(engine_id)

    async def delete(self, engine_id: str) -> None:
        self._endpoints.pop(engine_id, None)


def _key(engine_id: str) -> str:
    if not _KEY.match(engine_id):
        raise InvalidTransfer(f"engine id {engine_id!r} is not a valid registry key")
    return engine_id

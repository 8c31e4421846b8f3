"""Stored Responses API responses, in a NATS KV bucket every gateway of the cluster shares
(`Subjects.responses_bucket`, entries living `responses_ttl_s`): what `previous_response_id`
continues and `GET /v1/responses/{id}` returns. A gateway keeps nothing itself.

A response that cannot be stored (larger than the server's largest message, say) is
answered all the same and says `store: false`; storing never fails a request.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from shared.errors import PreviousResponseNotFound, ResponseNotFound
from shared.jetstream_assets import Redeclare
from shared.logs import get_logger
from shared.messages import StoredResponse

log = get_logger(__name__)

_KEY = re.compile(r"[-_=.a-zA-Z0-9]{1,256}")  # what a KV key may be (and our ids are)
_decoder = msgspec.json.Decoder(StoredResponse)


class ResponseStore:
    """Stored responses by id; `bucket` None when storing is off (`responses_ttl_s` 0)."""

    def __init__(self, bucket: KeyValue | None, redeclare: Redeclare | None = None) -> None:
        self._bucket = bucket
        self._redeclare = redeclare  # the bucket, when a put finds it gone

    @property
    def is_on(self) -> bool:
        return self._bucket is not None

    async def keep(self, response: dict[str, Any], conversation: list[dict[str, Any]],
                   num_input_items: int) -> bool:
        """Store the response; False (logged) when it could not be."""
        if self._bucket is None:
            return False
        value = msgspec.json.encode(StoredResponse(
            response=response, conversation=conversation, num_input_items=num_input_items))
        try:
            await self._bucket.put(response["id"], value)
        except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:
            log.warning("responses.not_stored", response_id=response["id"],
                        num_bytes=len(value), error=repr(exc))
            if isinstance(exc, nats.js.errors.NoStreamResponseError) and self._redeclare:
                await self._redeclare()  # the next response is stored again
            return False
        return True

    async def get(self, response_id: str) -> StoredResponse:
        """The stored response; `ResponseNotFound` if there is none."""
        stored = await self._read(response_id)
        if stored is None:
            raise ResponseNotFound(f"No response found with id '{response_id}'")
        return stored

    async def previous(self, response_id: str) -> StoredResponse:
        """The response a request continues; `PreviousResponseNotFound` if there is none."""
        stored = await self._read(response_id)
        if stored is None:
            raise PreviousResponseNotFound(
                f"Previous response with id '{response_id}' not found" + (
                    "" if self.is_on else " (this cluster stores no responses)"),
                param="previous_response_id")
        return stored

    async def delete(self, response_id: str) -> None:
        await self.get(response_id)  # ResponseNotFound if there is none
        if self._bucket is not None:
            await self._bucket.purge(response_id)

    async def _read(self, response_id: str) -> StoredResponse | None:
        if self._bucket is None or not _KEY.fullmatch(response_id):
            return None
        try:
            entry = await self._bucket.get(response_id)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        return None if entry.value is None else _decoder.decode(entry.value)

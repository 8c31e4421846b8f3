"""Stored Responses API responses in a real NATS KV bucket: kept, found, deleted; a full
bucket drops its oldest; what cannot be stored is reported, never raised; a bucket found
gone is declared again."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable

import pytest
from nats.aio.client import Client as NatsClient
from nats.js.kv import KeyValue

from services.gateway.response_store import ResponseStore
from shared.errors import PreviousResponseNotFound, ResponseNotFound
from shared.jetstream_assets import Redeclare, ensure_bucket
from shared.nats_client import connect


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NatsClient]:
    client = await connect(nats_url, "response-store-test")
    yield client
    await client.close()


async def store_of(nc: NatsClient, max_bytes: int = 1 << 20) -> ResponseStore:
    bucket = f"responses_{uuid.uuid4().hex[:8]}"
    return ResponseStore(await ensure_bucket(nc.jetstream(), bucket, 60.0,
                                             max_bytes=max_bytes))


def response(response_id: str, text: str = "hi") -> dict[str, object]:
    return {"id": response_id, "object": "response", "output_text": text}


async def test_a_kept_response_is_found_until_deleted(nc: NatsClient) -> None:
    store = await store_of(nc)
    conversation = [{"role": "user", "content": "hi"}, {"type": "message", "role": "assistant"}]
    assert await store.keep(response("resp_a"), conversation, num_input_items=1)
    stored = await store.get("resp_a")
    assert (stored.response, stored.conversation, stored.num_input_items) == (
        response("resp_a"), conversation, 1)
    assert (await store.previous("resp_a")).conversation == conversation
    await store.delete("resp_a")
    with pytest.raises(ResponseNotFound, match="resp_a"):
        await store.get("resp_a")
    with pytest.raises(PreviousResponseNotFound) as info:
        await store.previous("resp_a")
    assert info.value.param == "previous_response_id"


async def test_an_id_no_key_can_be_is_simply_not_found(nc: NatsClient) -> None:
    store = await store_of(nc)
    for response_id in ("no such id", "*", "a>b", ""):
        with pytest.raises(ResponseNotFound):
            await store.get(response_id)


async def test_a_full_bucket_drops_its_oldest_responses(nc: NatsClient) -> None:
    store = await store_of(nc, max_bytes=64 << 10)
    for i in range(40):
        assert await store.keep(response(f"resp_{i}", "x" * 4000), [], num_input_items=0)
    assert (await store.get("resp_39")).response["id"] == "resp_39"
    with pytest.raises(ResponseNotFound):
        await store.get("resp_0")


async def test_a_response_too_large_to_store_is_reported_not_raised(nc: NatsClient) -> None:
    store = await store_of(nc, max_bytes=64 << 20)
    too_large = response("resp_big", "x" * (nc.max_payload + 1))
    assert await store.keep(too_large, [], num_input_items=0) is False
    with pytest.raises(ResponseNotFound):
        await store.get("resp_big")


async def test_a_store_that_is_off_keeps_nothing_and_says_so(nc: NatsClient) -> None:
    store = ResponseStore(None)
    assert await store.keep(response("resp_a"), [], num_input_items=0) is False
    with pytest.raises(PreviousResponseNotFound, match="stores no responses"):
        await store.previous("resp_a")


async def test_a_bucket_found_gone_is_declared_again(nc: NatsClient) -> None:
    """Deleted (or lost with a server's store) under a running gateway: the put that finds
    it gone is reported, and the bucket is declared again for the next."""
    bucket = f"responses_{uuid.uuid4().hex[:8]}"

    def declare() -> Awaitable[KeyValue]:
        return ensure_bucket(nc.jetstream(), bucket, 60.0, max_bytes=1 << 20)

    store = ResponseStore(await declare(), Redeclare(declare, "the test bucket"))
    await nc.jetstream().delete_stream(f"KV_{bucket}")
    assert not await store.keep(response("resp_lost"), [], num_input_items=0)
    assert await store.keep(response("resp_kept"), [], num_input_items=0)
    assert (await store.get("resp_kept")).response == response("resp_kept")

"""A NATS server whose JetStream store has little room (a small disk, a quota): the bounded
assets (the prefix-cache event stream, the stored-responses bucket) reserve their size in the
store when created, and one the store cannot hold is made smaller rather than stop the
service; with no room at all, the error says what to do."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from shared.errors import ConfigError
from shared.jetstream_assets import KV_EVENTS_MAX_BYTES, ensure_bucket
from shared.nats_server import EmbeddedNatsServer
from tests.stack import Stack

pytestmark = pytest.mark.e2e


def small_server(tmp_path: Path, store: str) -> Iterator[str]:
    config = tmp_path / "nats.conf"
    config.write_text(f"jetstream {{\n  max_file_store: {store}\n}}\n")
    server = EmbeddedNatsServer(config_file=config)
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture
def small_store_url(tmp_path: Path) -> Iterator[str]:
    yield from small_server(tmp_path, "300MB")


async def test_a_stack_starts_on_a_small_store_with_smaller_reservations(
        small_store_url: str) -> None:
    async with Stack(small_store_url) as stack:  # asks for 256 MiB + 1 GiB: fits 286 MiB
        status, body = await stack.post("/v1/responses", {
            "model": "halfmoon-tiny", "input": "hi", "max_output_tokens": 4})
        assert status == 200, body
        status, again = await stack.post("/v1/responses", {
            "model": "halfmoon-tiny", "input": "and then", "max_output_tokens": 4,
            "previous_response_id": body["id"]})
        assert status == 200, again  # stored, and continued
        nc = await nats.connect(small_store_url)
        try:
            js = nc.jetstream()
            events = await js.stream_info(stack.conductor.subjects.kv_events_stream)
            responses = await js.stream_info(f"KV_{stack.gateway.subjects.responses_bucket}")
        finally:
            await nc.close()
        reserved = [events.config.max_bytes, responses.config.max_bytes]
        assert 0 < sum(reserved) <= 300 * 2**20  # NATS counts MB as MiB
        assert events.config.max_bytes < KV_EVENTS_MAX_BYTES or responses.config.max_bytes \
            < stack.gateway.config.responses_max_bytes


async def test_a_store_with_no_room_is_a_clear_error(tmp_path: Path) -> None:
    for url in small_server(tmp_path, "4MB"):
        nc = await nats.connect(url)
        try:
            with pytest.raises(ConfigError, match="no room to reserve 8 MiB for KV bucket"):
                await ensure_bucket(nc.jetstream(), "tight", 60, max_bytes=1 << 30)
        finally:
            await nc.close()

"""Shared fixtures: one real nats-server (JetStream) per test session, on a free port."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from shared.logs import configure_logging
from shared.nats_server import EmbeddedNatsServer
from tests.stack import Stack

configure_logging("warning", "console")


@pytest.fixture(scope="session")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Every stack of the session gets a cluster of its own, and each cluster's KV-event
    stream reserves its `max_bytes` (256 MiB) of the server's JetStream storage, by default
    75 % of the disk's free space: a session of a few hundred stacks would run out on a
    fuller disk ("insufficient storage resources"). The tests write little; the limit is
    raised so that what they reserve never decides. The largest message is nats-server's
    default, 1 MiB, not halfmoon's 8 MiB: what must cross in pieces does so at test sizes."""
    config = tmp_path_factory.mktemp("nats") / "nats.conf"
    config.write_text("max_payload: 1MB\njetstream {\n  max_file_store: 1TB\n}\n")
    server = EmbeddedNatsServer(config_file=config)
    url = server.start()
    yield url
    server.stop()


@pytest.fixture
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    async with Stack(nats_url) as running:
        yield running

"""Shared fixtures: one real nats-server (JetStream) per test session, on a free port."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from shared.logs import configure_logging
from shared.nats_server import EmbeddedNatsServer
from tests.stack import Stack

configure_logging("warning", "console")


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    server = EmbeddedNatsServer()
    url = server.start()
    yield url
    server.stop()


@pytest.fixture
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    async with Stack(nats_url) as running:
        yield running

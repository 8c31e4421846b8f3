"""Where the gateway works on a request body: small ones on the event loop, large ones (or
those continuing a stored conversation) in a worker thread, so that no other stream waits."""

from __future__ import annotations

import threading

from services.gateway.json_bodies import LARGE_BODY_BYTES, worked_on


async def test_large_bodies_and_continued_conversations_are_worked_on_in_a_thread() -> None:
    loop_thread = threading.get_ident()
    assert await worked_on(b'{"model": "m"}', threading.get_ident) == loop_thread
    assert await worked_on(b" " * LARGE_BODY_BYTES, threading.get_ident) != loop_thread
    assert await worked_on(b"{}", threading.get_ident, is_large=True) != loop_thread

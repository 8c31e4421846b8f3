"""A stream whose decode worker dropped the request (an abort meant for another placement
of it reached the worker: a conductor that stood still and woke to overdue replies) is
handed back when the gateway asks for what it lacks, and placed again: the client gets its
whole answer. Before, the gateway asked again every second, got nothing, and the client
waited for its own timeout."""

from __future__ import annotations

import openai
import pytest

from engine.fake_engine import fake_completion
from services.gateway.tokenizer import ByteTokenizer
from shared.messages import AbortRequest
from shared.nats_client import encode
from tests.integration.test_events import subscriber
from tests.stack import Stack

pytestmark = pytest.mark.e2e

PROMPT = "dropped on the way"
NUM_TOKENS = 100  # 2 s at 20 ms a token


async def test_a_stream_its_decode_worker_dropped_is_placed_again(nats_url: str) -> None:
    stack = Stack(nats_url, num_decode=2, worker={"fake_token_delay_s": 0.02})
    async with stack, subscriber(stack) as events, \
            openai.AsyncOpenAI(base_url=stack.base_url, api_key="x", max_retries=0,
                               timeout=15) as sdk:
        stream = await sdk.completions.create(model="halfmoon-tiny", prompt=PROMPT,
                                              max_tokens=NUM_TOKENS, temperature=0.0,
                                              stream=True)
        text, dropped_at = "", 0
        async for chunk in stream:
            text += chunk.choices[0].text
            if len(text) >= 10 and not dropped_at:  # its decode worker drops it, telling no one
                dropped_at = len(text)
                (placed,) = [e for e in events if e.kind == "placed"]
                await stack.gateway.nc.publish(stack.gateway.subjects.abort, encode(
                    AbortRequest(request_id=chunk.id, reason="meant for another placement",
                                 worker_id=placed.decode_worker_id)))
    tokenizer = ByteTokenizer()
    assert text == tokenizer.decode(fake_completion(tokenizer.encode(PROMPT), None, NUM_TOKENS))
    (migrated,) = [e for e in events if e.kind == "migrated"]
    assert migrated.lost_worker_id == placed.decode_worker_id
    assert migrated.num_output_tokens >= dropped_at
    await stack.wait_blocks_free()

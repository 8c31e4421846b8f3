"""Bad input and overload at the gateway: OpenAI-style errors, never a 500, never a leak."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgspec
import openai
import pytest
from nats.aio.msg import Msg

from services.conductor import holding
from services.worker import DecodeService
from shared.messages import AbortRequest
from shared.nats_client import subscribed
from tests.stack import Stack, eventually

pytestmark = pytest.mark.e2e

MODEL = "halfmoon-tiny"
GOOD = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
RESPONSE = {"model": MODEL, "input": "hi", "max_output_tokens": 4}


def assert_openai_error(body: Any, *, type_: str, param: str | None = None,
                        code: str | None = None) -> None:
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    assert error["type"] == type_
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code


BAD_REQUESTS = [
    ("invalid_json", "/v1/completions", b"{not json", 400, None),
    ("empty_body", "/v1/completions", b"", 400, None),
    ("wrong_type", "/v1/completions", {**GOOD, "max_tokens": "ten"}, 400, "max_tokens"),
    ("temperature_type", "/v1/chat/completions", {**CHAT, "temperature": "hot"}, 400,
     "temperature"),
    ("missing_prompt", "/v1/completions", {"model": MODEL}, 400, None),
    ("zero_max_tokens", "/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("negative_max_tokens", "/v1/chat/completions", {**CHAT, "max_tokens": -1}, 400,
     "max_tokens"),
    ("max_tokens_beyond_context", "/v1/completions", {**GOOD, "max_tokens": 5000}, 400,
     "max_tokens"),
    ("prompt_beyond_context", "/v1/completions", {**GOOD, "prompt": "x" * 3000}, 400,
     "prompt"),
    ("empty_messages", "/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("n_two", "/v1/chat/completions", {**CHAT, "n": 2}, 400, "n"),
    ("empty_prompt", "/v1/completions", {**GOOD, "prompt": ""}, 400, "prompt"),
    ("unknown_model", "/v1/completions", {**GOOD, "model": "gpt-9"}, 404, "model"),
    ("user_turn_without_content", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": None}]}, 400, "messages"),
    ("stream_options_without_stream", "/v1/chat/completions",
     {**CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("responses_empty_input", "/v1/responses", {**RESPONSE, "input": []}, 400, "input"),
    ("responses_wrong_type", "/v1/responses", {**RESPONSE, "max_output_tokens": "ten"}, 400,
     "max_output_tokens"),
    ("responses_unknown_previous", "/v1/responses",
     {**RESPONSE, "previous_response_id": "resp_1"}, 400, "previous_response_id"),
    ("responses_unknown_model", "/v1/responses", {**RESPONSE, "model": "gpt-9"}, 404, "model"),
    ("responses_beyond_context", "/v1/responses", {**RESPONSE, "max_output_tokens": 5000},
     400, "max_output_tokens"),
    ("responses_input_beyond_context", "/v1/responses", {**RESPONSE, "input": "x" * 3000},
     400, "input"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"),
                         [case[1:] for case in BAD_REQUESTS],
                         ids=[case[0] for case in BAD_REQUESTS])
async def test_bad_input_gets_an_openai_error(
    stack: Stack, path: str, body: Any, status: int, param: str | None,
) -> None:
    async with aiohttp.ClientSession() as session:
        kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
        async with session.post(f"{stack.gateway.url}{path}", **kwargs) as response:
            assert response.status == status
            payload = await response.json()
    assert_openai_error(payload, type_="invalid_request_error", param=param)


async def test_context_errors_carry_openais_code(stack: Stack) -> None:
    status, body = await stack.post("/v1/completions", {**GOOD, "max_tokens": 5000})
    assert status == 400
    assert body["error"]["code"] == "context_length_exceeded"


async def test_responses_errors_name_the_responses_fields(stack: Stack) -> None:
    status, body = await stack.post("/v1/responses", {**RESPONSE, "max_output_tokens": 5000})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert "max_output_tokens asks for 5000" in body["error"]["message"]
    assert "max_tokens" not in body["error"]["message"]


async def test_unknown_route_is_a_json_404(stack: Stack) -> None:
    status, body = await stack.post("/v1/embeddings", {"model": MODEL})
    assert status == 404
    assert_openai_error(body, type_="invalid_request_error")


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/v1/responses/resp_1"), ("DELETE", "/v1/responses/resp_1"),
    ("POST", "/v1/responses/resp_1/cancel"), ("GET", "/v1/responses/resp_1/input_items"),
    ("GET", "/v1/responses/no%20such%20key")])
async def test_a_response_never_stored_is_not_found(stack: Stack, method: str,
                                                    path: str) -> None:
    async with aiohttp.ClientSession() as session, \
            session.request(method, f"{stack.gateway.url}{path}") as response:
        assert response.status == 404
        body = await response.json()
    assert_openai_error(body, type_="invalid_request_error")
    assert body["error"]["message"].startswith("No response found with id")


async def test_sdk_raises_typed_errors(stack: Stack) -> None:
    async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="x", max_retries=0) as sdk:
        with pytest.raises(openai.NotFoundError, match="gpt-9"):
            await sdk.completions.create(model="gpt-9", prompt="a")
        with pytest.raises(openai.BadRequestError, match="n > 1 needs the torch engine"):
            await sdk.chat.completions.create(model=MODEL, n=3, messages=[
                {"role": "user", "content": "a"}])
        with pytest.raises(openai.BadRequestError, match="bad_words needs the torch engine"):
            await sdk.completions.create(model=MODEL, prompt="a",
                                         extra_body={"bad_words": ["moon"]})


async def test_bad_requests_do_not_disturb_requests_in_flight(stack: Stack) -> None:
    async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="x", max_retries=0) as sdk:
        good = [sdk.completions.create(model=MODEL, prompt=f"g{i}", max_tokens=30, seed=i)
                for i in range(8)]
        bad = [stack.post("/v1/completions", {**GOOD, "max_tokens": "x"}) for _ in range(8)]
        results = await asyncio.gather(*good, *bad)
    assert all(r.choices[0].finish_reason == "length" for r in results[:8])
    assert all(status == 400 for status, _ in results[8:])
    await stack.wait_blocks_free()


async def test_api_key_is_required_when_configured(nats_url: str) -> None:
    async with Stack(nats_url, gateway_options={"api_key": "s3cret"}) as stack:
        status, body = await stack.post("/v1/completions", GOOD)
        assert status == 401
        assert_openai_error(body, type_="authentication_error", code="invalid_api_key")
        status, _ = await stack.post("/v1/completions", GOOD,
                                     headers={"Authorization": "Bearer wrong"})
        assert status == 401
        status, _ = await stack.post("/v1/completions", GOOD,
                                     headers={"Authorization": "Bearer s3cret"})
        assert status == 200
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="s3cret") as sdk:
            assert (await sdk.models.list()).data[0].id == MODEL


async def test_browser_pages_of_allowed_origins_may_call_the_api(nats_url: str) -> None:
    """CORS (`cors_origins`): an allowed origin's preflight is answered without the API key
    (browsers send none); its requests, streamed too, say the origin may read them and
    expose `x-request-id`; another origin gets no CORS header and still needs the key."""
    app, other = "https://app.example.com", "https://evil.example.com"
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    async with Stack(nats_url, gateway_options={"api_key": "s3cret", "cors_origins":
                                                f"{app}, https://other.example.com/"}) as stack, \
            aiohttp.ClientSession() as session:
        url = f"{stack.gateway.url}/v1/chat/completions"
        async with session.options(url, headers={"Origin": app, **preflight}) as response:
            assert response.status == 204
            assert response.headers["Access-Control-Allow-Origin"] == app
            assert "POST" in response.headers["Access-Control-Allow-Methods"]
            assert response.headers["Access-Control-Allow-Headers"] == \
                "authorization, content-type"
        async with session.options(url, headers={"Origin": other, **preflight}) as response:
            assert response.status != 204  # refused as any OPTIONS is: no key, no CORS
            assert "Access-Control-Allow-Origin" not in response.headers
        auth = {"Authorization": "Bearer s3cret"}
        for stream in (False, True):
            async with session.post(url, json={**CHAT, "max_tokens": 3, "stream": stream},
                                    headers={"Origin": app, **auth}) as response:
                assert response.status == 200
                assert response.headers["Access-Control-Allow-Origin"] == app
                assert response.headers["Access-Control-Expose-Headers"] == "x-request-id"
                assert response.headers["Vary"] == "Origin"
                await response.read()
        async with session.post(url, json={**CHAT, "max_tokens": 3},
                                headers={"Origin": other}) as response:
            assert response.status == 401
            assert "Access-Control-Allow-Origin" not in response.headers
            assert response.headers["Vary"] == "Origin"
    async with Stack(nats_url, gateway_options={"cors_origins": "*"}) as stack, \
            aiohttp.ClientSession() as session:
        async with session.get(f"{stack.gateway.url}/v1/models",
                               headers={"Origin": other}) as response:
            assert response.status == 200
            assert response.headers["Access-Control-Allow-Origin"] == "*"
        async with session.get(f"{stack.gateway.url}/health",
                               headers={"Origin": other}) as response:
            assert "Access-Control-Allow-Origin" not in response.headers  # /v1 only


async def test_request_beyond_kv_capacity_gets_429(nats_url: str) -> None:
    async with Stack(nats_url, worker={"num_blocks": 4, "block_size": 4}) as stack:
        status, body = await stack.post("/v1/completions", {**GOOD, "max_tokens": 100})
        assert status == 429
        assert_openai_error(body, type_="rate_limit_error", code="capacity_exhausted")
        status, _ = await stack.post("/v1/completions", {**GOOD, "max_tokens": 4})
        assert status == 200
        await stack.wait_blocks_free()


async def test_no_decode_worker_gets_503(nats_url: str) -> None:
    """Once the hold for a worker to come back (here 0.5 s) is spent."""
    async with Stack(nats_url, conductor_options={"no_worker_hold_s": 0.5}) as stack:
        await stack.decodes[0].stop()
        status, body = await stack.post("/v1/completions", GOOD)
        assert status == 503
        assert_openai_error(body, type_="service_unavailable", code="worker_unavailable")
        await stack.wait_blocks_free()


async def test_streaming_request_rejected_before_any_token_gets_its_http_status(
    nats_url: str,
) -> None:
    async with Stack(nats_url, worker={"num_blocks": 4, "block_size": 4}) as stack:
        status, body = await stack.post("/v1/chat/completions",
                                        {**CHAT, "max_tokens": 100, "stream": True})
        assert status == 429
        assert_openai_error(body, type_="rate_limit_error")


async def test_a_stuck_worker_ends_the_request_with_504_not_a_hang(nats_url: str) -> None:
    async with Stack(nats_url, worker={"fake_token_delay_s": 0.05},
                     gateway_options={"request_timeout_s": 1.0}) as stack:
        decode = stack.decodes[0]
        request = asyncio.create_task(stack.post("/v1/completions",
                                                 {**GOOD, "max_tokens": 500}))
        await eventually(lambda: decode.engine.stats().num_running == 1)
        for task in list(decode._tasks):  # steps stop; heartbeats go on: stuck, not dead
            if task.get_name().endswith("steps"):
                task.cancel()
        status, body = await asyncio.wait_for(request, 5)
        assert status == 504
        assert_openai_error(body, type_="timeout", code="timeout")


async def test_a_dead_worker_with_no_replacement_ends_in_503(nats_url: str) -> None:
    """Once the hold for a worker to come back (here 1 s) is spent."""
    async with Stack(nats_url, worker={"fake_token_delay_s": 0.05},
                     conductor_options={"no_worker_hold_s": 1.0}) as stack:
        decode = stack.decodes[0]
        request = asyncio.create_task(stack.post("/v1/completions",
                                                 {**GOOD, "max_tokens": 500}))
        await eventually(lambda: decode.engine.stats().num_running == 1)
        await decode._cancel_tasks()  # the process "dies": no steps, no heartbeats
        await decode.nc.close()
        stack.decodes.remove(decode)  # nothing left to stop
        status, body = await asyncio.wait_for(request, 10)
        assert status == 503
        assert_openai_error(body, type_="service_unavailable")


async def test_predicted_ttft_over_the_slo_is_rejected_early_with_retry_after(
    nats_url: str,
) -> None:
    conductor = {"ttft_slo_ms": 50.0}
    async with Stack(nats_url, worker={"fake_prefill_s_per_token": 0.01},
                     conductor_options=conductor) as stack:
        async with aiohttp.ClientSession() as session, session.post(
            f"{stack.gateway.url}/v1/completions",
            json={**GOOD, "prompt": "x" * 40},
        ) as response:
            assert response.status == 429
            assert int(response.headers["Retry-After"]) >= 1
            assert_openai_error(await response.json(), type_="rate_limit_error")
        status, _ = await stack.post("/v1/completions", {**GOOD, "prompt": "x"})
        assert status == 200  # 1 token at 100 tokens/s: 10 ms, within the SLO
        assert stack.conductor.rejections["slo"] == 1
        await stack.wait_blocks_free()


async def test_prompts_sent_one_after_another_are_not_refused_for_those_computed_before(
        nats_url: str) -> None:
    """60 ms a prompt against a 100 ms SLO, heartbeats 2 s apart: the conductor counted
    every prompt sent since the last heartbeat as still queued (120 ms for the second), and
    refused all but the first until the next heartbeat. A prefill worker heartbeats soon
    after each prefill now (`services/heartbeat_sender.py`)."""
    timeout = {"heartbeat_timeout_s": 5.0}
    async with Stack(nats_url, worker={"fake_prefill_s_per_token": 0.001,
                                       "heartbeat_interval_s": 2.0},
                     conductor_options={"ttft_slo_ms": 100.0, **timeout},
                     gateway_options=timeout) as stack:
        for _ in range(6):
            status, body = await stack.post("/v1/completions", {**GOOD, "prompt": "x" * 60})
            assert status == 200, body
        assert stack.conductor.rejections["slo"] == 0


async def test_predicted_tbt_over_the_slo_is_rejected_once_the_decode_worker_is_busy(
        nats_url: str) -> None:
    """Steps of 50 ms at any batch against a 20 ms SLO: the idle worker takes a request (alone,
    its steps are the fastest that worker has, and running them measures them again); while
    that one runs, the next is refused."""
    async with Stack(nats_url, worker={"fake_token_delay_s": 0.05},
                     conductor_options={"tbt_slo_ms": 20.0}) as stack:
        first = asyncio.create_task(stack.post("/v1/completions", {**GOOD, "max_tokens": 40}))
        await eventually(lambda: stack.decodes[0].engine.stats().num_running == 1)
        status, body = await stack.post("/v1/completions", GOOD)
        assert status == 429
        assert "between tokens" in body["error"]["message"]
        assert (await first)[0] == 200


SDK_BAD_REQUESTS = [
    ("wrong_type", {"max_tokens": "ten"}, openai.BadRequestError),
    ("unknown_model", {"model": "gpt-9"}, openai.NotFoundError),
    ("zero_max_tokens", {"max_tokens": 0}, openai.BadRequestError),
    ("beyond_context", {"max_tokens": 5000}, openai.BadRequestError),
    ("prompt_beyond_context", {"messages": [{"role": "user", "content": "x" * 3000}]},
     openai.BadRequestError),
    ("empty_messages", {"messages": []}, openai.BadRequestError),
    ("n_two", {"n": 2}, openai.BadRequestError),
]


@pytest.mark.parametrize(("fields", "error"), [c[1:] for c in SDK_BAD_REQUESTS],
                         ids=[c[0] for c in SDK_BAD_REQUESTS])
async def test_bad_input_through_the_sdk_raises_its_typed_error(
    stack: Stack, fields: dict[str, Any], error: type[openai.APIStatusError],
) -> None:
    async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="x", max_retries=0) as sdk:
        with pytest.raises(error) as info:
            await sdk.chat.completions.create(**{**CHAT, **fields})  # type: ignore[call-overload]
    body = info.value.body
    assert isinstance(body, dict) and {"message", "type", "param", "code"} <= set(body)


async def test_missing_api_key_through_the_sdk_is_401(nats_url: str) -> None:
    async with (
        Stack(nats_url, gateway_options={"api_key": "s3cret"}) as stack,
        openai.AsyncOpenAI(base_url=stack.base_url, api_key="wrong", max_retries=0) as sdk,
    ):
        with pytest.raises(openai.AuthenticationError, match="API key"):
            await sdk.chat.completions.create(**CHAT)  # type: ignore[call-overload]


async def test_a_request_waits_for_kv_that_running_requests_will_free(nats_url: str) -> None:
    """Decode's pool is full of running requests (placement saw no KV room): the conductor
    holds the newcomer until they finish and free their blocks, instead of a 429 (by
    default, for as long as its gateway waits)."""
    async with Stack(nats_url, worker={"fake_token_delay_s": 0.02},
                     decode_options={"num_blocks": 12},
                     gateway_options={"request_timeout_s": 8.0},
                     conductor_options={"no_worker_hold_s": 0.0}) as stack:
        # Each takes 7 of the 12 blocks at placement (prompt + a block of output; one block
        # is the growth watermark): one fits at a time, and the others find no room.
        body = {**GOOD, "prompt": "x" * 85, "max_tokens": 20}
        replies = await asyncio.gather(*(stack.post("/v1/completions", body)
                                         for _ in range(3)))
        assert [status for status, _ in replies] == [200] * 3, replies
        assert all(reply["usage"]["completion_tokens"] == 20 for _, reply in replies)
        await stack.wait_blocks_free()


@pytest.mark.parametrize(("conductor", "gateway"), [
    ({"kv_short_hold_s": 1.5}, {}),
    ({}, {"request_timeout_s": 1.5 + holding.ANSWER_MARGIN_S}),
], ids=["kv_short_hold", "default_hold"])
async def test_kv_that_does_not_free_within_the_hold_ends_in_a_429(
        nats_url: str, conductor: dict[str, float], gateway: dict[str, float]) -> None:
    """Held, then refused (by default just before the gateway would stop waiting, as its
    request says: `wait_s`); and while held, the request was never sent to a worker, so no
    worker was told to drop it (before, each delivery broadcast an abort to all of them)."""
    async with Stack(nats_url, worker={"fake_token_delay_s": 0.05},
                     decode_options={"num_blocks": 12}, conductor_options=conductor,
                     gateway_options=gateway) as stack:
        body = {**GOOD, "prompt": "x" * 85, "max_tokens": 100}  # runs ~5 s, holds 7 blocks
        running = asyncio.create_task(stack.post("/v1/completions", body))
        await eventually(lambda: stack.decodes[0].engine.stats().num_running == 1)
        aborts: list[AbortRequest] = []
        decoder = msgspec.json.Decoder(AbortRequest)

        async def on_abort(msg: Msg) -> None:
            aborts.append(decoder.decode(msg.data))

        await stack.gateway.nc.subscribe(stack.gateway.subjects.abort, cb=on_abort)
        await subscribed(stack.gateway.nc)
        started = asyncio.get_running_loop().time()
        async with aiohttp.ClientSession() as session, session.post(
                f"{stack.base_url}/completions", json={**body, "max_tokens": 2}) as response:
            reply = await response.json()
            assert response.status == 429, reply
            assert "x-should-retry" not in response.headers  # worth trying again later
            assert response.headers["Retry-After"] == "1"
        assert reply["error"]["code"] == "capacity_exhausted"
        assert "KV" in reply["error"]["message"]
        assert 1.0 <= asyncio.get_running_loop().time() - started < 4  # held, then refused
        # The gateway's own abort of the request it gave up on (it may come back after the
        # answer), and nothing from the conductor (whose aborts came during the hold).
        await eventually(lambda: bool(aborts))
        assert [abort.reason for abort in aborts] == ["gateway"]
        running.cancel()


async def test_a_request_larger_than_the_whole_kv_pool_is_refused_at_once(
        nats_url: str) -> None:
    """A 429, which OpenAI's SDKs retry twice (0.5-8 s apart) unless the answer says
    `x-should-retry: false`, as this one does: no wait makes the request fit."""
    async with Stack(nats_url, decode_options={"num_blocks": 12}) as stack:
        started = asyncio.get_running_loop().time()
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="x") as sdk:
            with pytest.raises(openai.RateLimitError, match="whole pool") as refused:
                await sdk.completions.create(model=MODEL, prompt="x" * 300, max_tokens=2)
        assert refused.value.response.headers["x-should-retry"] == "false"
        assert asyncio.get_running_loop().time() - started < 2  # not held, not retried
        assert stack.gateway.metrics.registry.get_sample_value(
            "halfmoon_requests_total", {"route": "/v1/completions", "status": "429"}) == 1


async def test_a_prompt_over_the_message_bus_limit_is_a_400_and_a_shorter_one_is_served(
        nats_url: str) -> None:
    """The test server carries 1 MiB a message: a 300k-token prompt (4 bytes a token on the
    wire) fits the model's context and the KV pool but not one NATS message. A 503 before,
    which clients retry; it is the request that must change."""
    async with Stack(nats_url, worker={"max_model_len": 400_000, "num_blocks": 30_000},
                     gateway_options={"max_model_len": 400_000}) as stack:
        for stream in (False, True):
            status, body = await stack.post("/v1/completions", {
                **GOOD, "prompt": "x" * 300_000, "stream": stream})
            assert status == 400, body
            assert_openai_error(body, type_="invalid_request_error", code="invalid_request")
            assert "max_payload" in body["error"]["message"]
        status, body = await stack.post("/v1/completions", {**GOOD, "prompt": "x" * 200_000})
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] == 200_000
        await stack.wait_blocks_free()


async def test_a_request_waits_for_a_decode_worker_that_comes_back(nats_url: str) -> None:
    """No decode worker for a moment (a restart, a partition healing): the conductor holds
    the request instead of answering 503 at once."""
    async with Stack(nats_url, conductor_options={"no_worker_hold_s": 6.0}) as stack:
        decode = stack.decodes[0]
        await decode.stop()
        await eventually(lambda: not stack.conductor.workers.healthy("decode"), timeout_s=5)
        request = asyncio.create_task(stack.post("/v1/completions", {**GOOD, "max_tokens": 3}))
        await asyncio.sleep(1.0)
        assert not request.done()
        stack.decodes[0] = DecodeService(decode.config)
        await stack.decodes[0].start()
        status, body = await asyncio.wait_for(request, 10)
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 3

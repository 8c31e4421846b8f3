"""Which JetStream errors are retried (`answered`), and how."""

from __future__ import annotations

import nats.errors
import nats.js.errors
import pytest

from shared.jetstream_assets import answered, is_transient


@pytest.mark.parametrize("exc", [
    nats.errors.TimeoutError(), nats.js.errors.NoStreamResponseError(),
    nats.errors.OutboundBufferLimitError(),  # reconnecting, with its send buffer full
    nats.js.errors.ServiceUnavailableError(code=503), nats.js.errors.ServerError(code=500),
    nats.js.errors.APIError(code=None), nats.js.errors.APIError(code=408)])
def test_unanswered_calls_and_server_side_refusals_are_transient(exc: Exception) -> None:
    assert is_transient(exc)


@pytest.mark.parametrize("exc", [
    nats.js.errors.BadRequestError(code=400), nats.js.errors.NotFoundError(code=404),
    nats.js.errors.BucketNotFoundError(), nats.js.errors.NoKeysError(),
    nats.js.errors.KeyWrongLastSequenceError(description="wrong last sequence"),
    nats.js.errors.ServerError(code=500, err_code=10047,  # a full store stays full
                               description="insufficient storage resources available"),
    ValueError("not nats")])
def test_client_errors_are_not_transient(exc: Exception) -> None:
    assert not is_transient(exc)


async def test_a_call_is_made_again_until_it_is_answered() -> None:
    failures = [nats.js.errors.APIError(code=None), nats.errors.TimeoutError()]

    async def call() -> str:
        if failures:
            raise failures.pop(0)
        return "acked"

    assert await answered(call, "a publish", within_s=5) == "acked"
    assert not failures


async def test_a_client_error_is_raised_at_once() -> None:
    calls = []

    async def call() -> None:
        calls.append(1)
        raise nats.js.errors.BadRequestError(code=400, description="stream name in use")

    with pytest.raises(nats.js.errors.BadRequestError):
        await answered(call, "a stream", within_s=5)
    assert len(calls) == 1


async def test_past_its_window_the_last_error_is_raised() -> None:
    async def call() -> None:
        raise nats.js.errors.ServiceUnavailableError(code=503)

    with pytest.raises(nats.js.errors.ServiceUnavailableError):
        await answered(call, "a publish", within_s=0.2)

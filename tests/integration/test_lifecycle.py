"""Every service's lifecycle: start/stop twice, stop after a failed start, SIGTERM in flight."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from collections.abc import Callable

import msgspec
import openai
import pytest

from services.conductor.service import ConductorService
from services.gateway.service import GatewayService
from services.worker import DecodeService, PrefillService
from shared.config import ConductorConfig, GatewayConfig, WorkerConfig
from shared.config_loading import load_config
from shared.errors import ServiceStartFailed
from shared.nats_server import free_port
from shared.service import Service, ServiceState
from tests.stack import Stack, eventually

MODEL = "halfmoon-tiny"
FACTORIES: dict[str, Callable[[str, str], Service]] = {
    "gateway": lambda url, cluster: GatewayService(
        GatewayConfig(nats_url=url, cluster=cluster, port=0, connect_timeout_s=0.5,
                      tokenizer="bytes")),
    "conductor": lambda url, cluster: ConductorService(
        ConductorConfig(nats_url=url, cluster=cluster, connect_timeout_s=0.5)),
    "prefill": lambda url, cluster: PrefillService(
        load_config(WorkerConfig, flags={"nats_url": url, "cluster": cluster,
                                         "connect_timeout_s": 0.5, "engine": "fake"})),
    "decode": lambda url, cluster: DecodeService(
        load_config(WorkerConfig, flags={"nats_url": url, "cluster": cluster,
                                         "connect_timeout_s": 0.5, "engine": "fake"})),
}


def own_tasks() -> set[asyncio.Task[object]]:
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}


@pytest.mark.parametrize("kind", sorted(FACTORIES))
async def test_start_then_stop_twice(nats_url: str, kind: str) -> None:
    before = own_tasks()
    service = FACTORIES[kind](nats_url, "life")
    await service.start()
    assert service.state is ServiceState.RUNNING
    await service.stop()
    await service.stop()
    assert service.state is ServiceState.STOPPED
    assert service._nc is not None and service._nc.is_closed
    await eventually(lambda: own_tasks() <= before, 2.0)


@pytest.mark.parametrize("kind", sorted(FACTORIES))
async def test_start_is_refused_after_stop(nats_url: str, kind: str) -> None:
    service = FACTORIES[kind](nats_url, "life")
    await service.start()
    await service.stop()
    with pytest.raises(ServiceStartFailed, match="cannot start from state stopped"):
        await service.start()


@pytest.mark.parametrize("kind", sorted(FACTORIES))
async def test_stop_after_failed_start_leaves_nothing_behind(kind: str) -> None:
    dead_url = f"nats://127.0.0.1:{free_port()}"
    before = own_tasks()
    service = FACTORIES[kind](dead_url, "life")
    with pytest.raises(ServiceStartFailed, match="cannot reach NATS"):
        await service.start()
    assert service.state is ServiceState.STOPPED
    await service.stop()
    await eventually(lambda: own_tasks() <= before, 2.0)


async def test_failure_in_setup_closes_the_nats_connection(nats_url: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        config = GatewayConfig(nats_url=nats_url, cluster="life", port=busy.getsockname()[1],
                               tokenizer="bytes")
        gateway = GatewayService(config)
        with pytest.raises(ServiceStartFailed, match="Address already in use"):
            await gateway.start()
    assert gateway._nc is not None and gateway._nc.is_closed
    assert gateway.state is ServiceState.STOPPED


async def test_sigterm_drains_a_request_in_flight(nats_url: str) -> None:
    """SIGTERM on a decode worker mid-stream: the request finishes, then the worker stops."""
    async with Stack(nats_url, worker={"fake_token_delay_s": 0.01}) as stack:
        decode = stack.decodes[0]
        await decode.stop()  # replace it by one that runs under run(), as the CLI does
        runner = DecodeService(decode.config)
        stack.decodes[0] = runner
        running = asyncio.create_task(runner.run())
        await eventually(lambda: runner.state is ServiceState.RUNNING)
        await stack.wait_healthy()
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="x",
                                      max_retries=0) as sdk:
            request = asyncio.create_task(sdk.completions.create(
                model=MODEL, prompt="drain", max_tokens=60))
            await eventually(lambda: runner.engine.stats().num_running == 1)
            os.kill(os.getpid(), signal.SIGTERM)
            response = await request
        await asyncio.wait_for(running, 10)
        assert response.choices[0].finish_reason == "length"
        assert response.usage is not None and response.usage.completion_tokens == 60
        assert runner.state is ServiceState.STOPPED
        assert runner.engine.stats().num_free_blocks == runner.engine.stats().num_total_blocks


async def test_stop_past_the_drain_timeout_fails_requests_instead_of_hanging(
    nats_url: str,
) -> None:
    async with Stack(nats_url, worker={"fake_token_delay_s": 0.05}) as stack:
        decode = stack.decodes[0]
        decode.config = msgspec.structs.replace(decode.config, drain_timeout_s=0.2)
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="x",
                                      max_retries=0) as sdk:
            request = asyncio.create_task(sdk.completions.create(
                model=MODEL, prompt="cut", max_tokens=1000))
            await eventually(lambda: decode.engine.stats().num_running == 1)
            await decode.stop()
            with pytest.raises(openai.APIStatusError, match="decode worker stopped"):
                await request
        assert decode.engine.stats().num_free_blocks == decode.engine.stats().num_total_blocks
        await eventually(lambda: len(stack.gateway.table) == 0)


async def test_stop_ends_a_task_that_swallowed_its_first_cancellation(nats_url: str) -> None:
    # nats-py swallows a CancelledError that lands inside publish(); such a task lives on.
    service = FACTORIES["conductor"](nats_url, "life")
    await service.start()
    swallowed = asyncio.Event()

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed.is_set():
                    raise
                swallowed.set()

    task = service.spawn(stubborn(), "stubborn")
    await asyncio.wait_for(service.stop(), 10)
    assert swallowed.is_set() and task.cancelled()
    assert service.state is ServiceState.STOPPED

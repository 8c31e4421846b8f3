"""A worker told to serve another model (`RoleChange.model`): what it holds of the old model
finishes unchanged, then it reloads under the same worker id and answers for the new model
as transformers does on that checkpoint."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from engine.builtin_model import write_builtin_model
from services.gateway.tokenizer import HfTokenizer
from services.model_shelf import WorkerRunner
from services.worker import DecodeService, PrefillService, WorkerService
from shared.config import PlannerSettings
from shared.messages import DispatchReply, RoleChange
from shared.nats_client import dispatch
from shared.service import ServiceState
from tests.engine.hf_models import greedy_reference, hf_model
from tests.stack import Stack, eventually

pytestmark = pytest.mark.e2e

NUM_TOKENS = 24


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shelf")
    write_builtin_model(root / "alpha", seed=0, hidden_size=64, num_layers=2)
    write_builtin_model(root / "beta", seed=9, hidden_size=64, num_layers=2, vocab_size=600)
    return root


@pytest.fixture
async def cluster(nats_url: str, models_dir: Path
                  ) -> AsyncIterator[tuple[Stack, WorkerRunner]]:
    """alpha: a prefill and two decode workers, the second run as `halfmoon worker` runs it
    (reloading in place); beta: a prefill worker only, so it serves nothing yet."""
    alpha = str(models_dir / "alpha")
    stack = Stack(nats_url, num_decode=1, worker={
        "engine": "torch", "num_blocks": 256, "model": "alpha", "model_path": alpha,
        "models_dir": str(models_dir)}, gateway_options={"model": "alpha", "model_path": alpha})
    stack.prefills.append(PrefillService(stack.worker_config(
        model="beta", model_path=str(models_dir / "beta"))))
    runner = WorkerRunner(DecodeService(stack.worker_config()))
    async with stack:
        running = asyncio.create_task(runner.run())
        # Heard from before its start returns: running too, or a command finds it starting.
        await eventually(lambda: len(stack.conductor.workers.healthy("decode", model="alpha"))
                         == 2 and runner.service.state is ServiceState.RUNNING, timeout_s=10)
        try:
            yield stack, runner
        finally:
            runner.stop()
            await running


async def change_model(stack: Stack, worker: WorkerService, model: str) -> DispatchReply:
    return await dispatch(stack.gateway.nc, worker.subjects.role_change(worker.worker_id),
                          RoleChange(role="decode", model=model, reason="test"), 5)


async def greedy(sdk: openai.AsyncOpenAI, model: str, prompt: str) -> str:
    stream = await sdk.completions.create(model=model, prompt=prompt, max_tokens=NUM_TOKENS,
                                          temperature=0, stream=True,
                                          extra_body={"ignore_eos": True})
    return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])


def expected(path: Path, prompt: str) -> str:
    tokenizer = HfTokenizer(path)
    ids = tokenizer.encode(prompt, add_special_tokens=True)
    return tokenizer.decode(greedy_reference(hf_model(path), ids, NUM_TOKENS)[0])


async def test_a_worker_switched_to_another_model_finishes_the_old_and_serves_the_new(
        cluster: tuple[Stack, WorkerRunner], models_dir: Path) -> None:
    stack, runner = cluster
    switching = runner.service
    assert isinstance(switching, WorkerService)
    worker_id = switching.worker_id
    prompts = [f"story {i} about a half moon" for i in range(6)]
    async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="x", max_retries=0) as sdk:
        load = [asyncio.create_task(greedy(sdk, "alpha", p)) for p in prompts]
        await eventually(lambda: not switching.duty.is_idle(), timeout_s=10)
        assert (await change_model(stack, switching, "beta")).is_accepted
        draining = switching.heartbeat()  # every conductor sees the load in flight
        assert (draining.is_draining, draining.loading_model, draining.loading_role) == (
            True, "beta", "decode")
        texts = await asyncio.gather(*load)
        await eventually(lambda: stack.gateway.health()["models"]["beta"]["is_ready"],
                         timeout_s=30)
        beta_text = await greedy(sdk, "beta", prompts[0])
        alpha_after = await greedy(sdk, "alpha", prompts[0])  # the other decode worker
    assert texts == [expected(models_dir / "alpha", p) for p in prompts]
    assert beta_text == expected(models_dir / "beta", prompts[0])
    assert alpha_after == texts[0]
    reloaded = runner.service
    assert isinstance(reloaded, WorkerService) and reloaded is not switching
    assert (reloaded.worker_id, reloaded.config.model, reloaded.role) == (
        worker_id, "beta", "decode")
    heartbeat = reloaded.heartbeat()
    assert heartbeat.model == "beta" and heartbeat.model_load_s > 0
    assert heartbeat.loading_model == "" and heartbeat.loading_role is None
    assert heartbeat.models_on_disk == ["alpha", "beta"]
    changes = switching.metrics.registry.get_sample_value(
        "halfmoon_model_changes_total", {"from_model": "alpha", "to_model": "beta"})
    assert changes == 1


async def test_a_worker_back_from_another_model_gets_the_kv_in_its_new_pool(
        cluster: tuple[Stack, WorkerRunner], models_dir: Path) -> None:
    """alpha, beta, alpha again: the alpha prefill worker handed this worker KV before and
    kept its transfer descriptor; back, the worker is another incarnation with another pool
    (under the same shared-memory name), and the KV of the next requests must land there
    (before, it went into the old pool's mapping, and the worker decoded other text)."""
    stack, runner = cluster
    prompts = [f"tale {i} of the harbour" for i in range(8)]
    first = runner.service
    assert isinstance(first, WorkerService)
    async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="x", max_retries=0) as sdk:
        before = await asyncio.gather(*(greedy(sdk, "alpha", p) for p in prompts))
        assert first.kv_commits  # it got some of them, so the prefill worker knows it
        for model in ("beta", "alpha"):
            switching = runner.service
            assert (await change_model(stack, switching, model)).is_accepted  # type: ignore[arg-type]
            # Heard as serving the model, and done starting: it heartbeats from early in its
            # start, and refuses a change until started.
            await eventually(lambda model=model: first.worker_id in {  # type: ignore[misc]
                w.worker_id for w in stack.conductor.workers.healthy("decode", model=model)}
                and runner.service.state is ServiceState.RUNNING, timeout_s=30)
        await stack.decodes[0].stop()  # the other alpha decode worker: all go to this one
        after = await asyncio.gather(*(greedy(sdk, "alpha", p) for p in prompts))
    assert before == [expected(models_dir / "alpha", p) for p in prompts]
    assert after == before
    assert runner.service.kv_commits == {"shm": len(prompts)}  # type: ignore[attr-defined]


async def test_a_model_not_on_the_workers_disk_is_refused(
        cluster: tuple[Stack, WorkerRunner]) -> None:
    stack, runner = cluster
    reply = await change_model(stack, runner.service, "gamma")  # type: ignore[arg-type]
    assert not reply.is_accepted
    assert "`gamma` is not on this worker's disk" in reply.reason
    assert runner.service.heartbeat().model == "alpha"  # type: ignore[attr-defined]


# On the fake engine: a model with no decode worker gets one loaded for it, and the planner
# reassigns a worker to the model whose load dominates. Its "disk" is a directory per model.
def shelf(tmp_path: Path) -> str:
    for model in ("a", "b"):
        (tmp_path / model).mkdir()
    return str(tmp_path)


class Runners:
    """Decode workers run as `halfmoon worker` runs them (reloading in place)."""

    def __init__(self, stack: Stack, count: int, **options: Any) -> None:
        self.runners = [WorkerRunner(DecodeService(stack.worker_config(**options)))
                        for _ in range(count)]
        self._tasks = [asyncio.create_task(runner.run()) for runner in self.runners]

    async def stop(self) -> None:
        for runner in self.runners:
            runner.stop()
        await asyncio.gather(*self._tasks)

    def served(self) -> list[tuple[str, str]]:
        return sorted((r.service.config.model, r.service.role)  # type: ignore[attr-defined]
                      for r in self.runners)


async def test_a_model_without_a_decode_worker_gets_one_loaded_from_another_models(
        nats_url: str, tmp_path: Path) -> None:
    stack = Stack(nats_url, num_decode=0, worker={"model": "a", "models_dir": shelf(tmp_path)},
                  gateway_options={"model": "a"})
    stack.prefills.append(PrefillService(stack.worker_config(model="b")))  # b: no decode
    runners = Runners(stack, 2)
    try:
        async with stack:
            status, body = await stack.post("/v1/completions", {
                "model": "b", "prompt": "hello", "max_tokens": 4})
            assert status == 200, body
            assert body["model"] == "b" and body["usage"]["completion_tokens"] == 4
            assert runners.served() == [("a", "decode"), ("b", "decode")]
            status, _ = await stack.post("/v1/completions", {
                "model": "a", "prompt": "hello", "max_tokens": 4})
            assert status == 200
    finally:
        await runners.stop()


async def test_the_planner_reassigns_a_worker_to_the_model_whose_load_dominates(
        nats_url: str, tmp_path: Path) -> None:
    """a: one prefill and one decode worker under a prefill-heavy burst (no decode worker to
    spare); b: idle, with two decode workers. One of b's moves to a's prefill."""
    planning = PlannerSettings(mode="slo", interval_s=0.2, high=0.1, low=0.03, hold_s=0.5,
                               cooldown_s=30.0)
    stack = Stack(nats_url, worker={"model": "a", "models_dir": shelf(tmp_path),
                                    "fake_prefill_s_per_token": 0.002,
                                    "fake_prefill_delay_s": 0.001, "fake_token_delay_s": 0.01},
                  gateway_options={"model": "a"},
                  conductor_options={"ttft_slo_ms": 10_000, "planning": planning})
    stack.prefills.append(PrefillService(stack.worker_config(model="b")))
    runners = Runners(stack, 2, model="b")
    try:
        async with stack, openai.AsyncOpenAI(base_url=stack.base_url, api_key="x",
                                             max_retries=0) as sdk:
            requests = []
            for i in range(42):
                requests.append(asyncio.create_task(sdk.completions.create(
                    model="a", prompt=f"{i:03d} " + "x" * 96, max_tokens=4)))
                await asyncio.sleep(1 / 7)
            done = await asyncio.gather(*requests)
            await eventually(lambda: runners.served() == [("a", "prefill"),
                                                                ("b", "decode")], timeout_s=10)
            loop = stack.conductor.planning
            assert loop is not None
            moves = [(m.split.model, m.to_model, m.to_role, outcome) for m, outcome in loop.moves]
    finally:
        await runners.stop()
    assert all(c.usage is not None and c.usage.completion_tokens == 4 for c in done)
    assert ("b", "a", "prefill", "done") in moves

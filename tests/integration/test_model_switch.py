"""A worker told to serve another model (`RoleChange.model`): what it holds of the old model
finishes unchanged, then it reloads under the same worker id and answers for the new model
as transformers does on that checkpoint."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest

from engine.builtin_model import write_builtin_model
from services.gateway.tokenizer import HfTokenizer
from services.model_shelf import WorkerRunner
from services.worker import DecodeService, PrefillService, WorkerService
from shared.messages import DispatchReply, RoleChange
from shared.nats_client import dispatch
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
        await eventually(lambda: len(stack.conductor.workers.healthy("decode", model="alpha"))
                         == 2, timeout_s=10)
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
    assert heartbeat.models_on_disk == ["alpha", "beta"]
    changes = switching.metrics.registry.get_sample_value(
        "halfmoon_model_changes_total", {"from_model": "alpha", "to_model": "beta"})
    assert changes == 1


async def test_a_model_not_on_the_workers_disk_is_refused(
        cluster: tuple[Stack, WorkerRunner]) -> None:
    stack, runner = cluster
    reply = await change_model(stack, runner.service, "gamma")  # type: ignore[arg-type]
    assert not reply.is_accepted
    assert "`gamma` is not on this worker's disk" in reply.reason
    assert runner.service.heartbeat().model == "alpha"  # type: ignore[attr-defined]

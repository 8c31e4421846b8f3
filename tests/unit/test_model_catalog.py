"""Where the gateway finds each model's tokenizer, and which models it knows."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from engine.builtin_model import write_builtin_model
from services.gateway.model_catalog import ModelCatalog
from services.gateway.model_info import OPENAI_SAMPLING, SamplingDefaults, read_sampling_defaults
from shared.config import GatewayConfig
from shared.errors import ConfigError, ModelNotFound, WorkerUnavailable
from shared.heartbeats import WorkerDirectory
from shared.messages import WorkerHeartbeat


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models directory: `own` (2048 tokens) and `other` (256 tokens)."""
    root = tmp_path_factory.mktemp("models")
    write_builtin_model(root / "own", hidden_size=32, num_layers=1)
    write_builtin_model(root / "other", hidden_size=32, num_layers=1, vocab_size=400,
                        max_position_embeddings=256)
    return root


def heartbeat(model: str, model_path: str = "", worker_id: str = "w1",
              max_model_len: int = 0) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=worker_id, role="decode", model=model, host="h", num_running=0,
        num_waiting=0, max_batch_size=8, num_free_blocks=10, num_total_blocks=10,
        block_size=16, heartbeat_interval_s=0.5, sent_at_s=0.0, model_path=model_path,
        max_model_len=max_model_len)


def catalog(models: Path, workers: WorkerDirectory, **config: Any) -> ModelCatalog:
    return ModelCatalog(GatewayConfig(model="own", model_path=str(models / "own"), **config),
                        workers)


async def test_a_model_a_worker_serves_loads_from_the_workers_directory(models: Path) -> None:
    workers = WorkerDirectory(timeout_s=2.0)
    workers.observe(heartbeat("other", str(models / "other")))
    served = await catalog(models, workers).get("other")
    assert served.limits.max_model_len == 256
    assert served.limits.vocab_size == served.tokenizer.vocab_size < 1024


async def test_the_context_is_the_least_any_live_worker_holds(models: Path) -> None:
    """A worker whose KV pool holds less than the model's context says so; the gateway then
    admits no request past it (which that worker could never finish)."""
    workers = WorkerDirectory(timeout_s=2.0)
    workers.observe(heartbeat("other", str(models / "other"), "w1", max_model_len=0))
    models_of = catalog(models, workers)
    assert (await models_of.get("other")).limits.max_model_len == 256  # 0: no limit of its own
    workers.observe(heartbeat("other", str(models / "other"), "w2", max_model_len=200))
    workers.observe(heartbeat("other", str(models / "other"), "w3", max_model_len=120))
    workers.observe(heartbeat("own", worker_id="w4", max_model_len=64))  # another model's
    assert (await models_of.get("other")).limits.max_model_len == 120
    assert models_of.loaded("other").limits.max_model_len == 120  # type: ignore[union-attr]
    workers.observe(heartbeat("other", str(models / "other"), "w3"),
                    now_s=time.monotonic() - 60)  # w3 lost: the rest hold 200
    assert (await models_of.get("other")).limits.max_model_len == 200


async def test_models_dir_is_read_when_the_workers_directory_is_not_here(models: Path) -> None:
    workers = WorkerDirectory(timeout_s=2.0)
    workers.observe(heartbeat("other", "/on/another/host/other"))
    served = await catalog(models, workers, models_dir=str(models)).get("other")
    assert served.limits.max_model_len == 256


async def test_a_model_whose_files_cannot_be_read_is_unavailable(models: Path) -> None:
    workers = WorkerDirectory(timeout_s=2.0)
    workers.observe(heartbeat("other", "/on/another/host/other"))
    with pytest.raises(WorkerUnavailable, match="give the gateway --models-dir"):
        await catalog(models, workers).get("other")


async def test_a_model_no_worker_serves_is_not_found(models: Path) -> None:
    with pytest.raises(ModelNotFound, match="`other` does not exist"):
        await catalog(models, WorkerDirectory(timeout_s=2.0)).get("other")


async def test_the_listing_holds_the_own_model_and_live_workers_models(models: Path) -> None:
    workers = WorkerDirectory(timeout_s=2.0)
    workers.observe(heartbeat("other", str(models / "other")))
    catalog_ = catalog(models, workers)
    assert catalog_.names() == ["other", "own"]
    silent_since = time.monotonic() - 10.0  # past the timeout, not yet forgotten
    workers.observe(heartbeat("other", str(models / "other")), now_s=silent_since)
    assert catalog_.names() == ["own"]
    assert (await catalog_.get("other")).name == "other"  # remembered: restarting, not unknown


async def test_a_gateway_without_its_own_model_fails_to_start(tmp_path: Path) -> None:
    missing = ModelCatalog(GatewayConfig(model_path=str(tmp_path)), WorkerDirectory(2.0))
    with pytest.raises(ConfigError, match="no model at"):
        await missing.start()


async def test_a_model_s_generation_config_sets_its_sampling_defaults(tmp_path: Path) -> None:
    """As vLLM and SGLang read it (Qwen2.5-Instruct's values), unless the gateway is told to
    keep OpenAI's defaults."""
    model = write_builtin_model(tmp_path / "own", hidden_size=32, num_layers=1)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({
        **config, "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
        "repetition_penalty": 1.05, "max_new_tokens": 512}))
    workers = WorkerDirectory(timeout_s=2.0)
    recommended = SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20,
                                   repetition_penalty=1.05, max_tokens=512)
    assert (await catalog(tmp_path, workers).get("own")).limits.sampling_defaults \
        == recommended
    openai_only = await catalog(tmp_path, workers, sampling_defaults="openai").get("own")
    assert openai_only.limits.sampling_defaults == OPENAI_SAMPLING


def test_sampling_defaults_a_request_could_not_send_are_left_out(tmp_path: Path) -> None:
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"temperature": 3.0, "top_p": 0.9, "top_k": 0, "min_p": None,
                                "max_new_tokens": 0}))
    assert read_sampling_defaults(tmp_path) == SamplingDefaults(top_p=0.9)  # top_k 0: off
    path.write_text("{not json")
    with pytest.raises(ConfigError, match=r"generation_config\.json"):
        read_sampling_defaults(tmp_path)
    path.unlink()
    assert read_sampling_defaults(tmp_path) == OPENAI_SAMPLING

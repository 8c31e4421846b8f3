"""The KV pool sized from a memory budget (`engine.kv_budget`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.kv_budget import pool_blocks, weight_bytes
from engine.model_config import ModelConfig
from engine.torch_engine import EngineOptions, TorchEngine
from shared.errors import ConfigError
from shared.messages import KvPoolLayout
from tests.engine.hf_models import hf_model, make_checkpoint

CPU = torch.device("cpu")


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3_moe"])
def test_weight_bytes_counted_from_the_config_equal_the_checkpoint(
        family: str, tmp_path: Path) -> None:
    model_dir = make_checkpoint(tmp_path / family, family)
    parameters = sum(p.numel() for p in hf_model(model_dir).parameters())
    assert weight_bytes(ModelConfig.from_dir(model_dir), torch.float32) == 4 * parameters


def layout(config: ModelConfig, dtype: str, num_blocks: int = 7) -> KvPoolLayout:
    return KvPoolLayout(num_layers=config.num_layers, num_blocks=num_blocks, block_size=4,
                        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=dtype)


def test_a_memory_budget_sizes_the_pool_and_the_engine_uses_it(llama_dir: Path) -> None:
    config = ModelConfig.from_dir(llama_dir)
    per_block = layout(config, "bfloat16").block_bytes
    assert per_block == config.num_layers * 2 * 4 * config.num_kv_heads * config.head_dim * 2
    assert pool_blocks(config, layout(config, "bfloat16"), device=CPU,
                       kv_cache_memory_gb=0.001) == int(0.001 * 2**30 // per_block)
    assert pool_blocks(config, layout(config, "bfloat16"),
                       device=CPU) == 7  # no budget: the count given
    engine = TorchEngine(EngineOptions(model_dir=llama_dir, block_size=4, num_blocks=7,
                                       kv_cache_memory_gb=0.001))
    expected = int(0.001 * 2**30 // layout(config, "float32").block_bytes)
    assert engine.num_blocks == engine.kv_layout().num_blocks == expected
    assert engine.stats().num_total_blocks == expected


def test_a_budget_too_small_for_one_block_is_a_config_error(llama_dir: Path) -> None:
    config = ModelConfig.from_dir(llama_dir)
    with pytest.raises(ConfigError, match="no room for one KV block"):
        pool_blocks(config, layout(config, "float32"), device=CPU, kv_cache_memory_gb=1e-9)

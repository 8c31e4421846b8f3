"""Build the engine a worker config asks for."""

from __future__ import annotations

from pathlib import Path

from engine.fake_engine import FakeEngine
from engine.protocol import Engine
from shared.config import WorkerConfig
from shared.errors import ConfigError
from shared.model_dir import default_model_dir


def build_engine(config: WorkerConfig) -> Engine:
    match config.engine:
        case "fake":
            return FakeEngine(
                num_blocks=config.num_blocks,
                block_size=config.block_size,
                max_batch_size=config.max_batch_size,
                prefill_delay_s=config.fake_prefill_delay_s,
                prefill_s_per_token=config.fake_prefill_s_per_token,
                token_delay_s=config.fake_token_delay_s,
                is_prefix_caching=config.enable_prefix_caching,
            )
        case "sim":
            from engine.sim_cost import PROFILES
            from engine.sim_engine import SimEngine, SimOptions

            if config.sim_profile not in PROFILES:
                raise ConfigError(f"unknown sim_profile {config.sim_profile!r}; profiles: "
                                  f"{', '.join(PROFILES)}")
            if config.sim_time_scale <= 0 or config.sim_kv_byte_scale < 1:
                raise ConfigError("sim_time_scale must be > 0 and sim_kv_byte_scale >= 1")
            return SimEngine(SimOptions(
                profile=PROFILES[config.sim_profile], time_scale=config.sim_time_scale,
                block_size=config.block_size, max_batch_size=config.max_batch_size,
                max_batch_tokens=config.max_batch_tokens,
                kv_byte_scale=config.sim_kv_byte_scale,
                is_prefix_caching=config.enable_prefix_caching,
            ))
        case "torch":
            import torch

            from engine.builtin_model import ensure_builtin_model
            from engine.torch_engine import EngineOptions, TorchEngine

            model_dir = (Path(config.model_path).expanduser() if config.model_path
                         else ensure_builtin_model(default_model_dir()))
            return TorchEngine(EngineOptions(
                model_dir=model_dir, dtype=getattr(torch, config.dtype), device=config.device,
                num_blocks=config.num_blocks, block_size=config.block_size,
                max_batch_size=config.max_batch_size, max_batch_tokens=config.max_batch_tokens,
                max_wait_s=config.prefill_max_wait_ms / 1000, max_model_len=config.max_model_len,
                is_prefix_caching=config.enable_prefix_caching,
            ))
    raise ConfigError(f"unknown engine {config.engine!r}")

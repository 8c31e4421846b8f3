"""Build the engine a worker config asks for."""

from __future__ import annotations

from engine.fake_engine import FakeEngine
from engine.protocol import Engine
from shared.config import WorkerConfig
from shared.errors import ConfigError


def build_engine(config: WorkerConfig) -> Engine:
    match config.engine:
        case "fake":
            return FakeEngine(
                num_blocks=config.num_blocks,
                block_size=config.block_size,
                max_batch_size=config.max_batch_size,
                prefill_delay_s=config.fake_prefill_delay_s,
                token_delay_s=config.fake_token_delay_s,
            )
    raise ConfigError(f"unknown engine {config.engine!r}")

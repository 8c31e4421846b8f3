"""`--kv-transfer-dtype`: the compression a worker's KV goes on the wire with."""

from __future__ import annotations

import msgspec
import pytest

from services.worker_parts import wire_compression
from shared.config import WorkerConfig
from shared.config_loading import load_config
from shared.errors import ConfigError
from shared.messages import KvPoolLayout

LAYOUT = KvPoolLayout(num_layers=2, num_blocks=64, block_size=16, num_kv_heads=4,
                      head_dim=64, dtype="bfloat16")


def test_none_sends_the_pool_as_it_is_and_a_scheme_quantizes_its_dtype() -> None:
    assert wire_compression("none", LAYOUT) is None
    for scheme in ("fp8", "int8"):
        spec = wire_compression(scheme, LAYOUT)
        assert spec is not None and (spec.scheme, spec.dtype) == (scheme, "bfloat16")


def test_a_pool_the_quantizer_cannot_read_is_a_config_error() -> None:
    fp8_pool = msgspec.structs.replace(LAYOUT, dtype="float8_e4m3fn")
    with pytest.raises(ConfigError, match="--kv-transfer-dtype int8"):
        wire_compression("int8", fp8_pool)


def test_the_setting_is_a_flag_and_refuses_other_values() -> None:
    config = load_config(WorkerConfig, flags={"kv_transfer_dtype": "fp8"})
    assert config.transfer.kv_transfer_dtype == "fp8"
    with pytest.raises(ConfigError):
        load_config(WorkerConfig, flags={"kv_transfer_dtype": "fp4"})

"""One frozen config struct per service, read once and passed down.

Precedence, lowest first: field defaults, an optional TOML file (`--config`), environment
variables `HALFMOON_<FIELD>` (e.g. `HALFMOON_NATS_URL`), command-line flags (`--nats-url`).
Modules never read the environment themselves.
"""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec

from shared.errors import ConfigError

ENV_PREFIX = "HALFMOON_"

EngineKind = Literal["torch", "fake", "sim"]
PrefillPolicy = Literal["least-loaded", "round-robin", "cache-aware", "seed", "longest-prefix"]


class ServiceConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Settings every service shares."""

    nats_url: str = "nats://127.0.0.1:4222"
    cluster: str = "default"
    log_level: str = "info"
    log_format: Literal["auto", "json", "console"] = "auto"
    drain_timeout_s: float = 10.0
    connect_timeout_s: float = 10.0
    # Tracing (shared/tracing.py): auto follows the OTEL_* variables.
    tracing: Literal["auto", "off", "otlp-grpc", "otlp-http"] = "auto"
    otlp_endpoint: str | None = None
    trace_sample_ratio: float | None = None
    # Prometheus /metrics of services other than the gateway (0: a free port, logged).
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0


class GatewayConfig(ServiceConfig, frozen=True, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 8000
    gateway_id: str | None = None
    model: str = "halfmoon-tiny"
    max_model_len: int = 2048
    api_key: str | None = None
    request_timeout_s: float = 60.0
    heartbeat_timeout_s: float = 2.0  # a worker silent this long is lost: fail over
    chat_template_path: str | None = None
    model_path: str | None = None  # None: the built-in model
    tokenizer: Literal["model", "bytes"] = "model"  # "bytes" pairs with the fake engine


class ConductorConfig(ServiceConfig, frozen=True, kw_only=True):
    heartbeat_timeout_s: float = 2.0
    dispatch_timeout_s: float = 2.0
    max_placement_attempts: int = 3
    num_fetchers: int = 4
    request_max_age_s: float = 60.0
    policy: PrefillPolicy = "cache-aware"
    ttft_slo_ms: float | None = None  # reject when the best predicted TTFT exceeds it
    tbt_slo_ms: float | None = None  # reject when the best predicted decode step exceeds it
    default_prefill_tokens_per_s: float = 2000.0  # for workers that have not measured yet
    prefix_index_max_blocks: int = 1_000_000
    # Prefix reuse across prefill workers: fetch a longer cached prefix from its holder when
    # computing it costs more than moving its KV at this rate plus this overhead.
    prefix_fetch: bool = True
    transfer_bytes_per_s: float = 2e9
    transfer_overhead_s: float = 0.002


class WorkerConfig(ServiceConfig, frozen=True, kw_only=True):
    """Settings of a prefill or decode worker."""

    worker_id: str | None = None
    model: str = "halfmoon-tiny"
    host_name: str | None = None
    engine: EngineKind = "torch"
    model_path: str | None = None  # None: the built-in model
    dtype: Literal["float32", "bfloat16"] = "float32"
    device: str = "cpu"
    max_model_len: int = 2048
    num_blocks: int = 4096
    block_size: int = 16
    max_batch_size: int = 64
    max_batch_tokens: int = 2048
    prefill_max_wait_ms: float = 10.0
    enable_prefix_caching: bool = True
    max_queue: int = 256
    heartbeat_interval_s: float = 0.5
    kv_wait_timeout_s: float = 10.0
    compute_score: float = 1.0
    zone: str = ""
    fake_prefill_delay_s: float = 0.0  # the fake engine's cost per prefill batch...
    fake_prefill_s_per_token: float = 0.0  # ...plus this per uncached prompt token
    fake_token_delay_s: float = 0.0
    # The simulated engine: a model on an accelerator (engine/sim_cost.py PROFILES), its steps
    # slowed by `sim_time_scale` (wall s per simulated s), its KV bytes divided by
    # `sim_kv_byte_scale`; its KV capacity is what the profile's device memory holds. Its KV
    # handoffs take the time of the full bytes over a link of `sim_link_bytes_per_s` (50 GB/s:
    # one 400 Gb/s RDMA NIC per device; 0: only the real, scaled-down transfer's time).
    sim_profile: str = "llama-3-8b-h200"
    sim_time_scale: float = 1.0
    sim_kv_byte_scale: int = 4096
    sim_link_bytes_per_s: float = 50e9
    # KV transfer (engines with a KV pool): where this worker's transfer engine listens, what
    # peers dial, the transports it may use (in preference order), the shared secret every
    # worker of the cluster holds, and whether KV streams layer by layer or after prefill.
    transfer_host: str = "127.0.0.1"
    transfer_port: int = 0
    transfer_advertise_host: str | None = None
    transfer_transports: str = "shm,tcp"
    transfer_secret: str = ""
    kv_streaming: Literal["layerwise", "whole"] = "layerwise"
    # Decode only: prompts of at most this many tokens are prefilled here, not on a prefill
    # worker (conditional disaggregation; 0: off). Colocated mode sets it to the context size.
    local_prefill_max_tokens: int = 0


C = TypeVar("C", bound="ServiceConfig")


def config_fields(cls: type[ServiceConfig]) -> tuple[msgspec.structs.FieldInfo, ...]:
    return msgspec.structs.fields(cls)


def add_config_flags(parser: argparse.ArgumentParser, cls: type[ServiceConfig]) -> None:
    """One `--field-name` flag per config field; unset flags do not override anything."""
    parser.add_argument("--config", dest="config_path", default=None, help="TOML config file")
    for field in config_fields(cls):
        flag = "--" + field.name.replace("_", "-")
        default = field.default if field.default is not msgspec.NODEFAULT else None
        if field.type is bool:
            parser.add_argument(flag, dest=field.name, default=None,
                                action=argparse.BooleanOptionalAction)
        else:
            # `--nats` is the short spelling the docs use for `--nats-url`.
            aliases = ["--nats"] if field.name == "nats_url" else []
            parser.add_argument(flag, *aliases, dest=field.name, default=None,
                                help=f"default: {default}")


def load_config(
    cls: type[C],
    *,
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    toml_path: str | Path | None = None,
) -> C:
    """Merge file, environment and flags over the defaults and validate the result."""
    names = {field.name for field in config_fields(cls)}
    merged: dict[str, Any] = {}
    if toml_path is not None:
        merged.update(_read_toml(Path(toml_path), names))
    for key, value in (env or {}).items():
        name = key.removeprefix(ENV_PREFIX).lower()
        if key.startswith(ENV_PREFIX) and name in names:
            merged[name] = value
    merged.update({k: v for k, v in (flags or {}).items() if k in names and v is not None})
    try:
        return msgspec.convert(merged, cls, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid {cls.__name__}: {exc}") from exc


def _read_toml(path: Path, names: set[str]) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    unknown = set(data) - names
    if unknown:
        raise ConfigError(f"unknown keys in {path}: {sorted(unknown)}")
    return data

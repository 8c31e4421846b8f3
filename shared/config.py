"""One frozen config struct per service, read once and passed down.

Precedence, lowest first: field defaults, an optional TOML file (`--config`), environment
variables `HALFMOON_<FIELD>` (e.g. `HALFMOON_NATS_URL`), command-line flags (`--nats-url`).
Modules never read the environment themselves.
"""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import msgspec

from shared.errors import ConfigError

ENV_PREFIX = "HALFMOON_"

EngineKind = Literal["torch", "fake", "sim"]
PrefillPolicy = Literal["least-loaded", "round-robin", "cache-aware", "seed", "longest-prefix"]


class NatsAuth(msgspec.Struct, frozen=True, kw_only=True):
    """How a service proves who it is to NATS, and checks who NATS is: a credentials file
    (JWT + nkey seed), an nkey seed file, a user and password, or a token; TLS with a CA to
    trust and, for mutual TLS, this service's certificate and key (file paths). Secrets are
    never logged nor put in an error message (the repr hides them)."""

    creds: str | None = msgspec.field(default=None, name="nats_creds")
    nkey_seed: str | None = msgspec.field(default=None, name="nats_nkey_seed")
    user: str | None = msgspec.field(default=None, name="nats_user")
    password: str | None = msgspec.field(default=None, name="nats_password")
    token: str | None = msgspec.field(default=None, name="nats_token")
    tls_ca: str | None = msgspec.field(default=None, name="nats_tls_ca")
    tls_cert: str | None = msgspec.field(default=None, name="nats_tls_cert")
    tls_key: str | None = msgspec.field(default=None, name="nats_tls_key")

    def __repr__(self) -> str:
        shown = {name: ("***" if name in ("password", "token") else value)
                 for name in self.__struct_fields__
                 if (value := getattr(self, name)) is not None}
        return f"NatsAuth({', '.join(f'{k}={v!r}' for k, v in shown.items())})"


class ServiceConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Settings every service shares. `nats_url` may list several servers of one NATS
    cluster, comma-separated; `js_replicas` is how many copies of every JetStream asset
    (request queue, KV events, registries) the cluster keeps (3 in the cluster deployments)."""

    nats_url: str = "nats://127.0.0.1:4222"
    nats: NatsAuth = msgspec.field(default_factory=NatsAuth)
    js_replicas: int = 1
    cluster: str = "default"
    log_level: str = "info"
    log_format: Literal["auto", "json", "console"] = "auto"
    drain_timeout_s: float = 10.0
    connect_timeout_s: float = 10.0
    # Tracing (shared/tracing.py): auto follows the OTEL_* variables.
    tracing: Literal["auto", "off", "otlp-grpc", "otlp-http"] = "auto"
    otlp_endpoint: str | None = None
    trace_sample_ratio: float | None = None
    tracer: Literal["lean", "sdk"] = "lean"  # sdk: the OpenTelemetry SDK's own span objects
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
    # Origins whose browser pages may call /v1 (CORS), comma-separated, or "*"; None: none.
    cors_origins: str | None = None
    # One `http.request` log line per generation request (method, path, status, duration);
    # off by default: under `halfmoon up` each line costs the control path ~5 % throughput.
    access_log: bool = False
    request_timeout_s: float = 60.0
    heartbeat_timeout_s: float = 2.0  # a worker silent this long is lost: fail over
    # A stream with no new token for this long asks its decode worker to send again what it
    # may have lost (`StreamResume`), at most once per this interval.
    resume_after_s: float = 1.0
    chat_template_path: str | None = None
    model_path: str | None = None  # None: the built-in model
    tokenizer: Literal["model", "bytes"] = "model"  # "bytes" pairs with the fake engine
    # What a request that leaves temperature, top_p, top_k, min_p or repetition_penalty out
    # gets: the model's recommendation in its `generation_config.json` (as vLLM and SGLang
    # do), or OpenAI's defaults (temperature 1, top_p 1, no top_k).
    sampling_defaults: Literal["model", "openai"] = "model"
    # Other models' files, one directory each by model name (`<models_dir>/<model>`), for
    # models whose workers' own directories this gateway cannot read.
    models_dir: str | None = None
    # Responses API responses asked to be stored (`store`, default true) are kept this long
    # in NATS KV, for `previous_response_id` and GET /v1/responses/{id}; 0: none is stored.
    responses_ttl_s: float = 86400.0
    responses_max_bytes: int = 1 << 30  # the bucket's size; when full, the oldest go first


class PlannerSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The planner (`services/conductor/planner.py`): `off`, or `slo`: move workers between
    prefill and decode to keep `ttft_slo_ms` / `tbt_slo_ms` (at least one must be set).
    Active in one conductor at a time (a lease in NATS KV). `high` and `low` are shares of
    the SLOs: move a worker when a role's pressure stays above `high` for `hold_s`; send
    moved workers home once both stay below `low` for `home_after_s`."""

    mode: Literal["off", "slo"] = msgspec.field(default="off", name="planner")
    interval_s: float = msgspec.field(default=1.0, name="planner_interval_s")
    high: float = msgspec.field(default=0.8, name="planner_high")
    low: float = msgspec.field(default=0.3, name="planner_low")
    hold_s: float = msgspec.field(default=3.0, name="planner_hold_s")
    cooldown_s: float = msgspec.field(default=10.0, name="planner_cooldown_s")
    home_after_s: float = msgspec.field(default=60.0, name="planner_home_after_s")


class ConductorConfig(ServiceConfig, frozen=True, kw_only=True):
    heartbeat_timeout_s: float = 2.0
    dispatch_timeout_s: float = 2.0
    max_placement_attempts: int = 3
    num_fetchers: int = 4
    request_max_age_s: float = 60.0
    # A request that finds no healthy worker of a role waits up to this long for one to come
    # back (a restarting worker, a healed partition, a NATS node lost) before its 503: long
    # enough for a worker whose NATS node was cut off to notice (3 s of unanswered pings),
    # reconnect to another node and heartbeat again.
    no_worker_hold_s: float = 5.0
    # A request that finds no decode worker with KV room for it (running requests' growth
    # filled the pools) waits up to this long (at most the TTFT SLO, when one is set) for
    # blocks to free before its 429; 0: refuse at once.
    kv_short_hold_s: float = 5.0
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
    # The prefix index survives restarts as a snapshot (object store) plus the KV events after
    # it; a starting conductor waits up to this long for its index to catch up.
    prefix_snapshot_interval_s: float = 30.0  # 0: never save one
    prefix_catch_up_timeout_s: float = 30.0
    planning: PlannerSettings = msgspec.field(default_factory=PlannerSettings)


class EngineSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Which engine runs the model, on what, and how big its batches and KV pool are."""

    kind: EngineKind = msgspec.field(default="torch", name="engine")
    model_path: str | None = None  # None: the built-in model
    dtype: Literal["float32", "bfloat16"] = "float32"
    device: str = "cpu"
    # One attention call per layer (engine/attention.py); auto: flashinfer on CUDA when it
    # imports, else torch. `reference` is the per-sequence loop the others are tested against.
    attention_backend: Literal["auto", "torch", "flex", "flashinfer", "reference"] = "auto"
    # Linear weights on a CPU (engine/linear.py): packed holds them as measured fastest for
    # decode (on a CPU without bf16 units: fp32 in oneDNN's layout, twice a bf16 model's
    # weight memory); plain keeps them as loaded (there: prompts of 2048 tokens prefill
    # ~10 % faster, a bf16 model decodes ~10-20 % faster at batch 1, ~2x slower at 8).
    cpu_weights: Literal["packed", "plain"] = "packed"
    max_model_len: int = 2048
    num_blocks: int = 4096
    # The pool sized from memory instead (engine/kv_budget.py): GiB for KV on any device;
    # or, on CUDA, the share of device memory for weights + KV (0: use num_blocks).
    kv_cache_memory_gb: float = 0.0
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    max_batch_size: int = 64
    max_batch_tokens: int = 2048
    prefill_max_wait_ms: float = 10.0
    enable_prefix_caching: bool = True
    # Decode steps replayed as CUDA graphs, one per (batch, context) bucket, captured at
    # start (engine/decode_graphs.py); needs --device cuda and the torch attention backend.
    cuda_graphs: bool = False


class TransferSettings(msgspec.Struct, frozen=True, kw_only=True):
    """KV transfer, for engines with a KV pool: where this worker's transfer engine listens,
    what peers dial, the transports it may use (in preference order), the shared secret every
    worker of the cluster holds, whether KV streams layer by layer or after prefill, and how
    long a KV handoff may take."""

    host: str = msgspec.field(default="127.0.0.1", name="transfer_host")
    port: int = msgspec.field(default=0, name="transfer_port")
    advertise_host: str | None = msgspec.field(default=None, name="transfer_advertise_host")
    # cuda (GPU memory to GPU memory on one host) is used only where the pool is on a GPU.
    transports: str = msgspec.field(default="cuda,shm,tcp", name="transfer_transports")
    secret: str = msgspec.field(default="", name="transfer_secret")
    kv_streaming: Literal["layerwise", "whole"] = "layerwise"
    # KV this worker sends (handoffs, prefix fetches it serves) quantized on the wire, per
    # 256-value block with a float32 scale, and dequantized into the receiver's pool: about
    # 2x fewer bytes from a bf16 pool with either, 4x from fp32. TCP only (shm moves KV as is).
    kv_transfer_dtype: Literal["none", "fp8", "int8"] = "none"
    kv_wait_timeout_s: float = 10.0
    # After a handoff to a decode worker failed, how long prefill keeps the computed KV while
    # the conductor places the decode side again (a `prefill_hold` lease).
    kv_hold_s: float = 10.0


class SimSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The simulated engine: a model on an accelerator (engine/sim_cost.py PROFILES), its
    steps slowed by `time_scale` (wall s per simulated s), its KV bytes divided by
    `kv_byte_scale`; its KV capacity is what the profile's device memory holds. Its KV
    handoffs take the time of the full bytes over a link of `link_bytes_per_s` (50 GB/s: one
    400 Gb/s RDMA NIC per device; 0: only the real, scaled-down transfer's time). A worker
    whose `model` names a profile simulates that profile (so a model switch changes it)."""

    profile: str = msgspec.field(default="llama-3-8b-h200", name="sim_profile")
    time_scale: float = msgspec.field(default=1.0, name="sim_time_scale")
    kv_byte_scale: int = msgspec.field(default=4096, name="sim_kv_byte_scale")
    link_bytes_per_s: float = msgspec.field(default=50e9, name="sim_link_bytes_per_s")
    # Weights load at this rate (simulated): a worker's start, and each model switch, take
    # weight bytes / rate; 0: instant.
    load_bytes_per_s: float = msgspec.field(default=0.0, name="sim_load_bytes_per_s")


class FakeSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The fake engine's costs: per prefill batch, plus per uncached prompt token, and per
    decode step."""

    prefill_delay_s: float = msgspec.field(default=0.0, name="fake_prefill_delay_s")
    prefill_s_per_token: float = msgspec.field(default=0.0, name="fake_prefill_s_per_token")
    token_delay_s: float = msgspec.field(default=0.0, name="fake_token_delay_s")


class WorkerConfig(ServiceConfig, frozen=True, kw_only=True):
    """Settings of a prefill or decode worker, nested by concern. Flags, environment
    variables and TOML keys stay flat (`--num-blocks`, `HALFMOON_TRANSFER_HOST`,
    `sim_profile = ...`): each nested field's encoded name is its flat name."""

    worker_id: str | None = None
    # The role the worker starts in (`halfmoon worker --role`); a `RoleChange` switches it.
    role: Literal["prefill", "decode"] = "prefill"
    model: str = "halfmoon-tiny"
    # Models this worker may be told to serve instead (`RoleChange.model`): one Hugging Face
    # directory per model, named by the model (`<models_dir>/<model>`).
    models_dir: str | None = None
    host_name: str | None = None
    max_queue: int = 256
    heartbeat_interval_s: float = 0.5
    compute_score: float = 1.0
    zone: str = ""
    # Decode only: prompts of at most this many tokens are prefilled here, not on a prefill
    # worker (conditional disaggregation; 0: off). Colocated mode sets it to the context size.
    local_prefill_max_tokens: int = 0
    engine: EngineSettings = msgspec.field(default_factory=EngineSettings)
    transfer: TransferSettings = msgspec.field(default_factory=TransferSettings)
    sim: SimSettings = msgspec.field(default_factory=SimSettings)
    fake: FakeSettings = msgspec.field(default_factory=FakeSettings)


C = TypeVar("C", bound="ServiceConfig")


@dataclass(frozen=True)
class FlatField:
    """One setting as flags, environment and TOML spell it: `name` is the flat key, `section`
    the nested struct it lives in (None: the config itself)."""

    name: str
    section: str | None
    type: Any
    default: Any

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def flat_fields(cls: type[ServiceConfig]) -> list[FlatField]:
    """Every setting of `cls`, nested sections flattened (their fields' encoded names)."""
    found = []
    for field in msgspec.structs.fields(cls):
        if isinstance(field.type, type) and issubclass(field.type, msgspec.Struct):
            found += [FlatField(inner.encode_name, field.encode_name, inner.type,
                                _default(inner)) for inner in msgspec.structs.fields(field.type)]
        else:
            found.append(FlatField(field.encode_name, None, field.type, _default(field)))
    return found


def _default(field: msgspec.structs.FieldInfo) -> Any:
    if field.default is not msgspec.NODEFAULT:
        return field.default
    return None if field.default_factory is msgspec.NODEFAULT else field.default_factory()


def add_field_flag(parser: argparse.ArgumentParser, field: FlatField) -> None:
    """`--field-name`, with the field's choices when its type is a `Literal`; unset, it
    overrides nothing."""
    if field.type is bool:
        parser.add_argument(field.flag, dest=field.name, default=None,
                            action=argparse.BooleanOptionalAction)
        return
    choices = get_args(field.type) if get_origin(field.type) is Literal else None
    # `--nats` is the short spelling the docs use for `--nats-url`.
    aliases = ["--nats"] if field.name == "nats_url" else []
    parser.add_argument(field.flag, *aliases, dest=field.name, default=None, choices=choices,
                        help=f"default: {field.default}")


def add_config_flags(parser: argparse.ArgumentParser, cls: type[ServiceConfig]) -> None:
    """One flag per setting of `cls` (`--config` for a TOML file)."""
    parser.add_argument("--config", dest="config_path", default=None, help="TOML config file")
    for field in flat_fields(cls):
        add_field_flag(parser, field)


def load_config(
    cls: type[C],
    *,
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    toml_path: str | Path | None = None,
) -> C:
    """Merge file, environment and flags (all flat keys) over the defaults, nest them and
    validate the result."""
    fields = {field.name: field for field in flat_fields(cls)}
    merged: dict[str, Any] = {}
    if toml_path is not None:
        merged.update(_read_toml(Path(toml_path), cls, set(fields)))
    for key, value in (env or {}).items():
        name = key.removeprefix(ENV_PREFIX).lower()
        if key.startswith(ENV_PREFIX) and name in fields:
            merged[name] = value
    merged.update({k: v for k, v in (flags or {}).items() if k in fields and v is not None})
    nested: dict[str, Any] = {}
    for name, value in merged.items():
        section = fields[name].section
        (nested.setdefault(section, {}) if section else nested)[name] = value
    try:
        return msgspec.convert(nested, cls, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid {cls.__name__}: {exc}") from exc


def _read_toml(path: Path, cls: type[ServiceConfig], names: set[str]) -> dict[str, Any]:
    """Flat keys, or the same keys under a table named for their section (`[transfer]`)."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    sections = {field.section for field in flat_fields(cls) if field.section}
    flat: dict[str, Any] = {}
    for key, value in data.items():
        flat.update(value if key in sections and isinstance(value, dict) else {key: value})
    unknown = set(flat) - names
    if unknown:
        raise ConfigError(f"unknown keys in {path}: {sorted(unknown)}")
    return flat

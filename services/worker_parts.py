"""A worker, assembled in one place from its config: the engine and, for an engine with a KV
pool, the transfer engine that holds the pool, the KV handoff to decode workers and prefix
sharing between prefill workers, with the wire compression the worker's KV goes out with.

    parts = await assemble(config, worker_id, nc, subjects, metrics, leases)

The KV pool lives in the transfer engine's shared memory (segment `kv`): same-host peers
write into it one-sidedly, others land in it straight from their sockets. An engine without
a pool (the fake engine) gets `NoKvHandoff`: nothing crosses and decode recomputes. If a step
fails, whatever was started is closed before the error propagates.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from nats.aio.client import Client as NatsClient

from engine.compute_threads import serial_executor
from engine.fake_engine import FakeEngine
from engine.protocol import Engine
from engine.sim_link import SimulatedLink
from services.kv_handoff import KV_SEGMENT, KvHandoff, LayerwiseKvHandoff, NoKvHandoff
from services.kv_leases import LeaseTable
from services.prefill.prefix_reuse import PrefixSharing
from shared.config import EngineSettings, WorkerConfig
from shared.errors import ConfigError
from shared.messages import KvPoolLayout
from shared.metrics import PrefillMetrics
from shared.model_dir import default_model_dir, resolve_model_dir
from shared.subjects import Subjects
from transfer_engine import compression
from transfer_engine.batch import Notification
from transfer_engine.config import TransferConfig
from transfer_engine.engine import TransferEngine
from transfer_engine.errors import InvalidTransfer
from transfer_engine.registry import NatsEndpointRegistry
from transfer_engine.wire import Compression


@dataclass
class WorkerParts:
    engine: Engine
    handoff: KvHandoff
    transfer: TransferEngine | None = None  # engines with a KV pool
    prefix_sharing: PrefixSharing | None = None  # workers with a KV pool (prefill uses it)


async def assemble(config: WorkerConfig, worker_id: str, nc: NatsClient,
                   subjects: Subjects, metrics: PrefillMetrics, leases: LeaseTable, *,
                   engine: Engine | None = None) -> WorkerParts:
    """Build (or take) the engine and, when it has a KV pool, everything that moves it."""
    if engine is None:  # reads (or writes) model files: off the event loop
        if config.engine.kind == "torch":  # before a thread but the engine's computes
            serial_executor(asyncio.get_running_loop())
        engine = await asyncio.to_thread(build_engine, config)
    layout = engine.kv_layout()
    if layout is None:
        return WorkerParts(engine, NoKvHandoff())
    compression = wire_compression(config.transfer.kv_transfer_dtype, layout)
    transfer = await start_transfer_engine(config, worker_id, nc, subjects)
    try:
        if engine.kv_device == "cpu":  # else registered once started (`register_device_kv`)
            engine.use_kv_buffer(await transfer.allocate(KV_SEGMENT, layout.size_bytes))
    except BaseException:
        await transfer.close()
        raise
    handoff = LayerwiseKvHandoff(transfer, layout,
                                 is_layerwise=config.transfer.kv_streaming == "layerwise",
                                 link=simulated_link(config), compression=compression)
    # Whatever role it starts in: a worker may serve as prefill later (`RoleChange`).
    sharing = PrefixSharing(
        worker_id=worker_id, cache=engine.prefix_cache, layout=layout, transfer=transfer, nc=nc,
        subjects=subjects, block_size=config.engine.block_size,
        timeout_s=config.transfer.kv_wait_timeout_s, metrics=metrics, leases=leases,
        compression=compression)
    return WorkerParts(engine, handoff, transfer, sharing)


async def register_device_kv(parts: WorkerParts) -> None:
    """After the engine started: a pool in device memory (CUDA) becomes the transfer
    engine's `kv` segment: same-host peers that see the GPU copy device to device (the cuda
    transport, CUDA IPC), others reach it over TCP through a pinned host mirror (shared
    memory would write the mirror unseen). Written for CUDA; not run here (no GPU)."""
    if parts.transfer is not None and parts.engine.kv_device != "cpu":
        await parts.transfer.register(KV_SEGMENT, parts.engine.kv_pool_tensor())


def wire_compression(kv_transfer_dtype: str, layout: KvPoolLayout) -> Compression | None:
    """How this worker's KV goes on the wire (`--kv-transfer-dtype`); `ConfigError` for a
    pool the transfer engine cannot quantize (an fp8 pool, say)."""
    if kv_transfer_dtype == "none":
        return None
    try:
        return compression.make(kv_transfer_dtype, layout.dtype)
    except InvalidTransfer as exc:
        raise ConfigError(f"--kv-transfer-dtype {kv_transfer_dtype}: {exc}") from exc


def build_engine(config: WorkerConfig) -> Engine:
    """The engine `config.engine.kind` names; heavy imports only for the one chosen."""
    settings = config.engine
    match settings.kind:
        case "fake":
            fake = config.fake
            return FakeEngine(
                num_blocks=settings.num_blocks, block_size=settings.block_size,
                max_batch_size=settings.max_batch_size, prefill_delay_s=fake.prefill_delay_s,
                prefill_s_per_token=fake.prefill_s_per_token,
                token_delay_s=fake.token_delay_s,
                is_prefix_caching=settings.enable_prefix_caching)
        case "sim":
            return _sim_engine(config)
        case "torch":
            return _torch_engine(settings)
    raise ConfigError(f"unknown engine {settings.kind!r}")


def _sim_engine(config: WorkerConfig) -> Engine:
    from engine.sim_cost import PROFILES
    from engine.sim_engine import SimEngine, SimOptions

    settings, sim = config.engine, config.sim
    profile = config.model if config.model in PROFILES else sim.profile
    if profile not in PROFILES:
        raise ConfigError(f"unknown sim_profile {profile!r}; profiles: {', '.join(PROFILES)}")
    return SimEngine(SimOptions(
        profile=PROFILES[profile], time_scale=sim.time_scale,
        block_size=settings.block_size, max_batch_size=settings.max_batch_size,
        max_batch_tokens=settings.max_batch_tokens, kv_byte_scale=sim.kv_byte_scale,
        is_prefix_caching=settings.enable_prefix_caching,
        load_bytes_per_s=sim.load_bytes_per_s))


def _torch_engine(settings: EngineSettings) -> Engine:
    import torch

    from engine.builtin_model import ensure_builtin_model
    from engine.torch_engine import EngineOptions, TorchEngine

    model_dir = (resolve_model_dir(settings.model_path) if settings.model_path
                 else ensure_builtin_model(default_model_dir()))
    return TorchEngine(EngineOptions(
        model_dir=model_dir, dtype=getattr(torch, settings.dtype), device=settings.device,
        attention_backend=settings.attention_backend,
        cpu_weights=settings.cpu_weights, num_blocks=settings.num_blocks,
        kv_cache_memory_gb=settings.kv_cache_memory_gb,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        block_size=settings.block_size,
        max_batch_size=settings.max_batch_size, max_batch_tokens=settings.max_batch_tokens,
        max_wait_s=settings.prefill_max_wait_ms / 1000, max_model_len=settings.max_model_len,
        is_prefix_caching=settings.enable_prefix_caching,
        decode_graphs="cuda" if settings.cuda_graphs else "off"))


def model_files_dir(settings: EngineSettings) -> str:
    """Where this worker's engine reads its model (absolute), for its heartbeat; "" for
    engines without model files."""
    return str(resolve_model_dir(settings.model_path).resolve()) if settings.kind == "torch" \
        else ""


def simulated_link(config: WorkerConfig) -> SimulatedLink | None:
    """A simulated engine's KV is scaled down; its transfers take the full size's time."""
    if config.engine.kind != "sim" or config.sim.link_bytes_per_s <= 0:
        return None
    return SimulatedLink(config.sim.link_bytes_per_s, config.sim.kv_byte_scale,
                         config.sim.time_scale)


async def start_transfer_engine(config: WorkerConfig, worker_id: str, nc: NatsClient,
                                subjects: Subjects) -> TransferEngine:
    if not config.transfer.secret:
        raise ConfigError("set transfer_secret (HALFMOON_TRANSFER_SECRET): the secret every "
                          "worker of the cluster shares to authenticate KV transfers "
                          "(`halfmoon up` makes one)")
    registry = await NatsEndpointRegistry.open(nc.jetstream(), subjects.transfer_bucket,
                                               replicas=config.js_replicas)
    transfer = TransferEngine(TransferConfig(
        engine_id=worker_id, secret=config.transfer.secret.encode(),
        listen_host=config.transfer.host, listen_port=config.transfer.port,
        advertise_host=config.transfer.advertise_host,
        transports=tuple(t.strip() for t in config.transfer.transports.split(",")),
        timeout_s=config.transfer.kv_wait_timeout_s,
    ), registry, on_notification=_drop_notification)
    await transfer.start()
    return transfer


def _drop_notification(notification: Notification) -> None:
    """Workers send no transfer notifications (`KvCommitted` says a handoff is done and
    carries its trace context); one from a peer of an older version (its `HandoffNotice`)
    is dropped rather than queued for no reader."""

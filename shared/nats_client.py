"""NATS helpers: connecting, declaring streams and buckets, request/reply with typed errors."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from nats.js.kv import KeyValue

from shared import tracing
from shared.errors import TransferFailed, WorkerUnavailable
from shared.logs import get_logger
from shared.messages import DispatchReply, Message, PrefixFetch, PrefixFetched, WorkerHeartbeat
from shared.subjects import Subjects

log = get_logger(__name__)

_encoder = msgspec.json.Encoder()
_reply_decoder = msgspec.json.Decoder(DispatchReply)
_heartbeat_decoder = msgspec.json.Decoder(WorkerHeartbeat)
_fetch_decoder = msgspec.json.Decoder(PrefixFetched | DispatchReply)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


async def connect(url: str, name: str, timeout_s: float = 10.0,
                  on_event: Callable[[str], None] | None = None) -> NatsClient:
    """Connect, waiting up to `timeout_s` for the server; once connected, reconnect without
    limit. Connection events go to the log and to `on_event` ("disconnected" |
    "reconnected"). Raises `WorkerUnavailable` on time-out."""

    async def on_error(exc: Exception) -> None:
        log.warning("nats.error", client=name, error=str(exc))

    nc = NatsClient()

    async def on_disconnected() -> None:
        if not (nc.is_closed or nc.is_draining):
            log.warning("nats.disconnected", client=name)
            if on_event is not None:
                on_event("disconnected")

    async def on_reconnected() -> None:
        log.info("nats.reconnected", client=name)
        if on_event is not None:
            on_event("reconnected")

    connecting = nc.connect(
        servers=[url],
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=5,
        drain_timeout=5,
        allow_reconnect=True,
        error_cb=on_error,
        disconnected_cb=on_disconnected,
        reconnected_cb=on_reconnected,
    )
    try:
        await asyncio.wait_for(connecting, timeout_s)
    except TimeoutError as exc:
        await nc.close()
        raise WorkerUnavailable(f"cannot reach NATS at {url} within {timeout_s}s") from exc
    return nc


async def ensure_work_queue(
    js: JetStreamContext, name: str, subject: str, max_age_s: float
) -> None:
    """Create the work-queue stream, or bring an existing one to this config."""
    await _ensure_stream(js, StreamConfig(
        name=name,
        subjects=[subject],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        max_age=max_age_s,
        duplicate_window=min(max_age_s, 120.0),
    ))


# The prefix-cache event history a new conductor replays: bounded in age and size.
KV_EVENTS_MAX_AGE_S = 3600.0
KV_EVENTS_MAX_BYTES = 256 * 2**20


async def ensure_kv_event_stream(js: JetStreamContext, subjects: Subjects) -> None:
    """Create (or update) the limits-retention stream of prefix-cache events."""
    await _ensure_stream(js, StreamConfig(
        name=subjects.kv_events_stream, subjects=[subjects.all_kv_events],
        retention=RetentionPolicy.LIMITS, storage=StorageType.FILE,
        max_age=KV_EVENTS_MAX_AGE_S, max_bytes=KV_EVENTS_MAX_BYTES,
    ))


async def _ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    """Create the stream, or bring an existing one to this config."""
    try:
        await js.add_stream(config)
    except nats.js.errors.BadRequestError:
        await js.update_stream(config)


async def ensure_bucket(js: JetStreamContext, bucket: str, ttl_s: float) -> KeyValue:
    try:
        return await js.key_value(bucket)
    except nats.js.errors.BucketNotFoundError:
        return await js.create_key_value(bucket=bucket, ttl=ttl_s, history=1)


async def read_registry(js: JetStreamContext, bucket: str) -> list[WorkerHeartbeat]:
    """Every live worker's latest heartbeat from the registry bucket (empty if none)."""
    try:
        kv = await js.key_value(bucket)
        keys = await kv.keys()
    except (nats.js.errors.BucketNotFoundError, nats.js.errors.NoKeysError):
        return []
    heartbeats = []
    for key in keys:
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            continue
        if entry.value:
            try:
                heartbeats.append(_heartbeat_decoder.decode(entry.value))
            except msgspec.DecodeError:
                log.warning("registry.invalid_entry", bucket=bucket, key=key)
    return heartbeats


async def dispatch(
    nc: NatsClient, subject: str, message: Message, timeout_s: float
) -> DispatchReply:
    """Send a command to one worker and wait for its `DispatchReply`.

    Raises `WorkerUnavailable` when nobody listens or nobody answers in time.
    """
    return _reply_decoder.decode(await _request(nc, subject, message, timeout_s))


async def fetch_prefix(nc: NatsClient, subject: str, message: PrefixFetch, timeout_s: float
                       ) -> PrefixFetched:
    """Ask another prefill worker for cached KV blocks; a refusal raises `TransferFailed`."""
    reply = _fetch_decoder.decode(await _request(nc, subject, message, timeout_s))
    if isinstance(reply, DispatchReply):
        raise TransferFailed(f"{reply.worker_id} refused the prefix fetch: {reply.reason}")
    return reply


async def _request(nc: NatsClient, subject: str, message: Message, timeout_s: float) -> bytes:
    try:
        reply = await nc.request(subject, encode(message), timeout=timeout_s,
                                 headers=tracing.inject())
    except nats.errors.NoRespondersError as exc:
        raise WorkerUnavailable(f"no worker listens on {subject}") from exc
    except nats.errors.TimeoutError as exc:
        raise WorkerUnavailable(f"no answer on {subject} within {timeout_s}s") from exc
    return reply.data

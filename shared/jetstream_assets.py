"""The cluster's JetStream assets, declared idempotently by every service that needs them
(the request work queue, the KV-event stream, KV buckets, the object store), and the calls
JetStream may leave unanswered for a while (a meta leader still being elected at start-up,
a stream's leader moving after a node is lost), made again until it answers."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, PubAck, RetentionPolicy, StorageType, StreamConfig
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from shared.errors import ConfigError
from shared.logs import get_logger
from shared.messages import WorkerHeartbeat
from shared.subjects import Subjects

T = TypeVar("T")

log = get_logger(__name__)

_heartbeat_decoder = msgspec.json.Decoder(WorkerHeartbeat)

async def ensure_work_queue(
    js: JetStreamContext, name: str, subject: str, max_age_s: float, *, replicas: int = 1
) -> None:
    """Create the work-queue stream, or bring an existing one to this config; its max age
    only grows (`_keep_longer_age`)."""
    await _ensure_stream(js, StreamConfig(
        name=name,
        subjects=[subject],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        max_age=max_age_s,
        duplicate_window=min(max_age_s, 120.0),
        num_replicas=replicas,
    ), keep_longer_age=True)


# The prefix-cache event history a new conductor replays: bounded in age and size.
KV_EVENTS_MAX_AGE_S = 3600.0
KV_EVENTS_MAX_BYTES = 256 * 2**20


async def ensure_kv_event_stream(js: JetStreamContext, subjects: Subjects, *,
                                 replicas: int = 1) -> None:
    """Create (or update) the limits-retention stream of prefix-cache events (smaller than
    `KV_EVENTS_MAX_BYTES` where the store has no room for that: `_reserving`)."""
    def config(max_bytes: int) -> StreamConfig:
        return StreamConfig(
            name=subjects.kv_events_stream, subjects=[subjects.all_kv_events],
            retention=RetentionPolicy.LIMITS, storage=StorageType.FILE,
            max_age=KV_EVENTS_MAX_AGE_S, max_bytes=max_bytes, num_replicas=replicas)

    await _reserving(lambda max_bytes: _ensure_stream(js, config(max_bytes)),
                    KV_EVENTS_MAX_BYTES, f"stream {subjects.kv_events_stream}")


# JetStream reserves a stream's `max_bytes` in its store when it creates the stream, and a
# store without that much room refuses the stream (this error code) instead of capping it.
_INSUFFICIENT_STORAGE = 10047
MIN_RESERVED_BYTES = 8 * 2**20


def _is_out_of_storage(exc: BaseException) -> bool:
    return getattr(exc, "err_code", None) == _INSUFFICIENT_STORAGE  # (not every error sets it)


async def _reserving(create: Callable[[int], Awaitable[T]], max_bytes: int, what: str) -> T:
    """`create(size)` with `size` = `max_bytes`, halved while the JetStream store has no
    room to reserve it, down to `MIN_RESERVED_BYTES` (then a `ConfigError`): a bounded
    stream that history or stored responses fill is no reason for a service not to start
    on a small disk. A smaller size is logged."""
    size = max_bytes
    while True:
        try:
            created = await create(size)
        except nats.js.errors.APIError as exc:
            if not _is_out_of_storage(exc):
                raise
            if size // 2 < MIN_RESERVED_BYTES:
                raise ConfigError(
                    f"JetStream has no room to reserve {MIN_RESERVED_BYTES >> 20} MiB for "
                    f"{what}: free disk space where the NATS servers store JetStream data, "
                    "or raise their jetstream max_file_store") from exc
            size //= 2
            continue
        if size < max_bytes:
            log.warning("jetstream.reserved_less", asset=what, asked_bytes=max_bytes,
                        reserved_bytes=size)
        return created


# What an existing stream must share with the config a service asks for: JetStream cannot
# change its retention or storage, and services that disagree on replicas would undo each
# other's updates. Anything else (ages, sizes) is updated to the asking service's value.
_FIXED_STREAM_SETTINGS = ("retention", "storage", "num_replicas")


async def _ensure_stream(js: JetStreamContext, config: StreamConfig, *,
                         keep_longer_age: bool = False) -> None:
    """Create the stream, or bring an existing one to this config; an existing stream that
    differs in a fixed setting is a `ConfigError` naming each difference."""
    await answered(lambda: _create_or_update_stream(js, config, keep_longer_age),
                   f"stream {config.name}", within_s=ASSET_WAIT_S)


async def _create_or_update_stream(js: JetStreamContext, config: StreamConfig,
                                   keep_longer_age: bool) -> None:
    try:
        await js.add_stream(config)
        return
    except nats.js.errors.BadRequestError:
        pass  # it exists with other settings
    existing = (await js.stream_info(config.name)).config
    _refuse_differences(f"stream {config.name}", [
        (name, getattr(existing, name), getattr(config, name))
        for name in _FIXED_STREAM_SETTINGS])
    if keep_longer_age:
        config = _keep_longer_age(existing, config)
    changed = {name: (old, getattr(config, name)) for name in ("max_age", "max_bytes",
                                                              "duplicate_window", "subjects")
               if (old := getattr(existing, name)) != getattr(config, name)}
    await js.update_stream(config)
    if changed:
        log.warning("jetstream.stream_updated", stream=config.name, changed=repr(changed))


def _keep_longer_age(existing: StreamConfig, asked: StreamConfig) -> StreamConfig:
    """The asked config, with the existing stream's max age where that is longer (0: none):
    services that keep a message for different times (a gateway that waits longer for its
    requests than a conductor's `request_max_age_s`) would otherwise cut each other's
    messages short in turn, by the order they started in."""
    if not existing.max_age or (asked.max_age and existing.max_age > asked.max_age):
        return dataclasses.replace(asked, max_age=existing.max_age,
                                   duplicate_window=existing.duplicate_window)
    return asked


# While a stream's leader moves (a node lost, an election: up to ~10 s after a partition)
# its publishes and its consumers' pulls go unanswered (these errors). A message id makes
# the stream drop a retry's duplicate, so publishing again is safe; past this long the
# caller hears of it.
STREAM_PUBLISH_RETRY_S = 15.0
# A publish sent while the stream had no leader is never answered: each attempt waits this
# long for its acknowledgement (milliseconds when a leader takes it), not nats-py's 5 s, so
# that one goes out soon after the election.
STREAM_ACK_WAIT_S = 2.0
# How long a service at start-up waits for JetStream to answer for its streams and buckets:
# a cluster that starts with it elects its meta leader first (seconds).
ASSET_WAIT_S = 30.0
# (`OutboundBufferLimitError`: the client is reconnecting and its buffer for what it sends
# meanwhile is full; the same call goes through once it is back.)
UNANSWERED_ERRORS = (nats.errors.TimeoutError, nats.errors.NoRespondersError,
               nats.errors.ConnectionReconnectingError, nats.errors.OutboundBufferLimitError,
               nats.js.errors.NoStreamResponseError, nats.js.errors.ServiceUnavailableError)


def is_transient(exc: BaseException) -> bool:
    """Whether JetStream may answer the same call a moment later: it went unanswered, or the
    server refused it for a reason of its own: a 5xx, or a bare `APIError` (a code nats-py
    does not classify, as a publish got during a leader election). Every classified error
    (bad request, not found, no keys, a wrong last sequence, ...) is an answer."""
    if _is_out_of_storage(exc):
        return False  # a full store: it answers the same until something is deleted
    if isinstance(exc, (*UNANSWERED_ERRORS, nats.js.errors.ServerError)):
        return True
    return type(exc) is nats.js.errors.APIError


async def answered(call: Callable[[], Awaitable[T]], what: str, *,
                   within_s: float = STREAM_PUBLISH_RETRY_S) -> T:
    """`call()`, made again while JetStream cannot answer it (a cluster still electing its
    meta leader at start-up, a stream's leader moving), for up to `within_s`; then, or on
    any other error, nats-py's error is raised."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    delay_s = 0.05
    while True:
        try:
            return await call()
        except (*UNANSWERED_ERRORS, nats.js.errors.APIError) as exc:
            if not is_transient(exc) or loop.time() + delay_s > deadline:
                raise
            log.info("jetstream.retry", what=what, error=str(exc) or repr(exc))
            await asyncio.sleep(delay_s)
            delay_s = min(2 * delay_s, 0.5)


async def publish_to_stream(js: JetStreamContext, subject: str, payload: bytes, *,
                            msg_id: str, headers: dict[str, str] | None = None,
                            within_s: float = STREAM_PUBLISH_RETRY_S,
                            redeclare: Redeclare | None = None) -> PubAck:
    """Publish to a JetStream stream once (by `msg_id`: the stream drops a retry's
    duplicate), retrying while the stream cannot answer (`answered`); when no stream takes
    the subject at all, `redeclare` (if given) declares it again before the next try."""
    async def publish() -> PubAck:
        try:
            return await js.publish(subject, payload, timeout=STREAM_ACK_WAIT_S,
                                    headers={"Nats-Msg-Id": msg_id, **(headers or {})})
        except nats.js.errors.NoStreamResponseError:
            if redeclare is not None:
                await redeclare()
            raise

    return await answered(publish, f"publish {msg_id} to {subject}", within_s=within_s)


class Redeclare:
    """Declare a JetStream asset again when a call finds it gone: deleted by an operator,
    or lost with a server that restarted without its store. Every service declares its
    assets at start; without this, one lost stream left the cluster refusing every request
    until each service was restarted.

    A call finds the same while a stream only lost its leader (an election), when declaring
    is harmless and usually times out: so at most once per `interval_s`, bounded by
    `limit_s`, and its failure is the caller's retry, not an error."""

    def __init__(self, declare: Callable[[], Awaitable[object]], what: str, *,
                 interval_s: float = 1.0, limit_s: float = 2.0) -> None:
        self._declare = declare
        self._what = what
        self._interval_s = interval_s
        self._limit_s = limit_s
        self._last_s = -interval_s

    async def __call__(self) -> None:
        now_s = asyncio.get_running_loop().time()
        if now_s - self._last_s < self._interval_s:
            return
        self._last_s = now_s
        try:
            await asyncio.wait_for(self._declare(), self._limit_s)
        except (TimeoutError, nats.errors.Error, nats.js.errors.Error) as exc:
            log.info("jetstream.redeclare_failed", what=self._what, error=repr(exc))
            return
        log.info("jetstream.redeclared", what=self._what)


def _refuse_differences(asset: str, settings: list[tuple[str, object, object]]) -> None:
    differences = [f"{name}={_shown(old)} (this service asks for {_shown(new)})"
                   for name, old, new in settings if old != new]
    if differences:
        raise ConfigError(
            f"JetStream {asset} exists with {', '.join(differences)}: give every service of "
            "the cluster the same settings (--js-replicas), or delete the asset")


def _shown(value: object) -> object:
    return getattr(value, "value", value)


async def ensure_bucket(js: JetStreamContext, bucket: str, ttl_s: float, *,
                        replicas: int = 1, max_bytes: int | None = None) -> KeyValue:
    """The KV bucket, created if missing; an existing one must have these replicas (its TTL
    and size stay what its creator set). With `max_bytes`, a full bucket drops its oldest
    entries for new ones (a KV bucket would refuse the new ones), and is made smaller where
    the store has no room for it (`_reserving`)."""
    def opened(size: int | None) -> Awaitable[KeyValue]:
        return answered(lambda: _open_bucket(js, bucket, ttl_s, replicas, size),
                        f"KV bucket {bucket}", within_s=ASSET_WAIT_S)

    if max_bytes is None:
        return await opened(None)
    return await _reserving(opened, max_bytes, f"KV bucket {bucket}")


async def _open_bucket(js: JetStreamContext, bucket: str, ttl_s: float, replicas: int,
                       max_bytes: int | None) -> KeyValue:
    try:
        kv = await js.key_value(bucket)
    except nats.js.errors.BucketNotFoundError:
        kv = await js.create_key_value(bucket=bucket, ttl=ttl_s, history=1,
                                       replicas=replicas, max_bytes=max_bytes)
        if max_bytes is not None:
            config = (await js.stream_info(f"KV_{bucket}")).config
            config.discard = DiscardPolicy.OLD
            await js.update_stream(config)
        return kv
    config = (await kv.status()).stream_info.config
    _refuse_differences(f"KV bucket {bucket}", [("replicas", config.num_replicas, replicas)])
    return kv


async def ensure_object_store(js: JetStreamContext, bucket: str, *,
                              replicas: int = 1) -> ObjectStore:
    """The object store, created if missing; an existing one must have these replicas."""
    return await answered(lambda: _open_object_store(js, bucket, replicas),
                          f"object store {bucket}", within_s=ASSET_WAIT_S)


async def _open_object_store(js: JetStreamContext, bucket: str, replicas: int) -> ObjectStore:
    try:
        store = await js.object_store(bucket)
    except nats.js.errors.BucketNotFoundError:
        return await js.create_object_store(bucket, replicas=replicas)
    config = (await store.status()).stream_info.config
    _refuse_differences(f"object store {bucket}", [("replicas", config.num_replicas, replicas)])
    return store


async def read_registry(js: JetStreamContext, bucket: str) -> list[WorkerHeartbeat]:
    """Every live worker's latest heartbeat from the registry bucket (empty if none). The
    keys come from the bucket's stream (its subjects), not `KeyValue.keys()`: nats-py's
    watcher can end before the entries it holds and report none (nats.py#842; seen here as
    a `halfmoon workers` listing with no worker while three were up)."""
    prefix = f"$KV.{bucket}."

    async def list_keys() -> tuple[KeyValue, list[str]]:
        kv = await js.key_value(bucket)
        info = await js.stream_info(f"KV_{bucket}", subjects_filter=f"{prefix}>")
        return kv, [subject[len(prefix):] for subject in info.state.subjects or {}]

    try:
        kv, keys = await answered(list_keys, f"KV bucket {bucket}", within_s=ASSET_WAIT_S)
    except nats.js.errors.BucketNotFoundError:
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

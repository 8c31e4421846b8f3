"""NATS helpers: connecting, declaring streams and buckets, request/reply with typed errors."""

from __future__ import annotations

import asyncio
import random
import re
import socket
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, PubAck, RetentionPolicy, StorageType, StreamConfig
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from shared import tracing
from shared.config import NatsAuth
from shared.errors import ConfigError, NobodyListens, TransferFailed, WorkerUnavailable
from shared.logs import get_logger
from shared.messages import (
    DispatchReply,
    Message,
    OpenStreams,
    OpenStreamsQuery,
    PrefixFetch,
    PrefixFetched,
    StreamQuery,
    StreamStatus,
    WorkerHeartbeat,
)
from shared.nats_headers import NatsClient
from shared.subjects import Subjects

T = TypeVar("T")

log = get_logger(__name__)

_encoder = msgspec.json.Encoder()
_reply_decoder = msgspec.json.Decoder(DispatchReply)
_heartbeat_decoder = msgspec.json.Decoder(WorkerHeartbeat)
_fetch_decoder = msgspec.json.Decoder(PrefixFetched | DispatchReply)
_status_decoder = msgspec.json.Decoder(StreamStatus | DispatchReply)
_open_streams_decoder = msgspec.json.Decoder(OpenStreams | DispatchReply)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def nats_servers(url: str) -> list[str]:
    """The servers of a `nats_url`: one URL, or several of one cluster comma-separated."""
    servers = [part.strip() for part in url.split(",") if part.strip()]
    if not servers:
        raise ConfigError(f"nats_url {redact(url)!r} names no server")
    return servers


def redact(url: str) -> str:
    """`url` (or a comma-separated list) without the user info it may carry."""
    return ",".join(re.sub(r"//[^/@]*@", "//***@", part) for part in url.split(","))


def auth_options(auth: NatsAuth) -> dict[str, Any]:
    """nats-py's connect options for `auth`; a file that is not there is a `ConfigError`."""
    for what, path in (("nats_creds", auth.creds), ("nats_nkey_seed", auth.nkey_seed),
                       ("nats_tls_ca", auth.tls_ca), ("nats_tls_cert", auth.tls_cert),
                       ("nats_tls_key", auth.tls_key)):
        if path is not None and not Path(path).is_file():
            raise ConfigError(f"{what}: no file at {path}")
    if (auth.tls_cert is None) != (auth.tls_key is None):
        raise ConfigError("set nats_tls_cert and nats_tls_key together")
    if (auth.user is None) != (auth.password is None):
        raise ConfigError("set nats_user and nats_password together")
    options: dict[str, Any] = {}
    if auth.creds is not None:
        options["user_credentials"] = auth.creds
    if auth.nkey_seed is not None:
        options["nkeys_seed"] = auth.nkey_seed
    if auth.user is not None:
        options.update(user=auth.user, password=auth.password)
    if auth.token is not None:
        options["token"] = auth.token
    if auth.tls_ca is not None or auth.tls_cert is not None:
        context = ssl.create_default_context(cafile=auth.tls_ca)
        if auth.tls_cert is not None:
            context.load_cert_chain(auth.tls_cert, auth.tls_key)
        options["tls"] = context
    return options


CONNECT_TIMEOUT_S = 2.0  # per server tried: an unreachable one is left after this long
PING_INTERVAL_S = 1.0
MAX_OUTSTANDING_PINGS = 2


async def connect(url: str, name: str, timeout_s: float = 10.0,
                  on_event: Callable[[str], None] | None = None,
                  auth: NatsAuth | None = None) -> NatsClient:
    """Connect to any server of `url` (see `nats_servers`), waiting up to `timeout_s`; once
    connected, reconnect without limit, across the cluster's servers. Connection events go
    to the log and to `on_event` ("disconnected" | "reconnected"). Raises `WorkerUnavailable`
    on time-out and `ConfigError` when a server refuses this client (credentials, TLS)."""
    # Shuffled here, kept in order by nats-py: a client moves to the *next* server when it
    # loses one. nats-py's own shuffle runs again on every reconnect, so one time in N it
    # tried the server just lost first, and a partitioned one answers nothing: a whole
    # connect timeout (2 s) more before the client was back.
    servers = nats_servers(url)
    random.shuffle(servers)
    options = auth_options(auth or NatsAuth())
    refusals: list[str] = []

    async def on_error(exc: Exception) -> None:
        if _is_refusal(exc):
            refusals.append(_describe(exc))
        log.warning("nats.error", client=name, error=_describe(exc))

    nc = NatsClient()

    async def on_disconnected() -> None:
        if not (nc.is_closed or nc.is_draining):
            log.warning("nats.disconnected", client=name)
            if on_event is not None:
                on_event("disconnected")

    async def on_reconnected() -> None:
        bound_unacknowledged(nc)
        log.info("nats.reconnected", client=name, server=redact(str(nc.connected_url or "")))
        if on_event is not None:
            on_event("reconnected")

    connecting = nc.connect(
        servers=servers,
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        dont_randomize=True,
        connect_timeout=CONNECT_TIMEOUT_S,
        # A server cut off by a partition closes nothing: unanswered pings are how a client
        # learns it, within PING_INTERVAL_S * (MAX_OUTSTANDING_PINGS + 1), and moves to
        # another server of the cluster (nats-py's default takes 2 minutes per ping).
        ping_interval=PING_INTERVAL_S,
        max_outstanding_pings=MAX_OUTSTANDING_PINGS,
        drain_timeout=5,
        allow_reconnect=True,
        error_cb=on_error,
        disconnected_cb=on_disconnected,
        reconnected_cb=on_reconnected,
        **options,
    )
    where = redact(url)
    try:
        await asyncio.wait_for(connecting, timeout_s)
    except (TimeoutError, ssl.SSLError, nats.errors.Error, OSError) as exc:
        await nc.close()
        if refusals or _is_refusal(exc):
            reason = refusals[-1] if refusals else _describe(exc)
            raise ConfigError(f"NATS at {where} refused {name}: {reason} (check the "
                              "nats_* credentials and TLS settings)") from exc
        raise WorkerUnavailable(f"cannot reach NATS at {where} within {timeout_s}s") from exc
    bound_unacknowledged(nc)
    return nc


def bound_unacknowledged(nc: NatsClient) -> None:
    """Have the kernel drop the client's connection once bytes sent on it stay unacknowledged
    for as long as its pings may (a server cut off by a partition acknowledges nothing).

    Before it reconnects, nats-py waits for the old connection to close, and a connection
    with bytes still to send closes only once they are sent: to a partitioned server, not
    before TCP gives up (~15 minutes). A worker streaming tokens always has some, so it never
    moved to another server of the cluster: it was lost to everyone until the partition
    healed. (nats-py has no socket options; its transport keeps the socket.)"""
    writer = getattr(getattr(nc, "_transport", None), "_io_writer", None)
    sock = writer.get_extra_info("socket") if writer is not None else None
    if sock is None or not hasattr(socket, "TCP_USER_TIMEOUT"):
        return
    limit_ms = int(PING_INTERVAL_S * (MAX_OUTSTANDING_PINGS + 1) * 1000)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, limit_ms)
    except OSError as exc:
        log.warning("nats.socket_option_failed", option="TCP_USER_TIMEOUT", error=str(exc))


async def subscribed(nc: NatsClient, timeout_s: int = 5) -> None:
    """Return once the server has every subscription `nc` has made so far (and every message
    it has published): from then on, what another connection publishes reaches them.

    `nc.flush()` alone does not promise that (nats-py 2.16): it writes its PING straight to
    the socket, ahead of the commands nats-py still holds for its flusher task, a new SUB
    among them, so the PONG can come back before the server has the subscription. Of 3,000
    messages published from a second connection right after a subscribe and a flush, 8 to
    25 were lost. The flusher has written what it held before the first PONG is back, so
    the second round trip comes after the SUB. Raises `nats.errors.FlushTimeoutError`."""
    await nc.flush(timeout_s)
    await nc.flush(timeout_s)


class ServerProbe:
    """Whether the NATS server answers this client now: a PING whose PONG comes back in time.

    A server cut off by a partition closes nothing, and the client learns it only from its
    own unanswered pings, up to PING_INTERVAL_S * (MAX_OUTSTANDING_PINGS + 1) later: longer
    than a worker's heartbeat timeout. A service that judges workers by their silence asks
    this first, so that its own deafness is not taken for their death.

    A PING is never given up on (nats-py settles PONGs in order, and one arriving for a
    cancelled flush stops its read loop): one in flight is waited on again by the next
    question, and `reset` forgets it once the client has reconnected (its PONG will not come).
    """

    _PONG_LIMIT_S = 60.0  # far past the pings that declare the connection stale

    def __init__(self, nc: NatsClient) -> None:
        self._nc = nc
        self._ping: asyncio.Task[None] | None = None
        self._sent_at_s = 0.0

    async def answers(self, within_s: float) -> bool:
        """Whether a PING sent now (or the one in flight) is answered within `within_s` of
        being sent."""
        if not self._nc.is_connected:
            return False
        loop = asyncio.get_running_loop()
        if self._ping is None or self._ping.done():
            self._ping = loop.create_task(self._nc.flush(timeout=self._PONG_LIMIT_S))
            self._ping.add_done_callback(_settled)
            self._sent_at_s = loop.time()
        ping = self._ping
        left_s = self._sent_at_s + within_s - loop.time()
        if left_s > 0:
            await asyncio.wait({ping}, timeout=left_s)
        return ping.done() and not ping.cancelled() and ping.exception() is None

    def reset(self) -> None:
        """The client reconnected: a PING in flight went to the old connection."""
        self._ping = None


def _settled(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: an unanswered PING is the probe's answer, not an error


def _is_refusal(exc: BaseException) -> bool:
    """An answer that retrying will not change: bad credentials, an untrusted certificate."""
    text = str(exc).lower()
    return isinstance(exc, ssl.SSLError) or any(
        word in text for word in ("authorization", "authentication", "certificate", "tls"))


def _describe(exc: BaseException) -> str:
    return str(exc).strip() or type(exc).__name__


async def ensure_work_queue(
    js: JetStreamContext, name: str, subject: str, max_age_s: float, *, replicas: int = 1
) -> None:
    """Create the work-queue stream, or bring an existing one to this config."""
    await _ensure_stream(js, StreamConfig(
        name=name,
        subjects=[subject],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        max_age=max_age_s,
        duplicate_window=min(max_age_s, 120.0),
        num_replicas=replicas,
    ))


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


async def _ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    """Create the stream, or bring an existing one to this config; an existing stream that
    differs in a fixed setting is a `ConfigError` naming each difference."""
    await answered(lambda: _create_or_update_stream(js, config), f"stream {config.name}",
                   within_s=ASSET_WAIT_S)


async def _create_or_update_stream(js: JetStreamContext, config: StreamConfig) -> None:
    try:
        await js.add_stream(config)
        return
    except nats.js.errors.BadRequestError:
        pass  # it exists with other settings
    existing = (await js.stream_info(config.name)).config
    _refuse_differences(f"stream {config.name}", [
        (name, getattr(existing, name), getattr(config, name))
        for name in _FIXED_STREAM_SETTINGS])
    changed = {name: (old, getattr(config, name)) for name in ("max_age", "max_bytes",
                                                              "duplicate_window", "subjects")
               if (old := getattr(existing, name)) != getattr(config, name)}
    await js.update_stream(config)
    log.warning("jetstream.stream_updated", stream=config.name, changed=repr(changed))


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


async def dispatch(
    nc: NatsClient, subject: str, message: Message, timeout_s: float, *,
    trace_headers: dict[str, str] | None = None,
) -> DispatchReply:
    """Send a command to one worker and wait for its `DispatchReply`. The headers carry
    the current trace context, or `trace_headers` when given (the same context, injected
    once for several commands; `{}`: none, for a receiver that makes no span of it).

    Raises `WorkerUnavailable` when nobody listens or nobody answers in time.
    """
    return _reply_decoder.decode(await _request(nc, subject, message, timeout_s,
                                                trace_headers))


async def fetch_prefix(nc: NatsClient, subject: str, message: PrefixFetch, timeout_s: float
                       ) -> PrefixFetched:
    """Ask another prefill worker for cached KV blocks; a refusal raises `TransferFailed`."""
    reply = _fetch_decoder.decode(await _request(nc, subject, message, timeout_s))
    if isinstance(reply, DispatchReply):
        raise TransferFailed(f"{reply.worker_id} refused the prefix fetch: {reply.reason}")
    return reply


async def ask_stream_status(nc: NatsClient, subject: str, query: StreamQuery,
                            timeout_s: float) -> StreamStatus:
    """Ask a request's gateway what it holds of the request (`StreamQuery`). Raises
    `WorkerUnavailable` when nobody listens, nobody answers in time, or it refused."""
    reply = _status_decoder.decode(await _request(nc, subject, query, timeout_s, {}))
    if isinstance(reply, DispatchReply):
        raise WorkerUnavailable(f"{reply.worker_id} refused the stream query: {reply.reason}")
    return reply


async def ask_open_streams(nc: NatsClient, subject: str, query: OpenStreamsQuery,
                           timeout_s: float) -> OpenStreams | None:
    """Ask a gateway which of these requests a client still waits for; None when no one
    listens on `subject` (the gateway is gone). Raises `WorkerUnavailable` when no answer
    comes in time, or on a refusal."""
    try:
        answer = _open_streams_decoder.decode(await _request(nc, subject, query, timeout_s, {}))
    except NobodyListens:
        return None
    if isinstance(answer, DispatchReply):
        raise WorkerUnavailable(f"{answer.worker_id} refused the query: {answer.reason}")
    return answer


async def _request(nc: NatsClient, subject: str, message: Message, timeout_s: float,
                   trace_headers: dict[str, str] | None = None) -> bytes:
    try:
        reply = await nc.request(subject, encode(message), timeout=timeout_s,
                                 headers=tracing.inject() if trace_headers is None
                                 else trace_headers or None)
    except nats.errors.NoRespondersError as exc:
        raise NobodyListens(f"no worker listens on {subject}") from exc
    except nats.errors.TimeoutError as exc:
        raise WorkerUnavailable(f"no answer on {subject} within {timeout_s}s") from exc
    return reply.data

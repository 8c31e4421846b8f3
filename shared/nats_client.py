"""NATS helpers: connecting, and request/reply with typed errors (JetStream's streams and
buckets: `jetstream_assets`)."""

from __future__ import annotations

import asyncio
import random
import re
import socket
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import nats.errors

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
)
from shared.nats_headers import NatsClient

log = get_logger(__name__)

_encoder = msgspec.json.Encoder()
_reply_decoder = msgspec.json.Decoder(DispatchReply)
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

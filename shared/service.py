"""The `Service` base class: one subclass per process, one lifecycle for all.

Lifecycle contract:
    __init__  stores config; no I/O.
    start()   connects to NATS, runs `_setup()` (declare streams, subscribe, start loops) and
              returns when the service takes work. If anything fails it calls `stop()` itself
              and raises `ServiceStartFailed`: nothing is left open.
    run()     start(), then serve until SIGINT/SIGTERM or until an owned task crashes; then
              stop(). A crashed task makes run() raise after stopping: loud, never silent.
    stop()    idempotent, safe after a failed or partial start, ordered:
              `_stop_intake()` (take no new work) -> `_drain()` (finish in-flight work, up to
              `drain_timeout_s`) -> cancel and await owned tasks -> `_close()` (engines,
              transfer engines) -> drain the NATS connection.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import enum
import gc
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import msgspec
from aiohttp import web
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from shared import tracing
from shared.config import ServiceConfig
from shared.errors import HalfmoonError, ServiceStartFailed
from shared.events import EventPublisher
from shared.heartbeats import WorkerDirectory
from shared.logs import get_logger
from shared.messages import DispatchReply, Message
from shared.metrics import CONTENT_TYPE, ServiceMetrics
from shared.nats_client import ServerProbe, connect, encode
from shared.subjects import Subjects

# A young generation this large lets a request's short-lived objects die by reference count
# before a collection walks them (Python's default, 700, collects hundreds of times a
# second under load); the older generations then run rarely, and never walk what start-up
# built.
GC_THRESHOLDS = (50_000, 20, 20)
# A server that has not answered a PING within this long was not hearing us (its PONG
# comes in milliseconds, tens of them under load): a partition, or a stalled server.
SERVER_ANSWER_S = 0.5


def settle_garbage_collector() -> None:
    """Once a serving process is up: what start-up built (modules, config, the model's
    Python objects) lives as long as the process, so `gc.freeze` takes it out of every
    later collection (a full one walked ~60k objects, ~40 ms in the gateway), and the
    thresholds above space collections out."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


class ServiceState(enum.Enum):
    NEW = "new"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


class Service(abc.ABC):
    """Base of the gateway, conductor, prefill and decode services."""

    name: str = "service"

    metrics_type: type[ServiceMetrics] = ServiceMetrics
    serves_own_metrics = True  # on `metrics_port`; the gateway serves them on its API port

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.subjects = Subjects(config.cluster)
        self.state = ServiceState.NEW
        self.log = get_logger(self.name)
        self.metrics = self.metrics_type()
        self.metrics_url: str | None = None
        self._metrics_runner: web.AppRunner | None = None
        self._nc: NatsClient | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stop_requested = asyncio.Event()
        self._crash: BaseException | None = None
        self._events: EventPublisher | None = None
        self._probe: ServerProbe | None = None

    @property
    def nc(self) -> NatsClient:
        if self._nc is None:
            raise RuntimeError(f"{self.name} is not connected")
        return self._nc

    @property
    def instance_id(self) -> str:
        """The id this instance is known by on the wire."""
        return self.name

    @property
    def events(self) -> EventPublisher:
        """The public request-lifecycle events, published as this instance."""
        if self._events is None:
            self._events = EventPublisher(self.nc, self.subjects, self.instance_id)
        return self._events

    async def start(self) -> None:
        if self.state is not ServiceState.NEW:
            raise ServiceStartFailed(f"{self.name} cannot start from state {self.state.value}")
        self.state = ServiceState.STARTING
        try:
            self._nc = await connect(self.config.nats_url, f"{self.name}:{self.instance_id}",
                                     self.config.connect_timeout_s, self._on_nats_event,
                                     self.config.nats)
            await self._setup()
            if self.serves_own_metrics:
                await self._serve_metrics()
        except Exception as exc:
            self.log.error("service.start_failed", service=self.name, error=repr(exc))
            await self.stop()
            raise ServiceStartFailed(f"{self.name} failed to start: {exc}") from exc
        self.state = ServiceState.RUNNING
        self.log.info("service.started", service=self.name, id=self.instance_id)

    async def stop(self) -> None:
        if self.state in (ServiceState.STOPPING, ServiceState.STOPPED):
            return
        was_running = self.state is ServiceState.RUNNING
        self.state = ServiceState.STOPPING
        self._stop_requested.set()
        if was_running:
            await self._guarded(self._stop_intake())
            try:
                await asyncio.wait_for(self._drain(), self.config.drain_timeout_s)
            except TimeoutError:
                self.log.warning("service.drain_timeout", service=self.name)
        await self._cancel_tasks()
        await self._guarded(self._close())
        if self._metrics_runner is not None:
            await self._guarded(self._metrics_runner.cleanup())
        if self._nc is not None and not self._nc.is_closed:
            await self._guarded(self._nc.drain())
        self.state = ServiceState.STOPPED
        self.log.info("service.stopped", service=self.name, id=self.instance_id)

    async def run(self) -> None:
        """Serve until SIGINT/SIGTERM or a crashed task, then stop."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stop_requested.set)
        try:
            await self.start()
            settle_garbage_collector()
            await self._stop_requested.wait()
            await self.stop()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        if self._crash is not None:
            raise self._crash

    def request_stop(self) -> None:
        """Have `run()` stop the service, as SIGTERM would."""
        self._stop_requested.set()

    @staticmethod
    async def wait_until(is_done: Callable[[], bool], interval_s: float = 0.02) -> None:
        """Poll `is_done`; drains use it (bounded by `drain_timeout_s` around them)."""
        while not is_done():  # noqa: ASYNC110 - cheap poll, only while stopping
            await asyncio.sleep(interval_s)

    # Hooks for subclasses.
    @abc.abstractmethod
    async def _setup(self) -> None:
        """Declare streams, subscribe, start loops."""

    async def _stop_intake(self) -> None:
        """Stop taking new work (unsubscribe, tell the cluster we are draining)."""

    async def _drain(self) -> None:
        """Return when in-flight work is done; cut short at `drain_timeout_s`."""

    async def _close(self) -> None:
        """Release engines and other resources; called once, also after a failed start."""

    # Owned tasks.
    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run `coro` as a task this service owns; if it crashes, the service stops."""
        task = asyncio.create_task(coro, name=f"{self.name}.{name}")
        self._tasks.add(task)
        task.add_done_callback(self._on_task_done)
        return task

    def _on_task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        self.log.error("service.task_crashed", task=task.get_name(), error=repr(exc),
                       exc_info=exc)
        if self._crash is None:
            self._crash = exc
        self._stop_requested.set()

    async def _cancel_tasks(self) -> None:
        """Cancel every owned task and wait for it. nats-py swallows a cancellation that lands
        inside `publish` (it catches CancelledError while queueing the flush), so a task may
        outlive one cancel(): cancel again until all are done, for at most
        `drain_timeout_s`, then leave the stragglers (logged) rather than hang."""
        pending = {t for t in self._tasks if not t.done()}
        deadline = asyncio.get_running_loop().time() + self.config.drain_timeout_s
        while pending:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=0.2)
            if pending and asyncio.get_running_loop().time() > deadline:
                self.log.warning("service.tasks_outlived_cancel", service=self.name,
                                 tasks=sorted(t.get_name() for t in pending))
                return

    async def _guarded(self, step: Awaitable[Any]) -> None:
        try:
            await step
        except Exception as exc:
            self.log.error("service.stop_step_failed", service=self.name, error=repr(exc),
                           exc_info=exc)

    # One error boundary per subscription.
    async def serve(
        self,
        subject: str,
        message_type: Any,
        handler: Callable[[Any], Awaitable[Message | None]],
        queue: str = "",
    ) -> Any:
        """Subscribe `handler` behind one error boundary (in queue group `queue`, if any: one
        member of the group gets each message).

        Decode -> handle -> reply (when the sender asked for one). Invalid payloads and
        `HalfmoonError`s are answered with a refusal; anything else is logged with its stack
        and refused, and the subscription goes on.
        """
        decoder = msgspec.json.Decoder(message_type)

        async def callback(msg: Msg) -> None:
            try:
                with tracing.attached(tracing.extract(msg.headers)):
                    reply = await handler(decoder.decode(msg.data))
            except msgspec.DecodeError as exc:
                self.log.warning("message.invalid", subject=msg.subject, error=str(exc))
                reply = self.refusal(f"invalid message on {msg.subject}: {exc}")
            except HalfmoonError as exc:
                reply = self.refusal(exc.message, code=exc.code)
            except Exception as exc:
                self.log.error("message.handler_failed", subject=msg.subject, exc_info=exc)
                reply = self.refusal(f"internal error: {exc!r}")
            if msg.reply and reply is not None:
                with contextlib.suppress(Exception):
                    # Not `msg.respond`: it sends the request's headers back with the reply
                    # (its trace context, which no requester reads), a header block built
                    # and parsed again on every traced command.
                    await self.nc.publish(msg.reply, encode(reply))

        return await self.nc.subscribe(subject, queue=queue, cb=callback)

    def _on_nats_event(self, event: str) -> None:
        """Our own NATS connection dropped ("disconnected") or came back ("reconnected")."""
        counter = (self.metrics.nats_reconnects if event == "reconnected"
                   else self.metrics.nats_disconnects)
        counter.inc()
        if event == "reconnected" and self._probe is not None:
            self._probe.reset()
        for directory in self._worker_views():
            if event == "disconnected":
                directory.suspend()  # silence while we are away is not a worker's death
            else:
                directory.resume()

    def _worker_views(self) -> list[WorkerDirectory]:
        """The worker directories this service judges by heartbeats (none by default)."""
        return []

    async def _may_judge_silence(self) -> bool:
        """Whether a worker's silence may be taken for its death now: our NATS server answers
        a PING promptly (`ServerProbe`; the heartbeats it had for us come before its answer).
        If it does not, the silence is ours (a partition, a stalled server), and every
        worker judged here gets a whole timeout from now to be heard again, as after a
        stalled loop (`_sleep_judging_on_time`): once a stalled server runs again, our PONG
        may come before the heartbeats it holds from others."""
        if self._probe is None:
            self._probe = ServerProbe(self.nc)
        if await self._probe.answers(SERVER_ANSWER_S):
            return True
        now_s = time.monotonic()
        for directory in self._worker_views():
            directory.excuse_silence(now_s)
        return False

    async def _sleep_judging_on_time(self, interval_s: float) -> None:
        """Sleep `interval_s`; if this process's loop woke more than an interval late (a
        busy CPU, a long GC, a blocking call), it read no heartbeat meanwhile: like a
        dropped connection, that silence is not the workers' death, and every worker it
        judges gets a whole timeout from now to be heard again."""
        due_s = time.monotonic() + interval_s
        await asyncio.sleep(interval_s)
        now_s = time.monotonic()
        if now_s - due_s > interval_s:
            for directory in self._worker_views():
                directory.excuse_silence(now_s)

    async def metrics_handler(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type=CONTENT_TYPE)

    async def health_handler(self, request: web.Request) -> web.Response:
        """Ready (200) while running and connected to NATS, else 503: a probe's answer."""
        is_connected = self._nc is not None and self._nc.is_connected
        is_ready = self.state is ServiceState.RUNNING and is_connected
        body = {"status": "ok" if is_ready else "unavailable", "service": self.name,
                "id": self.instance_id, "state": self.state.value,
                "nats_connected": is_connected}
        return web.json_response(body, status=200 if is_ready else 503)

    async def _serve_metrics(self) -> None:
        """`/metrics` (Prometheus) and `/health` (readiness) on `metrics_port`."""
        app = web.Application()
        app.router.add_get("/metrics", self.metrics_handler)
        app.router.add_get("/health", self.health_handler)
        self._metrics_runner = web.AppRunner(app, access_log=None)
        await self._metrics_runner.setup()
        site = web.TCPSite(self._metrics_runner, self.config.metrics_host,
                           self.config.metrics_port)
        await site.start()
        host, port = self._metrics_runner.addresses[0][:2]
        self.metrics_url = f"http://{host}:{port}/metrics"
        self.log.info("metrics.serving", url=self.metrics_url)

    def refusal(self, reason: str, *, code: str = "") -> DispatchReply:
        return DispatchReply(is_accepted=False, worker_id=self.instance_id, reason=reason,
                             code=code)

    def accept(self) -> DispatchReply:
        return DispatchReply(is_accepted=True, worker_id=self.instance_id)

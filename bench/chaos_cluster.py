"""The cluster a chaos run faults, and its faults (`bench.chaos`, `bench.storm`): halfmoon
launched as `halfmoon up --gateways 2` (`UpCluster`) or service by service
(`ProcessCluster`), watched from NATS (heartbeats, KV lease events, request events) to
count what a fault left held or placed twice; `inject` one of `SCENARIOS`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from pathlib import Path

import aiohttp
import msgspec
import nats

from shared.config import WorkerConfig
from shared.config_loading import flat_fields
from shared.messages import KvLeaseEvent, RequestEvent, WorkerHeartbeat
from shared.nats_client import subscribed
from shared.nats_server import EmbeddedNatsServer, free_ports
from shared.subjects import Subjects

# Unrenewed, a KV lease expires after the workers' `--kv-wait-timeout-s` (not set here).
LEASE_EXPIRY_S = next(f.default for f in flat_fields(WorkerConfig)
                      if f.name == "kv_wait_timeout_s")

SCENARIOS = ("none", "kill-prefill", "kill-decode", "kill-conductor", "stop-prefill",
             "pause-decode", "pause-prefill", "pause-conductor", "restart-nats",
             "kill-gateway")


class Cluster:
    """A running halfmoon (2 prefill + 2 decode workers, 2 gateways, `--engine`) and a view
    of it from NATS: heartbeats and lease events. Subclasses launch it."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.port = free_ports(2)  # the two gateways' ports
        self.cluster = f"chaos{os.getpid()}"
        self.nats_url = ""
        self.heartbeats: dict[str, WorkerHeartbeat] = {}
        self.leases: Counter[tuple[str, str, str]] = Counter()
        # Per request id: `placed` events, and the gateway's re-placements (`migrated` with
        # an attempt): a placement beyond the first and those ran the request twice.
        self.placements: Counter[str] = Counter()
        self.replacements: Counter[str] = Counter()
        self._nc: nats.aio.client.Client | None = None
        self.held_at_settle = (0, 0)

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.port + i}" for i in range(2)]

    @property
    def worker_flags(self) -> list[str]:
        """The workers' flags (`halfmoon up`'s too, with `--up-flags` after them)."""
        engine = ["--engine", "torch"] if self.args.engine == "torch" else [
            "--engine", "fake", "--fake-token-delay-s", str(self.args.token_delay_s),
            "--fake-prefill-delay-s", "0.02"]
        return [*engine, "--log-level", "warning", *self.args.up_flags]

    async def launch(self) -> None:
        raise NotImplementedError

    def pids(self, role: str) -> list[int]:
        raise NotImplementedError

    async def restart_nats(self) -> None:
        raise NotImplementedError

    async def stop_processes(self) -> None:
        raise NotImplementedError

    def gateway_pid(self, index: int) -> int:
        """The gateway serving on the `index`th port."""
        port = str(self.port + index).encode()
        for pid in self.pids("gateway"):
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if port in command:
                return pid
        raise LookupError(f"no gateway on port {port.decode()}")

    async def start(self) -> None:
        await self.launch()

        async def quiet(_exc: Exception) -> None:
            return None  # this observer's own reconnects across a NATS restart are expected

        self._nc = await nats.connect(self.nats_url, max_reconnect_attempts=-1,
                                      reconnect_time_wait=0.2, error_cb=quiet)
        subjects = Subjects(self.cluster)
        heartbeat = msgspec.json.Decoder(WorkerHeartbeat)
        lease = msgspec.json.Decoder(KvLeaseEvent)
        request_event = msgspec.json.Decoder(RequestEvent)

        async def on_heartbeat(msg: nats.aio.msg.Msg) -> None:
            beat = heartbeat.decode(msg.data)
            self.heartbeats[beat.worker_id] = beat

        async def on_lease(msg: nats.aio.msg.Msg) -> None:
            event = lease.decode(msg.data)
            key = (event.owner, event.kind, event.request_id)
            self.leases[key] += 1 if event.action == "granted" else -1

        async def on_request_event(msg: nats.aio.msg.Msg) -> None:
            event = request_event.decode(msg.data)
            if event.kind == "placed":
                self.placements[event.request_id] += 1
            elif event.kind == "migrated" and event.attempt:
                self.replacements[event.request_id] += 1

        await self._nc.subscribe(subjects.all_heartbeats, cb=on_heartbeat)
        await self._nc.subscribe(subjects.all_request_events, cb=on_request_event)
        await self._nc.subscribe(subjects.all_kv_lease_events, cb=on_lease)
        await subscribed(self._nc)  # a lease granted from now on is counted

    async def settle(self, settle_s: float) -> None:
        """Wait for the idle cluster's heartbeats, then, while any KV is still held, for the
        leases to expire (a reservation whose release was lost is freed that way)."""
        await asyncio.sleep(settle_s)
        self.held_at_settle = self.leaked()
        for _ in range(int((LEASE_EXPIRY_S + 2.0) / 0.5)):  # and a heartbeat or two
            if not any(self.leaked()):
                return
            await asyncio.sleep(0.5)

    def placed_twice(self) -> int:
        """Requests placed more often than the gateway placed them (a conductor placing a
        delivery that was placed already): each ran twice for a while."""
        return sum(1 for request_id, count in self.placements.items()
                   if count > 1 + self.replacements[request_id])

    def leaked(self) -> tuple[int, int]:
        """(KV blocks still used by live workers, leases still held) once idle. Lease events
        are core NATS, at most once: one published as NATS restarts may never arrive, so a
        lease is counted only while its owner uses blocks (every lease holds some)."""
        fresh = [b for b in self.heartbeats.values() if time.time() - b.sent_at_s < 3]
        used = {b.worker_id: b.num_total_blocks - b.num_free_blocks for b in fresh}
        leases = sum(1 for (owner, _, _), held in self.leases.items() if held > 0
                     and used.get(owner, 0) > 0)
        return sum(used.values()), leases

    async def stop(self) -> None:
        if self._nc is not None:
            await self._nc.close()
        await self.stop_processes()


class UpCluster(Cluster):
    """Launched as `halfmoon up --gateways 2` (supervised: killed processes come back)."""

    async def launch(self) -> None:
        await asyncio.to_thread(self._launch)

    def _launch(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", "--port", str(self.port),
             "--cluster", self.cluster, "--prefill", "2", "--decode", "2", "--gateways", "2",
             *self.worker_flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert self.process.stdout is not None
        said: deque[str] = deque(maxlen=12)
        for line in self.process.stdout:
            if "halfmoon is up" in line:
                self.nats_url = line.split("(NATS ", 1)[1].split(",", 1)[0]
                threading.Thread(target=self.process.stdout.read, daemon=True).start()
                return
            said.append(line)
        raise SystemExit(f"halfmoon up exited with {self.process.wait()}: "
                         f"{''.join(said)}")

    async def restart_nats(self) -> None:
        os.kill(self.pids("nats-server")[0], signal.SIGKILL)  # the launcher restarts it

    async def stop_processes(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        await asyncio.to_thread(self.process.wait, 60)

    def pids(self, role: str) -> list[int]:
        """The launcher's children running `role` (or the nats-server)."""
        found = []
        for entry in Path("/proc").iterdir():
            try:
                stat = (entry / "stat").read_text()
                command = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if int(stat.rsplit(") ", 1)[1].split()[1]) != self.process.pid:
                continue
            if command[0].endswith(b"nats-server") if role == "nats-server" else (
                    b"services.cli" in command
                    and command[command.index(b"services.cli") + 1] == role.encode()):
                found.append(int(entry.name))
        return sorted(found)


class ProcessCluster(Cluster):
    """Every service started by hand as its own process, no supervisor: 2 conductors (they
    share the work queue), 2 prefill, 2 decode, 2 gateways, and a nats-server the bench
    restarts itself. A killed process stays dead; its peers carry on."""

    async def launch(self) -> None:
        await asyncio.to_thread(self._spawn_all)
        deadline = time.monotonic() + 60
        while not all([await self._is_healthy(url) for url in self.urls]):
            if time.monotonic() > deadline:
                raise SystemExit("the services did not come up within 60 s")
            await asyncio.sleep(0.2)

    def _spawn_all(self) -> None:
        self.server = EmbeddedNatsServer()
        self.nats_url = self.server.start()
        self.children: list[tuple[str, subprocess.Popen[bytes]]] = []
        roles: list[tuple[str, list[str]]] = [
            ("conductor", ["--log-level", "warning"])] * 2 + [
            ("prefill", self.worker_flags)] * 2 + [("decode", self.worker_flags)] * 2
        roles += [("gateway", ["--tokenizer", "bytes", "--port", str(self.port + i),
                               "--log-level", "warning"]) for i in range(2)]
        # Every worker of the cluster holds the same transfer secret.
        environment = {**os.environ, "HALFMOON_TRANSFER_SECRET": secrets.token_hex(16)}
        for role, flags in roles:
            self.children.append((role, subprocess.Popen(
                [sys.executable, "-m", "services.cli", role, "--nats-url", self.nats_url,
                 "--cluster", self.cluster, *flags], stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True, env=environment)))

    @staticmethod
    async def _is_healthy(url: str) -> bool:
        try:
            async with aiohttp.ClientSession() as session, session.get(f"{url}/health") as r:
                body = await r.json(content_type=None)
        except (aiohttp.ClientError, ValueError):
            return False
        return body.get("num_prefill_workers") == 2 and body.get("num_decode_workers") == 2

    def pids(self, role: str) -> list[int]:
        if role == "nats-server":
            return []
        return sorted(p.pid for r, p in self.children if r == role and p.poll() is None)

    async def restart_nats(self) -> None:
        self.server.kill()
        await asyncio.sleep(1.0)
        await asyncio.to_thread(self.server.restart)

    async def stop_processes(self) -> None:
        for _, process in self.children:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for _, process in self.children:
            try:
                await asyncio.to_thread(process.wait, 30)
            except subprocess.TimeoutExpired:
                process.kill()
        self.server.stop()


async def inject(cluster: Cluster, scenario: str) -> None:
    match scenario:
        case "kill-prefill" | "kill-decode" | "kill-conductor":
            os.kill(cluster.pids(scenario.removeprefix("kill-"))[0], signal.SIGKILL)
        case "stop-prefill":
            pid = cluster.pids("prefill")[0]
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(2.0)
            os.kill(pid, signal.SIGKILL)
        case "pause-decode" | "pause-prefill" | "pause-conductor":
            # Hung past the heartbeat timeout (the conductor: past the ack wait), then back.
            role = scenario.removeprefix("pause-")
            pid = cluster.pids(role)[0]
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(6.0 if role == "conductor" else 3.0)
            os.kill(pid, signal.SIGCONT)
        case "restart-nats":
            await cluster.restart_nats()
        case "kill-gateway":
            os.kill(cluster.gateway_pid(1), signal.SIGKILL)

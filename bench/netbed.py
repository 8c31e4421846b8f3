"""A multi-host test bed on one machine: network namespaces as hosts on one bridge.

Each host is a namespace with its own loopback, address and port space, joined to a bridge
(in a "switch" namespace of its own) by a veth pair, so processes on different hosts reach
each other only over TCP through that bridge (never shared memory: halfmoon's workers are
told different host names). A host's link can be shaped with `tc ... tbf` (both directions)
and taken down and up (a partition). The calling process reaches the hosts through one more
veth (`access`): every address it talks to is one this bed made.

    with NetBed(num_hosts=2) as bed:
        server = bed.spawn(bed.hosts[0], ["nats-server", "-a", bed.hosts[0].address, ...])
        bed.shape(bed.hosts[1], rate_mbit=1000)

Needs root (CAP_NET_ADMIN) and `ip`/`tc` (iproute2); `NetBed.unavailable()` says why not.
Every namespace, link and process is removed on exit, also after a failure; namespaces left
by a bed whose process died are removed by the next bed (`remove_stale`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO

from shared.child_process import is_alive

PREFIX = "hmbed"  # every namespace and root-side link this module makes starts with it


class NetBedError(RuntimeError):
    """A command of the bed failed (its stderr in the message)."""


@dataclass
class Host:
    name: str  # its namespace's name and its host name
    address: str
    port_link: str  # the veth end on the bridge (in the switch namespace)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise NetBedError(f"{' '.join(args)}: {result.stderr.strip()}")
    return result


def _in(namespace: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run("ip", "netns", "exec", namespace, *args, check=check)


class NetBed:
    """`num_hosts` hosts on a /24 picked not to overlap any route of this machine."""

    def __init__(self, num_hosts: int) -> None:
        if not 1 <= num_hosts <= 200:
            raise ValueError(f"1 to 200 hosts, not {num_hosts}")
        self._id = f"{PREFIX}{os.getpid() % 100000}"
        self._switch = f"{self._id}-sw"
        self._access = f"{self._id}a"  # root side of the access link (<= 15 characters)
        self._subnet = _free_subnet()
        addresses = list(self._subnet.hosts())
        self.access_address = str(addresses[-1])
        self.hosts = [Host(name=f"{self._id}-h{i}", address=str(addresses[i]),
                           port_link=f"p{i}") for i in range(num_hosts)]
        self._logs: list[IO[bytes]] = []
        self._log_dir = tempfile.TemporaryDirectory(prefix=f"{self._id}-logs-")

    @staticmethod
    def unavailable() -> str | None:
        """Why a bed cannot be made here, or None when it can."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        for tool in ("ip", "tc", "unshare"):
            if shutil.which(tool) is None:
                return f"{tool} (iproute2) is not installed"
        probe = f"{PREFIX}probe{os.getpid()}"
        made = _run("ip", "netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"cannot make a network namespace: {made.stderr.strip()}"
        _run("ip", "netns", "del", probe, check=False)
        return None

    def __enter__(self) -> NetBed:
        remove_stale()
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make(self) -> None:
        prefix_len = str(self._subnet.prefixlen)
        _run("ip", "netns", "add", self._switch)
        _in(self._switch, "ip", "link", "add", "br0", "type", "bridge")
        _in(self._switch, "ip", "link", "set", "br0", "up")
        for host in self.hosts:
            _run("ip", "netns", "add", host.name)
            _in(host.name, "ip", "link", "set", "lo", "up")
            _run("ip", "link", "add", "eth0", "netns", host.name, "type", "veth",
                 "peer", "name", host.port_link, "netns", self._switch)
            _in(host.name, "ip", "addr", "add", f"{host.address}/{prefix_len}", "dev", "eth0")
            _in(host.name, "ip", "link", "set", "eth0", "up")
            self._attach(host.port_link)
        _run("ip", "link", "add", self._access, "type", "veth", "peer", "name", "access",
             "netns", self._switch)
        _run("ip", "addr", "add", f"{self.access_address}/{prefix_len}", "dev", self._access)
        _run("ip", "link", "set", self._access, "up")
        self._attach("access")

    def _attach(self, link: str) -> None:
        _in(self._switch, "ip", "link", "set", link, "master", "br0")
        _in(self._switch, "ip", "link", "set", link, "up")

    def spawn(self, host: Host, argv: Sequence[str], *, env: dict[str, str] | None = None,
              log_name: str | None = None) -> subprocess.Popen[bytes]:
        """Run `argv` on `host` (in its namespace); output to a log file when named."""
        out: IO[bytes] | int = subprocess.DEVNULL
        if log_name is not None:
            out = open(self._log_path(log_name), "wb")  # noqa: SIM115 - closed on exit
            self._logs.append(out)
        # Its own UTS namespace too: the host's name is its own (what `gethostname()` and so
        # the transfer engine's host id see; no shared memory between hosts).
        command = ["ip", "netns", "exec", host.name, "unshare", "--uts", "sh", "-c",
                   'hostname "$0" && exec "$@"', host.name, *argv]
        process = subprocess.Popen(command, stdout=out,
                                   stderr=subprocess.STDOUT, env=env, start_new_session=True)
        host.processes.append(process)
        return process

    def _log_path(self, log_name: str) -> str:
        return f"{self._log_dir.name}/{log_name}.log"

    def log(self, log_name: str) -> str:
        """What a process spawned with `log_name` wrote (until the bed closes)."""
        with contextlib.suppress(OSError), open(self._log_path(log_name), errors="replace") as file:
            return file.read()
        return ""

    def shape(self, host: Host, rate_mbit: float) -> None:
        """Limit `host`'s link to `rate_mbit` each way (token bucket on both veth ends)."""
        rate_bytes = rate_mbit * 1e6 / 8
        burst = max(int(rate_bytes / 250), 64 << 10)  # enough for a 4 ms timer tick
        for namespace, link in ((host.name, "eth0"), (self._switch, host.port_link)):
            _in(namespace, "tc", "qdisc", "replace", "dev", link, "root", "tbf",
                "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "20ms")

    def unshape(self, host: Host) -> None:
        for namespace, link in ((host.name, "eth0"), (self._switch, host.port_link)):
            _in(namespace, "tc", "qdisc", "del", "dev", link, "root", check=False)

    def cut(self, host: Host) -> None:
        """Partition `host`: its port on the bridge goes down."""
        _in(self._switch, "ip", "link", "set", host.port_link, "down")

    def heal(self, host: Host) -> None:
        _in(self._switch, "ip", "link", "set", host.port_link, "up")

    def close(self) -> None:
        """Stop every process, delete every namespace and link; safe to call twice."""
        for host in self.hosts:
            for process in host.processes:
                _stop(process)
            host.processes.clear()
        _remove(self._id)
        for log in self._logs:
            log.close()
        self._logs.clear()
        self._log_dir.cleanup()


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _remove(bed_id: str) -> None:
    """Delete the namespaces and the root-side access link of bed `bed_id`, and kill what
    still runs in them (deleting a namespace deletes its veth ends)."""
    namespaces = [line.split()[0] for line in _run("ip", "netns", "list").stdout.splitlines()
                  if line.split() and re.fullmatch(rf"{bed_id}-(sw|h\d+)", line.split()[0])]
    for namespace in namespaces:
        pids = _run("ip", "netns", "pids", namespace, check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _run("ip", "netns", "del", namespace, check=False)
    _run("ip", "link", "del", f"{bed_id}a", check=False)


def remove_stale() -> None:
    """Remove the beds of processes that no longer run (a crashed test or benchmark)."""
    beds = {match.group(1) for line in _run("ip", "netns", "list").stdout.splitlines()
            if (match := re.match(rf"({PREFIX}(\d+))-", line))}
    for bed_id in beds:
        pid = int(bed_id.removeprefix(PREFIX))
        if not is_alive(pid):
            _remove(bed_id)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.213.0.0/16 that no route or address of this machine overlaps."""
    used = [ipaddress.ip_network(word, strict=False)
            for line in _run("ip", "-4", "route", "show", "table", "all").stdout.splitlines()
            for word in line.split()[:1] if re.fullmatch(r"[\d.]+(/\d+)?", word)]
    start = os.getpid() % 250
    for offset in range(250):
        subnet = ipaddress.ip_network(f"10.213.{(start + offset) % 250}.0/24")
        if not any(subnet.overlaps(net) for net in used):
            return subnet
    raise NetBedError("no free /24 in 10.213.0.0/16")


def wait_until(is_true: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not is_true():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise NetBedError(f"{what} not within {timeout_s}s")
        time.sleep(0.1)

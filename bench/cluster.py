"""halfmoon across hosts of a network-namespace bed (`bench.netbed`): KV moves between hosts
over TCP on shaped links.

    python -m bench.cluster [--scenarios transfer,serving,faults] [--rates-mbit 1000,10000]
                            [--sizes-mib 16,64,256] (or: halfmoon bench cluster; needs root)

Scenario (a), `transfer`: the transfer engine between two hosts whose links are shaped with
`tbf` at each rate: GB/s of one transfer of each size (median over repeats; a repeat ends when the
receiver has every byte) as a fraction of the link rate, beside a plain socket
(sendall/recv_into) over the same link in the same run. The seed's TCP figure is 70-80 % of
the link; the aim is >= 90 % for transfers >= 16 MiB.

Scenarios (b) `serving` and (c) `faults` (`bench.cluster_serving`): a seeded Poisson stream
across 3 NATS hosts and 2 + 2 worker hosts against the same stream on one host, and the stream
while a NATS node is SIGKILLed or its host cut off.

`BedCluster` also runs a whole halfmoon (NATS, conductor, gateway, workers) with each
process on the host it is given; the tests marked `cluster` drive it.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench.netbed import Host, NetBed, NetBedError, wait_until
from shared.nats_server import find_nats_server

NATS_PORT = 4222
GATEWAY_PORT = 8000
# Ports on each host (hosts have ports of their own); the n-th worker of a host adds n.
CONDUCTOR_METRICS_PORT = 9099
METRICS_PORT = 9100
TRANSFER_PORT = 7700


@dataclass(frozen=True)
class Placement:
    """Which host (index into the bed's hosts) runs what."""

    nats: tuple[int, ...] = (0,)
    conductor: int = 0
    gateway: int = 0
    prefill: tuple[int, ...] = (0,)
    decode: tuple[int, ...] = (1,)


class BedCluster:
    """halfmoon on a bed: NATS nodes (routed when several), conductor, gateway, prefill and
    decode workers, each a process on its host, reached from here at the hosts' addresses."""

    def __init__(self, bed: NetBed, placement: Placement, *, worker_flags: list[str],
                 gateway_flags: list[str] | None = None, cluster: str = "bed") -> None:
        self.bed = bed
        self.placement = placement
        self._worker_flags = worker_flags
        self._gateway_flags = gateway_flags or []
        self._cluster = cluster
        self._store = tempfile.TemporaryDirectory(prefix="halfmoon-bed-")
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1",
                     "HALFMOON_TRANSFER_SECRET": secrets.token_hex(16)}
        self.nats_url = ",".join(f"nats://{self.host(i).address}:{NATS_PORT}"
                                 for i in placement.nats)
        self.gateway_url = f"http://{self.host(placement.gateway).address}:{GATEWAY_PORT}"
        # (role, host) -> port, of the first worker of a role on a host
        self._metrics_ports: dict[tuple[str, int], int] = {}
        self._num_workers: dict[int, int] = {}  # by host
        self._nats: dict[int, subprocess.Popen[bytes]] = {}  # by host
        self._log_names: list[str] = []

    def host(self, index: int) -> Host:
        return self.bed.hosts[index]

    def start(self, timeout_s: float = 90.0) -> BedCluster:
        for index in self.placement.nats:
            self.start_nats(index)
        self._service("conductor", self.placement.conductor,
                      ["--metrics-port", str(CONDUCTOR_METRICS_PORT)])
        for index in self.placement.prefill:
            self._worker("prefill", index)
        for index in self.placement.decode:
            self._worker("decode", index)
        self._service("gateway", self.placement.gateway,
                      ["--host", "0.0.0.0", "--port", str(GATEWAY_PORT),
                       *self._gateway_flags])
        try:
            wait_until(self.is_ready, timeout_s, "the cluster's gateway ready with every worker")
        except NetBedError as exc:
            logs = "\n".join(f"--- {name}:\n{self.bed.log(name)[-1500:]}"
                             for name in self._log_names)
            raise NetBedError(f"{exc}; health {self.health()}\n{logs}") from exc
        return self

    def start_nats(self, index: int) -> None:
        host = self.host(index)
        args = [str(find_nats_server()), "-js", "-a", host.address, "-p", str(NATS_PORT),
                "-m", "8222", "-sd", f"{self._store.name}/{host.name}"]
        if len(self.placement.nats) > 1:
            routes = ",".join(f"nats://{self.host(i).address}:6222" for i in self.placement.nats)
            args += ["--server_name", host.name, "--cluster_name", "bed",
                     "--cluster", f"nats://{host.address}:6222", "--routes", routes]
        if f"nats-{index}" not in self._log_names:
            self._log_names.append(f"nats-{index}")
        self._nats[index] = self.bed.spawn(host, args, log_name=f"nats-{index}")

    def kill_nats(self, index: int) -> None:
        """SIGKILL the NATS node on host `index` (`start_nats` starts it again, on its
        store: it rejoins the cluster)."""
        process = self._nats.pop(index)
        process.kill()
        process.wait(timeout=10)

    def _common(self) -> list[str]:
        return ["--nats-url", self.nats_url, "--cluster", self._cluster, "--log-level",
                "warning", "--js-replicas", str(min(3, len(self.placement.nats)))]

    def _service(self, role: str, index: int, flags: list[str]) -> None:
        log_name = f"{role}-{index}-{len(self._log_names)}"
        self._log_names.append(log_name)
        self.bed.spawn(self.host(index), [
            sys.executable, "-m", "services.cli", role, *self._common(),
            "--metrics-host", "0.0.0.0", *flags], env=self._env, log_name=log_name)

    def _worker(self, role: str, index: int) -> None:
        host = self.host(index)
        nth = self._num_workers.get(index, 0)  # workers on this host so far
        self._num_workers[index] = nth + 1
        worker_id = f"{role}-{index}"
        if (role, index) in self._metrics_ports:  # another of this role on this host
            worker_id = f"{role}-{index}-{nth}"
        else:
            self._metrics_ports[role, index] = METRICS_PORT + nth
        self._service(role, index, [
            "--metrics-port", str(METRICS_PORT + nth), "--worker-id", worker_id,
            "--host-name", host.name, "--transfer-host", "0.0.0.0",
            "--transfer-port", str(TRANSFER_PORT + nth), "--transfer-advertise-host",
            host.address, *self._worker_flags])

    def health(self) -> dict[str, object]:
        try:
            with urllib.request.urlopen(f"{self.gateway_url}/health", timeout=2) as response:
                return dict(json.loads(response.read()))
        except (urllib.error.URLError, OSError, ValueError) as exc:
            if isinstance(exc, urllib.error.HTTPError):
                return dict(json.loads(exc.read()))
            return {"status": "unreachable"}

    def is_ready(self) -> bool:
        """The gateway sees every worker and the conductor is up (workers heartbeat to the
        gateway whether or not a conductor runs)."""
        health = self.health()
        return (health.get("status") == "ok"
                and health.get("num_prefill_workers") == len(self.placement.prefill)
                and health.get("num_decode_workers") == len(self.placement.decode)
                and self._is_conductor_up())

    def _is_conductor_up(self) -> bool:
        host = self.host(self.placement.conductor)
        url = f"http://{host.address}:{CONDUCTOR_METRICS_PORT}/health"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def worker_metrics(self, role: str, index: int) -> dict[str, float]:
        """A worker's Prometheus samples (`name{labels}` -> value)."""
        url = f"http://{self.host(index).address}:{self._metrics_ports[role, index]}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line and not line.startswith("#")}

    def close(self) -> None:
        self.bed.close()
        self._store.cleanup()


# --- scenario (a): transfer efficiency at shaped link rates ------------------------------

def _transfer_rows(bed: NetBed, rates_mbit: list[float], sizes: list[int],
                   seconds: float) -> list[dict[str, object]]:
    sender, receiver = bed.hosts
    secret = secrets.token_hex(16)
    max_bytes = max(sizes)
    env = {**os.environ, "HALFMOON_BENCH_SECRET": secret}
    listen = ["--listen-host", receiver.address, "--size", str(max_bytes)]
    engine = bed.spawn(receiver, [sys.executable, "-m", "bench.transfer", "--serve", "engine",
                                  *listen, "--port-file", "/tmp/bench-cluster-engine.port"],
                       env=env, log_name="receiver-engine")
    sink = bed.spawn(receiver, [sys.executable, "-m", "bench.transfer", "--serve", "socket",
                                *listen, "--port-file", "/tmp/bench-cluster-socket.port"],
                     env=env, log_name="receiver-socket")
    ports = [_read_port(Path(f"/tmp/bench-cluster-{kind}.port"), child)
             for kind, child in (("engine", engine), ("socket", sink))]
    rows = []
    for rate in rates_mbit:
        bed.shape(sender, rate)
        bed.shape(receiver, rate)
        measured = subprocess.run(
            ["ip", "netns", "exec", sender.name, sys.executable, "-m", "bench.transfer",
             "--send-to", receiver.address, "--engine-port", str(ports[0]),
             "--socket-port", str(ports[1]), "--sizes", ",".join(map(str, sizes)),
             "--seconds", str(seconds)], env=env, capture_output=True, text=True)
        if measured.returncode != 0:
            raise RuntimeError(f"the sender failed: {measured.stderr[-2000:]}")
        for line in measured.stdout.splitlines():
            row = json.loads(line)
            link_gbps = rate / 8 / 1000
            row.update(rate_mbit=rate, link_gb_s=link_gbps,
                       tcp_of_link=row["tcp"] / link_gbps, socket_of_link=row["socket"] / link_gbps)
            rows.append(row)
            print(_format(row), flush=True)
    return rows


def _read_port(path: Path, child: subprocess.Popen[bytes], timeout_s: float = 30) -> int:
    wait_until(lambda: path.exists() or child.poll() is not None, timeout_s, f"{path}")
    if child.poll() is not None:
        raise RuntimeError(f"the receiver exited ({child.returncode})")
    port = int(path.read_text())
    path.unlink()
    return port


HEADER = (f"{'link':>9} {'size':>8} {'tcp GB/s':>9} {'of link':>8} {'socket GB/s':>12} "
          f"{'of link':>8}")


def _format(row: dict[str, object]) -> str:
    return (f"{row['rate_mbit']:>6.0f} Mb {row['bytes'] / 2**20:>6.0f} MiB "  # type: ignore[operator]
            f"{row['tcp']:>9.3f} {row['tcp_of_link']:>8.0%} {row['socket']:>12.3f} "
            f"{row['socket_of_link']:>8.0%}")


def _summary(rows: list[dict[str, object]]) -> str:
    large = [row for row in rows if int(row["bytes"]) >= 16 << 20]  # type: ignore[call-overload]
    fractions = [float(row["tcp_of_link"]) for row in large]  # type: ignore[arg-type]
    ratios = [float(row["tcp"]) / float(row["socket"]) for row in large]  # type: ignore[arg-type]
    return (f"transfers >= 16 MiB: tcp at {min(fractions):.0%}-{max(fractions):.0%} of the "
            f"link (aim >= 90 %), {statistics.median(ratios):.2f}x the plain socket (median)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="halfmoon bench cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default="transfer,serving,faults",
                        help="any of transfer (a), serving (b), faults (c)")
    parser.add_argument("--rates-mbit", default="1000,10000", help="link rates to shape")
    parser.add_argument("--sizes-mib", default="16,64,256", help="transfer sizes")
    parser.add_argument("--seconds", type=float, default=2.0, help="time per measurement")
    parser.add_argument("--num-requests", type=int, default=60, help="of the serving stream")
    parser.add_argument("--rate", type=float, default=4.0, help="requests/s of the stream")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    reason = NetBed.unavailable()
    if reason is not None:
        sys.exit(f"halfmoon bench cluster: {reason}")
    scenarios = set(args.scenarios.split(","))
    started = time.monotonic()
    report: dict[str, object] = {}
    if "transfer" in scenarios:
        print(HEADER, flush=True)
        with NetBed(2) as bed:
            rows = _transfer_rows(bed, [float(rate) for rate in args.rates_mbit.split(",")],
                                  [int(size) << 20 for size in args.sizes_mib.split(",")],
                                  args.seconds)
        print(_summary(rows))
        report["transfer"] = rows
    if scenarios & {"serving", "faults"}:
        report.update(_serving(scenarios, args))
    print(f"({time.monotonic() - started:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=vars))


def _serving(scenarios: set[str], args: argparse.Namespace) -> dict[str, object]:
    from bench import cluster_serving as serving  # it imports this module
    from engine.builtin_model import ensure_builtin_model

    settings = serving.StreamSettings(model_dir=ensure_builtin_model(),
                                      num_requests=args.num_requests, rate=args.rate)
    report: dict[str, object] = {}
    if "serving" in scenarios:
        summaries = serving.stream_rows(settings)
        print(serving.STREAM_HEADER)
        for name, summary in summaries.items():
            print(serving.format_stream(name, summary), flush=True)
        report["serving"] = {name: summary.to_dict() for name, summary in summaries.items()}
    if "faults" in scenarios:
        faults = serving.fault_rows(settings)
        print(serving.FAULT_HEADER)
        for row in faults:
            print(serving.format_fault(row), flush=True)
        report["faults"] = faults
    return report


if __name__ == "__main__":
    main()

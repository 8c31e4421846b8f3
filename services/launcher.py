"""`halfmoon up`: the whole system on one machine, each service its own OS process.

Order: NATS (embedded, one node or `--nats-cluster N`, unless `--nats` names a server) ->
conductor -> prefill and decode workers -> gateway; ready once the gateway's /health sees
every worker. From then on the launcher supervises: a child that exits unexpectedly (an
embedded NATS node too) is restarted with backoff while the others keep serving, and a
crash loop (`--max-restarts` within `--restart-window-s`) stops everything with the
process's last log lines (`supervisor.py`); restarts are counted on the launcher's own
/metrics (`halfmoon_process_restarts_total{service}`). Ctrl-C or SIGTERM stops
the gateway first (no new requests), then workers and conductor, then NATS (children run in
sessions of their own: a terminal's Ctrl-C reaches only the launcher); children that do not
stop in time are killed, and children die with the launcher (PDEATHSIG).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import secrets
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from types import FrameType

from prometheus_client import CollectorRegistry, Counter, start_http_server

from services.supervisor import CrashLoop, RestartPolicy, Supervisor
from shared.config import ConductorConfig, GatewayConfig, ServiceConfig, WorkerConfig
from shared.config_loading import C, FlatField, add_field_flag, flat_fields, load_config
from shared.errors import ConfigError, ServiceStartFailed
from shared.model_dir import BUILTIN_MODEL_NAME
from shared.nats_client import redact
from shared.nats_server import EmbeddedNatsCluster

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0


# The configs of the processes `up` starts, by role.
ROLE_CONFIGS: dict[str, type[ServiceConfig]] = {
    "gateway": GatewayConfig, "conductor": ConductorConfig, "prefill": WorkerConfig,
    "decode": WorkerConfig,
}
# Settings `up` sets itself (per process, or from its own flags), never passed through.
_SET_BY_UP = {"nats_url", "cluster", "host", "port", "worker_id", "role", "gateway_id",
              "metrics_port",
              "transfer_port", "transfer_secret", "model", "model_path",
              "local_prefill_max_tokens"}


def passthrough_fields() -> dict[str, FlatField]:
    """Every service setting `up` passes on: one flag each, derived from the configs."""
    fields: dict[str, FlatField] = {}
    for config in ROLE_CONFIGS.values():
        for field in flat_fields(config):
            if field.name not in _SET_BY_UP:
                fields.setdefault(field.name, field)
    return fields


def _role_settings() -> dict[str, dict[str, FlatField]]:
    return {role: {f.name: f for f in flat_fields(config)}
            for role, config in ROLE_CONFIGS.items()}


@dataclass(frozen=True)
class UpOptions:
    host: str
    port: int
    nats_url: str | None
    nats_port: int | None
    num_prefill: int
    num_decode: int
    cluster: str
    is_colocated: bool  # then the decode workers prefill too, and num_prefill is 0
    settings: tuple[tuple[str, object], ...]  # (flat setting name, value) passed on
    restart_policy: RestartPolicy = dataclass_field(default_factory=RestartPolicy)
    metrics_port: int = 0  # the launcher's own /metrics (0: a free port)
    num_gateways: int = 1  # on ports port, port + 1, ...
    nats_cluster: int = 1  # nodes of the embedded NATS
    # (name, directory) of each model served, each by num_prefill + num_decode workers; the
    # first is the gateways' own. No directory: the built-in model (or the fake/sim engine's).
    models: tuple[tuple[str, str | None], ...] = ((BUILTIN_MODEL_NAME, None),)

    @property
    def is_builtin_model(self) -> bool:
        return dict(self.settings).get("engine", "torch") == "torch" and any(
            path is None for _, path in self.models)

    @staticmethod
    def add_flags(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--nats", dest="nats_url", default=None,
                            help="use this NATS server instead of an embedded one")
        parser.add_argument("--nats-port", type=int, default=None,
                            help="port of the embedded NATS server (default: a free one)")
        parser.add_argument("--nats-cluster", type=int, default=1, metavar="N",
                            help="run the embedded NATS as a cluster of N nodes (JetStream "
                                 "assets with min(N, 3) replicas unless --js-replicas says)")
        parser.add_argument("--mode", default="disaggregated",
                            choices=["disaggregated", "colocated"],
                            help="colocated: every worker prefills and decodes (no KV moves)")
        parser.add_argument("--prefill", dest="num_prefill", type=int, default=1,
                            help="prefill workers (disaggregated)")
        parser.add_argument("--decode", dest="num_decode", type=int, default=1,
                            help="decode workers (disaggregated)")
        parser.add_argument("--workers", dest="num_workers", type=int, default=2,
                            help="workers (colocated)")
        parser.add_argument("--local-prefill-max-tokens", default=None,
                            help="disaggregated: decode workers prefill prompts up to this "
                                 "many tokens themselves (conditional disaggregation)")
        parser.add_argument("--cluster", default="default")
        parser.add_argument("--gateways", dest="num_gateways", type=int, default=1,
                            help="gateways, on --port, --port + 1, ... (stateless replicas)")
        parser.add_argument("--max-restarts", type=int, default=RestartPolicy.max_crashes,
                            help="crashes of one process within --restart-window-s after "
                                 "which everything stops")
        parser.add_argument("--restart-window-s", type=float,
                            default=RestartPolicy.crash_window_s)
        parser.add_argument("--metrics-port", type=int, default=0,
                            help="the launcher's /metrics (child restarts); 0: a free port")
        parser.add_argument("--model", "--model-path", dest="model_paths", action="append",
                            default=None, metavar="PATH",
                            help="a Hugging Face model directory, served under its directory's "
                                 "name (default: the built-in model); repeat to serve several, "
                                 "each by --prefill + --decode (or --workers) workers")
        services = parser.add_argument_group(
            "service settings", "passed to every process whose config has them (see "
            "`halfmoon gateway|conductor|prefill|decode --help`)")
        for field in passthrough_fields().values():
            add_field_flag(services, field)  # type: ignore[arg-type]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> UpOptions:
        settings: list[tuple[str, object]] = [
            (name, getattr(args, name)) for name in passthrough_fields()
            if getattr(args, name) is not None]
        if args.engine in ("fake", "sim"):
            settings.append(("tokenizer", "bytes"))
        if args.log_format is None and sys.stderr.isatty():
            # Children log through the launcher's pipe; on a terminal they should still look
            # as they would on one.
            settings.append(("log_format", "console"))
        if args.nats_cluster > 1 and args.nats_url is not None:
            raise ConfigError("--nats-cluster starts an embedded cluster; --nats names one")
        if args.nats_cluster > 1 and args.js_replicas is None:
            settings.append(("js_replicas", min(3, args.nats_cluster)))
        is_colocated = args.mode == "colocated"
        if is_colocated:  # a colocated worker prefills every prompt it could ever hold
            settings.append(("local_prefill_max_tokens", 1 << 30))
        elif args.local_prefill_max_tokens is not None:
            settings.append(("local_prefill_max_tokens", args.local_prefill_max_tokens))
        _check_settings(settings)
        return cls(host=args.host, port=args.port, nats_url=args.nats_url,
                   nats_port=args.nats_port,
                   num_prefill=0 if is_colocated else args.num_prefill,
                   num_decode=args.num_workers if is_colocated else args.num_decode,
                   cluster=args.cluster, is_colocated=is_colocated,
                   num_gateways=max(1, args.num_gateways), nats_cluster=args.nats_cluster,
                   settings=tuple(settings), metrics_port=args.metrics_port,
                   models=_models(args.model_paths),
                   restart_policy=RestartPolicy(max_crashes=args.max_restarts,
                                                crash_window_s=args.restart_window_s))

    def flags_for(self, role: str) -> list[str]:
        """The command-line flags of this role's settings."""
        accepted = _role_settings()[role]
        return [flag for name, value in self.settings if name in accepted
                for flag in accepted[name].command_line(value)]


def _check_settings(settings: list[tuple[str, object]]) -> None:
    """Read every role's config as its processes will (these settings over the environment),
    so that a bad value fails here, naming its flag, before NATS and a dozen processes
    start only for one of them to exit with it; and check what no one process can: that
    workers heartbeat at least twice within the time after which they are taken for lost
    (else one late heartbeat fails their requests over)."""
    accepted = _role_settings()

    def read(role: str, config: type[C]) -> C:
        return load_config(config, env=os.environ, flags={
            name: value for name, value in settings if name in accepted[role]})

    worker = read("prefill", WorkerConfig)  # decode reads the same settings
    timeout_s = min(read("gateway", GatewayConfig).heartbeat_timeout_s,
                    read("conductor", ConductorConfig).heartbeat_timeout_s)
    if 2 * worker.heartbeat_interval_s > timeout_s:
        raise ConfigError(f"--heartbeat-interval-s {worker.heartbeat_interval_s} must be at "
                          f"most half of --heartbeat-timeout-s {timeout_s}: a worker is taken "
                          "for lost after that long without a heartbeat")


def _models(paths: list[str] | None) -> tuple[tuple[str, str | None], ...]:
    if not paths:
        return ((BUILTIN_MODEL_NAME, None),)
    models = tuple((Path(path).name, path) for path in paths)
    names = [name for name, _ in models]
    if len(set(names)) < len(names):
        raise ConfigError(f"two --model directories share a name ({', '.join(names)}): a "
                          "model is served under its directory's name")
    return models


class Cluster:
    """The child processes of `halfmoon up`, supervised: after start-up a child that exits
    unexpectedly is restarted (`supervisor.py`); before it, any exit fails the start."""

    def __init__(self, options: UpOptions, nats_url: str,
                 on_restart: Callable[[str], None] | None = None) -> None:
        self.options = options
        self.nats_url = nats_url
        self.supervisor = Supervisor(options.restart_policy, on_restart)
        # Workers authenticate each other's transfer engines with this; one per `up`, unless
        # the caller set their own.
        self.env = {**os.environ}
        self.env.setdefault("HALFMOON_TRANSFER_SECRET", secrets.token_hex(16))

    def spawn(self, role: str, *extra: str) -> None:
        command = [sys.executable, "-m", "services.cli", role, "--nats-url", self.nats_url,
                   "--cluster", self.options.cluster, *self.options.flags_for(role), *extra]
        self.supervisor.spawn(role, command, self.env)

    def start(self) -> None:
        self.spawn("conductor")
        for model in self.options.models:
            for _ in range(self.options.num_prefill):
                self.spawn("prefill", *_model_flags(*model))
            for _ in range(self.options.num_decode):
                self.spawn("decode", *_model_flags(*model))
        for i in range(self.options.num_gateways):
            self.spawn("gateway", "--host", self.options.host,
                       "--port", str(self.options.port + i), *_model_flags(*self.options.models[0]))

    def wait_ready(self, urls: list[str]) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if (child := self.supervisor.first_exited()) is not None:
                last = "\n".join(f"    {line}" for line in child.tail) or "    (no output)"
                code = child.process.returncode if child.process is not None else None
                raise ServiceStartFailed(f"{child.name} exited with {code} during start-up; "
                                         f"its last lines:\n{last}")
            if all(self._is_healthy(url) for url in urls):
                return
            time.sleep(0.1)
        raise ServiceStartFailed(f"not ready within {READY_TIMEOUT_S}s")

    def _is_healthy(self, url: str) -> bool:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as response:
                body = json.loads(response.read())
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError):
            return False  # not up yet; or not a gateway (its port taken): it exits, said above
        models = body.get("models", {})
        return body.get("status") == "ok" and all(
            models.get(name, {}).get("num_prefill_workers", 0) >= self.options.num_prefill
            and models.get(name, {}).get("num_decode_workers", 0) >= self.options.num_decode
            for name, _ in self.options.models)

    def stop(self) -> None:
        """Gateway first (no new requests), then workers and conductor."""
        self.supervisor.stop((("gateway",), ("prefill", "decode", "conductor")), STOP_TIMEOUT_S)


def _model_flags(name: str, path: str | None) -> list[str]:
    return ["--model", name, *(["--model-path", path] if path is not None else [])]


class LauncherMetrics:
    """The launcher's own Prometheus page: child restarts."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.restarts = Counter("halfmoon_process_restarts", "children of halfmoon up "
                                "restarted after exiting unexpectedly", ["service"],
                                registry=self.registry)

    def serve(self, host: str, port: int) -> str:
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return f"http://{host}:{server.server_port}/metrics"


def run_up(options: UpOptions) -> int:
    stop_signal: list[int] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop_signal.append(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    if options.is_builtin_model:
        from engine.builtin_model import ensure_builtin_model

        ensure_builtin_model()  # once here, not racing in every worker
    metrics = LauncherMetrics()
    nats = None if options.nats_url else EmbeddedNatsCluster(options.nats_cluster,
                                                            port=options.nats_port)
    nats_url = options.nats_url or nats.start()  # type: ignore[union-attr]
    cluster = Cluster(options, nats_url, lambda role: metrics.restarts.labels(role).inc())
    urls = [f"http://{options.host}:{options.port + i}" for i in range(options.num_gateways)]
    url = urls[0]
    try:
        cluster.start()
        cluster.wait_ready(urls)
        metrics_url = metrics.serve(options.host, options.metrics_port)
        more = f" and {len(urls) - 1} more on the next ports" if len(urls) > 1 else ""
        print(f"halfmoon is up: OpenAI API at {url}/v1{more} (NATS {redact(nats_url)}, "
              f"launcher metrics {metrics_url}); Ctrl-C stops it", flush=True)
        while not stop_signal:
            cluster.supervisor.poll()
            for node in nats.nodes if nats is not None else []:
                if not node.is_running():
                    # The services reconnect by themselves; the store (the request queue, KV
                    # events) survives the server's restart.
                    print(f"halfmoon: the embedded nats-server {node.name} exited; restarting "
                          "it on the same ports with its store", file=sys.stderr, flush=True)
                    node.restart()
                    metrics.restarts.labels("nats").inc()
            time.sleep(0.2)
        return 0
    except CrashLoop as exc:
        print(f"halfmoon: {exc.message}; stopping", file=sys.stderr, flush=True)
        return 1
    finally:
        cluster.stop()  # services first: they drain while NATS is still there
        if nats is not None:
            nats.stop()

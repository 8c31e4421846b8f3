"""`halfmoon up`: the whole system on one machine, each service its own OS process.

Order: NATS (embedded, unless `--nats` names a server) -> conductor -> prefill and decode
workers -> gateway; ready once the gateway's /health sees every worker. Ctrl-C or SIGTERM
stops the gateway first (no new requests), then workers and conductor, then NATS; children
that do not stop in time are killed, and children die with the launcher (PDEATHSIG).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from shared.errors import ServiceStartFailed
from shared.nats_server import EmbeddedNatsServer

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0


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
    service_flags: tuple[tuple[str, str], ...]  # (flag, value) passed on to services

    @property
    def is_builtin_model(self) -> bool:
        flags = dict(self.service_flags)
        return flags.get("--engine", "torch") == "torch" and "--model-path" not in flags

    @staticmethod
    def add_flags(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--nats", dest="nats_url", default=None,
                            help="use this NATS server instead of an embedded one")
        parser.add_argument("--nats-port", type=int, default=None,
                            help="port of the embedded NATS server (default: a free one)")
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
        parser.add_argument("--kv-streaming", default=None, choices=["layerwise", "whole"],
                            help="disaggregated: stream KV per layer (default) or after prefill")
        parser.add_argument("--cluster", default="default")
        parser.add_argument("--engine", default=None, choices=["torch", "fake", "sim"],
                            help="sim: a simulated accelerator (--sim-profile)")
        parser.add_argument("--sim-profile", default=None,
                            help="sim engine: model and device (default llama-3-8b-h200)")
        parser.add_argument("--sim-time-scale", default=None,
                            help="sim engine: wall seconds per simulated second")
        parser.add_argument("--max-batch-size", default=None, help="sequences per step")
        parser.add_argument("--max-batch-tokens", default=None,
                            help="prompt tokens per prefill step")
        parser.add_argument("--model", dest="model_path", default=None,
                            help="a Hugging Face model directory (default: the built-in model)")
        parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
        parser.add_argument("--api-key", default=None)
        parser.add_argument("--log-level", default=None)
        parser.add_argument("--fake-token-delay-s", default=None)
        parser.add_argument("--fake-prefill-delay-s", default=None)
        parser.add_argument("--fake-prefill-s-per-token", default=None)
        parser.add_argument("--num-blocks", default=None, help="KV blocks per worker")
        parser.add_argument("--max-model-len", default=None, help="context length in tokens")
        parser.add_argument("--policy", default=None,
                            choices=["least-loaded", "round-robin", "cache-aware", "seed",
                                     "longest-prefix"],
                            help="the conductor's prefill placement policy")
        parser.add_argument("--ttft-slo-ms", default=None,
                            help="reject requests whose predicted TTFT exceeds this")
        parser.add_argument("--tbt-slo-ms", default=None,
                            help="reject requests whose predicted decode step exceeds this")
        parser.add_argument("--tracing", default=None,
                            choices=["auto", "off", "otlp-grpc", "otlp-http"],
                            help="export spans over OTLP (auto: when OTEL_EXPORTER_OTLP_"
                                 "ENDPOINT is set)")
        parser.add_argument("--otlp-endpoint", default=None)
        parser.add_argument("--trace-sample-ratio", default=None)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> UpOptions:
        passthrough = ("engine", "api_key", "log_level", "fake_token_delay_s",
                       "fake_prefill_delay_s", "fake_prefill_s_per_token", "num_blocks",
                       "max_model_len", "model_path", "dtype", "local_prefill_max_tokens",
                       "kv_streaming", "policy", "ttft_slo_ms", "tbt_slo_ms", "tracing",
                       "otlp_endpoint", "trace_sample_ratio", "sim_profile", "sim_time_scale",
                       "max_batch_size", "max_batch_tokens")
        flags = [("--" + name.replace("_", "-"), str(getattr(args, name)))
                 for name in passthrough if getattr(args, name) is not None]
        if args.engine in ("fake", "sim"):
            flags.append(("--tokenizer", "bytes"))
        if args.model_path is not None:
            flags.append(("--model", Path(args.model_path).name))
        is_colocated = args.mode == "colocated"
        return cls(host=args.host, port=args.port, nats_url=args.nats_url,
                   nats_port=args.nats_port,
                   num_prefill=0 if is_colocated else args.num_prefill,
                   num_decode=args.num_workers if is_colocated else args.num_decode,
                   cluster=args.cluster, is_colocated=is_colocated,
                   service_flags=tuple(flags))


# Flags each service understands, out of UpOptions.service_flags.
_COMMON_FLAGS = {"--log-level", "--tracing", "--otlp-endpoint", "--trace-sample-ratio"}
_WORKER_FLAGS = _COMMON_FLAGS | {"--engine", "--fake-token-delay-s", "--fake-prefill-delay-s",
                 "--fake-prefill-s-per-token", "--num-blocks", "--max-model-len",
                 "--model-path", "--model", "--dtype", "--sim-profile", "--sim-time-scale",
                 "--max-batch-size", "--max-batch-tokens"}
_ACCEPTS = {
    "gateway": _COMMON_FLAGS | {"--api-key", "--model-path", "--model", "--tokenizer",
                                "--max-model-len"},
    "conductor": _COMMON_FLAGS | {"--policy", "--ttft-slo-ms", "--tbt-slo-ms"},
    "prefill": _WORKER_FLAGS | {"--kv-streaming"},
    "decode": _WORKER_FLAGS | {"--local-prefill-max-tokens"},
}
# A colocated worker prefills every prompt it could ever hold.
_COLOCATED = ("--local-prefill-max-tokens", str(1 << 30))


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM if the launcher dies (Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except OSError:
        pass


class Cluster:
    """The child processes of `halfmoon up`."""

    def __init__(self, options: UpOptions, nats_url: str) -> None:
        self.options = options
        self.nats_url = nats_url
        self.children: list[tuple[str, subprocess.Popen[bytes]]] = []
        # Workers authenticate each other's transfer engines with this; one per `up`, unless
        # the caller set their own.
        self.env = {**os.environ}
        self.env.setdefault("HALFMOON_TRANSFER_SECRET", secrets.token_hex(16))

    def spawn(self, role: str, *extra: str) -> None:
        own = [part for flag, value in self.options.service_flags
               if flag in _ACCEPTS[role] for part in (flag, value)]
        command = [sys.executable, "-m", "services.cli", role, "--nats-url", self.nats_url,
                   "--cluster", self.options.cluster, *own, *extra]
        process = subprocess.Popen(command, preexec_fn=_die_with_parent, env=self.env)
        self.children.append((role, process))

    def start(self) -> None:
        self.spawn("conductor")
        for _ in range(self.options.num_prefill):
            self.spawn("prefill")
        for _ in range(self.options.num_decode):
            self.spawn("decode", *(_COLOCATED if self.options.is_colocated else ()))
        self.spawn("gateway", "--host", self.options.host, "--port", str(self.options.port))

    def failed_child(self) -> str | None:
        for role, process in self.children:
            if process.poll() is not None:
                return f"{role} (pid {process.pid}) exited with {process.returncode}"
        return None

    def wait_ready(self, url: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if (failure := self.failed_child()) is not None:
                raise ServiceStartFailed(f"{failure} during start-up")
            if self._is_healthy(url):
                return
            time.sleep(0.1)
        raise ServiceStartFailed(f"not ready within {READY_TIMEOUT_S}s")

    def _is_healthy(self, url: str) -> bool:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as response:
                body = json.loads(response.read())
        except (urllib.error.URLError, OSError, ValueError):
            return False
        return (body.get("status") == "ok"
                and body.get("num_prefill_workers", 0) >= self.options.num_prefill
                and body.get("num_decode_workers", 0) >= self.options.num_decode)

    def stop(self) -> None:
        """Gateway first, then the rest; kill what outlives STOP_TIMEOUT_S."""
        for group in (("gateway",), ("prefill", "decode", "conductor")):
            members = [p for role, p in self.children if role in group and p.poll() is None]
            for process in members:
                process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for process in members:
                try:
                    process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def run_up(options: UpOptions) -> int:
    stop_signal: list[int] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop_signal.append(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    if options.is_builtin_model:
        from engine.builtin_model import ensure_builtin_model

        ensure_builtin_model()  # once here, not racing in every worker
    server = None if options.nats_url else EmbeddedNatsServer(port=options.nats_port)
    nats_url = options.nats_url or server.start()  # type: ignore[union-attr]
    cluster = Cluster(options, nats_url)
    url = f"http://{options.host}:{options.port}"
    try:
        cluster.start()
        cluster.wait_ready(url)
        print(f"halfmoon is up: OpenAI API at {url}/v1 (NATS {nats_url}); Ctrl-C stops it",
              flush=True)
        while not stop_signal:
            if (failure := cluster.failed_child()) is not None:
                print(f"halfmoon: {failure}; stopping", file=sys.stderr, flush=True)
                return 1
            time.sleep(0.2)
        return 0
    finally:
        cluster.stop()
        if server is not None:
            server.stop()

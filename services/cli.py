"""The `halfmoon` command line.

    halfmoon up                      embedded NATS + conductor + prefill + decode + gateway
    halfmoon gateway|conductor|worker --nats-url URL ...   one service per process
    halfmoon prefill|decode ...      a worker starting in that role (worker --role ...)
    halfmoon workers [--json]        every live worker: role, model, load, state
    halfmoon assign WORKER --role R [--model M]   move one worker by hand (a RoleChange)
    halfmoon bench serve --url URL ...        load-test an OpenAI-compatible server
    halfmoon bench compare ...                colocated against disaggregated serving
    halfmoon bench transfer [--max-mib N]     transfer-engine benchmark (two processes)
    halfmoon schema [--out docs/contract]     the NATS contract: JSON Schemas + AsyncAPI
    halfmoon settings [--out FILE]            every service setting, as a Markdown reference
    halfmoon nats-auth --out DIR              NATS users for each role: nkeys + users.conf

Every service flag is also an environment variable `HALFMOON_<FLAG>` and a key of the TOML
file given with `--config`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

import uvloop

from services.launcher import UpOptions, run_up
from services.operator_commands import assign_worker, list_workers
from shared import tracing
from shared.config import ConductorConfig, GatewayConfig, ServiceConfig, WorkerConfig
from shared.config_loading import add_config_flags, load_config
from shared.errors import ConfigError, ServiceStartFailed
from shared.logs import configure_logging
from shared.model_dir import resolve_model_dir
from shared.process_limits import raise_open_files_limit
from shared.service import Service
from shared.subjects import Subjects


def _build_gateway(config: ServiceConfig) -> Service:
    from services.gateway.service import GatewayService

    return GatewayService(config)  # type: ignore[arg-type]


def _build_conductor(config: ServiceConfig) -> Service:
    from services.conductor.service import ConductorService

    return ConductorService(config)  # type: ignore[arg-type]


def _build_worker(config: ServiceConfig) -> Service:
    from services.worker import WorkerService

    return WorkerService(config)  # type: ignore[arg-type]


def _build_prefill(config: ServiceConfig) -> Service:
    from services.worker import PrefillService

    return PrefillService(config)  # type: ignore[arg-type]


def _build_decode(config: ServiceConfig) -> Service:
    from services.worker import DecodeService

    return DecodeService(config)  # type: ignore[arg-type]


SERVICES: dict[str, tuple[type[ServiceConfig], Callable[[ServiceConfig], Service]]] = {
    "gateway": (GatewayConfig, _build_gateway),
    "conductor": (ConductorConfig, _build_conductor),
    "worker": (WorkerConfig, _build_worker),
    "prefill": (WorkerConfig, _build_prefill),  # shorthands: a worker starting in that role
    "decode": (WorkerConfig, _build_decode),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="halfmoon", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="run the whole system on this machine")
    UpOptions.add_flags(up)
    for name, (config_type, _) in SERVICES.items():
        add_config_flags(commands.add_parser(name, help=f"run one {name}"), config_type)
    model = commands.add_parser("model", help="model tools").add_subparsers(
        dest="model_command", required=True)
    init = model.add_parser("init", help="write the built-in tiny model to a directory")
    init.add_argument("directory", nargs="?", default=None,
                      help="default: the built-in model's cache directory")
    init.add_argument("--force", action="store_true", help="overwrite an existing model")
    schema = commands.add_parser("schema", help="write the NATS contract: JSON Schemas and "
                                 "an AsyncAPI document")
    schema.add_argument("--out", default="docs/contract", help="default: docs/contract")
    settings = commands.add_parser("settings", help="every service setting (flag, environment "
                                   "variable, default, what it does) as Markdown")
    settings.add_argument("--out", default=None,
                          help="write it to this file (docs/settings.md is the published "
                          "copy; default: print it)")
    auth = commands.add_parser("nats-auth", help="write least-privilege NATS users, one "
                               "nkey per service role and per gateway, and the nats-server "
                               "authorization block naming them")
    auth.add_argument("--out", required=True, help="directory for users.conf and <user>.nk")
    auth.add_argument("--cluster", default="default", help="the halfmoon cluster name "
                      "(default: default)")
    auth.add_argument("--gateways", type=int, default=2,
                      help="gateway users gateway-0..N-1, each reading only its own tokens "
                      "(default: 2)")
    assign = commands.add_parser("assign", help="tell one worker to serve another role (or "
                                 "model): the RoleChange a planner sends, by hand")
    assign.add_argument("worker_id")
    assign.add_argument("--role", required=True, choices=["prefill", "decode"])
    assign.add_argument("--model", dest="to_model", default="",
                        help="a model on the worker's disk to load (default: keep its model)")
    assign.add_argument("--reason", default="by hand")
    add_config_flags(assign, ServiceConfig)
    workers = commands.add_parser("workers", help="list every live worker: role, model, "
                                  "load, state (from the cluster's worker registry)")
    workers.add_argument("--json", action="store_true",
                         help="each worker's latest heartbeat, one JSON object a line")
    add_config_flags(workers, ServiceConfig)
    bench = commands.add_parser("bench", help="benchmarks (bench serve --help)")
    bench.add_argument("target", choices=sorted(benchmarks()), help="what to measure")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER,
                       help="options of that benchmark")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "up":
            return run_up(UpOptions.from_args(args))
        if args.command == "model":
            return init_model(args.directory, is_forced=args.force)
        if args.command == "schema":
            return write_schema(Path(args.out))
        if args.command == "settings":
            return write_settings(args.out)
        if args.command == "nats-auth":
            return write_nats_auth(Path(args.out), args.cluster, args.gateways)
        if args.command == "bench":
            return run_benchmark(args.target, args.bench_args)
        if args.command == "assign":
            return assign_worker(args)
        if args.command == "workers":
            return list_workers(args)
        return run_service(args.command, vars(args))
    except ConfigError as exc:
        print(f"halfmoon: {exc.message}", file=sys.stderr)
        return 2
    except ServiceStartFailed as exc:
        print(f"halfmoon: {exc.message}", file=sys.stderr)
        return 1


BENCHMARK_GROUP = "halfmoon.bench"


def benchmarks() -> dict[str, EntryPoint]:
    """The `halfmoon bench` subcommands: entry points of group `halfmoon.bench`."""
    return {entry.name: entry for entry in entry_points(group=BENCHMARK_GROUP)}


def run_benchmark(target: str, argv: list[str]) -> int:
    raise_open_files_limit()  # a benchmark's clients hold a connection each
    main: Callable[[list[str]], int | None] = benchmarks()[target].load()
    return main(argv) or 0


def write_schema(out_dir: Path) -> int:
    from shared.contract import write_contract

    written = write_contract(out_dir)
    print(f"wrote {len(written)} files under {out_dir}")
    return 0


def write_settings(out: str | None) -> int:
    from shared.config_reference import render_reference

    if out is None:
        print(render_reference(), end="")
    else:
        Path(out).write_text(render_reference())
        print(f"wrote {out}")
    return 0


def write_nats_auth(out_dir: Path, cluster: str, num_gateways: int) -> int:
    from shared.nats_auth import write_nkey_users

    if num_gateways < 1:
        raise ConfigError(f"--gateways must be at least 1, not {num_gateways}")
    written = write_nkey_users(out_dir, Subjects(cluster),
                               [f"gateway-{i}" for i in range(num_gateways)])
    print(f"wrote {', '.join(path.name for path in written)} under {out_dir} (the .nk files "
          "are secrets: one per service identity)")
    return 0


def init_model(directory: str | None, *, is_forced: bool) -> int:
    from engine.builtin_model import write_builtin_model

    path = resolve_model_dir(directory)
    if (path / "config.json").exists() and not is_forced:
        print(f"halfmoon: a model already exists at {path} (--force overwrites it)",
              file=sys.stderr)
        return 1
    write_builtin_model(path)
    print(f"wrote the built-in model to {path}")
    return 0


async def _serve(service: Service) -> None:
    if isinstance(service.config, WorkerConfig):  # it may reload in place as another model
        from services.model_shelf import WorkerRunner

        await WorkerRunner(service).run()
    else:
        await service.run()


def run_service(name: str, flags: dict[str, object]) -> int:
    config_type, build = SERVICES[name]
    if name in ("prefill", "decode") and flags.get("role") not in (None, name):
        raise ConfigError(f"`halfmoon {name}` starts a {name} worker; for another role run "
                          f"`halfmoon worker --role {flags['role']}`")
    config = load_config(config_type, flags=flags, env=os.environ,
                         toml_path=flags.get("config_path"))  # type: ignore[arg-type]
    configure_logging(config.log_level, config.log_format)
    raise_open_files_limit()
    service = build(config)
    tracing.configure_tracing(name, service.instance_id, mode=config.tracing,
                              endpoint=config.otlp_endpoint,
                              sample_ratio=config.trace_sample_ratio, tracer=config.tracer)
    try:
        uvloop.run(_serve(service))
    finally:
        tracing.shutdown()  # flush the spans still batched
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The operator's commands against a running cluster, over its NATS: `halfmoon workers`
lists every live worker from the registry; `halfmoon assign` sends one a `RoleChange` by
hand. Under NATS auth they connect with a user that may read the worker registry
(`workers`: the gateway's or conductor's) or publish role changes (`assign`: the
conductor's)."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec

from services.conductor.planner import kv_used_share
from services.conductor.planning import COMMAND_TIMEOUT_S
from shared.config import ServiceConfig
from shared.config_loading import load_config
from shared.jetstream_assets import read_registry
from shared.messages import DispatchReply, RoleChange, WorkerHeartbeat
from shared.nats_client import NatsClient, connect, dispatch
from shared.subjects import Subjects

T = TypeVar("T")


def _against_cluster(args: argparse.Namespace, client_name: str,
                     action: Callable[[NatsClient, Subjects], Awaitable[T]]) -> T:
    config = load_config(ServiceConfig, flags=vars(args), env=os.environ,
                         toml_path=args.config_path)

    async def run() -> T:
        nc = await connect(config.nats_url, client_name, config.connect_timeout_s,
                           auth=config.nats)
        try:
            return await action(nc, Subjects(config.cluster))
        finally:
            await nc.close()

    return asyncio.run(run())


def assign_worker(args: argparse.Namespace) -> int:
    command = RoleChange(role=args.role, model=args.to_model, reason=args.reason,
                         requested_by=f"halfmoon assign ({getpass.getuser()})")

    async def send(nc: NatsClient, subjects: Subjects) -> DispatchReply:
        return await dispatch(nc, subjects.role_change(args.worker_id), command,
                              COMMAND_TIMEOUT_S)

    reply = _against_cluster(args, "halfmoon-assign", send)
    if not reply.is_accepted:
        print(f"halfmoon: {args.worker_id} refused: {reply.reason}", file=sys.stderr)
        return 1
    print(f"{args.worker_id} serves {args.to_model or 'its model'} as {args.role} "
          f"({'once it has finished and reloaded' if args.to_model else 'now'})")
    return 0


def list_workers(args: argparse.Namespace) -> int:
    async def read(nc: NatsClient, subjects: Subjects) -> list[WorkerHeartbeat]:
        return await read_registry(nc.jetstream(), subjects.workers_bucket)

    workers = sorted(_against_cluster(args, "halfmoon-workers", read),
                     key=lambda w: (w.model, w.role, w.worker_id))
    if args.json:
        for worker in workers:
            print(msgspec.json.encode(worker).decode())
    else:
        print(workers_table(workers, time.time()))
    return 0


def workers_table(workers: list[WorkerHeartbeat], now_s: float) -> str:
    """One line a worker: who, what it serves, its load, and what it is doing."""
    rows = [("WORKER", "ROLE", "MODEL", "HOST", "RUNNING", "WAITING", "KV USED", "SEEN",
             "STATE")]
    for w in workers:
        rows.append((w.worker_id, w.role, w.model, w.host, str(w.num_running),
                     str(w.num_waiting), f"{100 * kv_used_share(w):.0f} %",
                     f"{max(0.0, now_s - w.sent_at_s):.1f} s ago", _state(w)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
             .rstrip() for row in rows]
    if not workers:
        lines.append("(no live worker)")
    return "\n".join(lines)


def _state(worker: WorkerHeartbeat) -> str:
    if worker.loading_model:
        return f"loading {worker.loading_model} as {worker.loading_role}"
    state = "draining" if worker.is_draining else "serving"
    if worker.home_role is not None and worker.home_role != worker.role:
        state += f" (home: {worker.home_role})"
    return state

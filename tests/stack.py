"""A whole halfmoon stack in this process, on a real NATS server, for tests and benchmarks."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from services.conductor.service import ConductorService
from services.gateway.service import GatewayService
from services.worker import DecodeService, PrefillService
from shared.config import ConductorConfig, GatewayConfig, WorkerConfig
from shared.config_loading import load_config
from shared.service import Service


async def eventually(is_true: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait until `is_true()` holds; TimeoutError after `timeout_s`."""
    async with asyncio.timeout(timeout_s):
        while not is_true():  # noqa: ASYNC110 - polls state owned by other tasks
            await asyncio.sleep(0.01)


@dataclass
class Stack:
    nats_url: str
    num_prefill: int = 1
    num_decode: int = 1
    worker: dict[str, Any] = field(default_factory=dict)
    gateway_options: dict[str, Any] = field(default_factory=dict)
    conductor_options: dict[str, Any] = field(default_factory=dict)
    # Worker settings of one role only, over `worker`.
    prefill_options: dict[str, Any] = field(default_factory=dict)
    decode_options: dict[str, Any] = field(default_factory=dict)
    cluster: str = field(default_factory=lambda: f"t{uuid.uuid4().hex[:10]}")

    def __post_init__(self) -> None:
        common = self._common()
        worker = self.worker_config(**self.decode_options)
        self.conductor = ConductorService(ConductorConfig(
            **common, **{"heartbeat_timeout_s": 1.0, **self.conductor_options}))
        prefill = self.worker_config(**self.prefill_options)
        self.prefills = [PrefillService(prefill) for _ in range(self.num_prefill)]
        self.decodes = [DecodeService(worker) for _ in range(self.num_decode)]
        tokenizer = "bytes" if worker.engine.kind in ("fake", "sim") else "model"
        self.gateway = GatewayService(GatewayConfig(
            **common, port=0, **{"tokenizer": tokenizer, "heartbeat_timeout_s": 1.0,
                                 **self.gateway_options}))

    def _common(self) -> dict[str, Any]:
        return {"nats_url": self.nats_url, "cluster": self.cluster, "log_level": "warning",
                "drain_timeout_s": 5.0}

    def worker_config(self, **options: Any) -> WorkerConfig:
        """A worker of this stack: `worker`'s settings, then `options`."""
        return load_config(WorkerConfig, flags={
            **self._common(), "heartbeat_interval_s": 0.2, "engine": "fake",
            "transfer_secret": "stack-secret", **self.worker, **options})

    @property
    def services(self) -> list[Service]:
        return [self.conductor, *self.prefills, *self.decodes, self.gateway]

    @property
    def base_url(self) -> str:
        return f"{self.gateway.url}/v1"

    async def start(self) -> Stack:
        for service in self.services:
            await service.start()
        await self.wait_healthy()
        return self

    async def wait_healthy(self, timeout_s: float = 10.0) -> None:
        def ready() -> bool:
            live_p = self.conductor.workers.healthy("prefill")
            live_d = self.conductor.workers.healthy("decode")
            health = self.gateway.health()
            return (len(live_p) >= self.num_prefill and len(live_d) >= self.num_decode
                    and health["status"] == "ok")

        await eventually(ready, timeout_s)

    async def stop(self) -> None:
        for service in reversed(self.services):
            await service.stop()

    async def __aenter__(self) -> Stack:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def num_free_decode_blocks(self) -> int:
        return sum(d.engine.stats().num_free_blocks for d in self.decodes)

    async def wait_blocks_free(self, timeout_s: float = 5.0) -> None:
        """Wait until every decode block is free again (or fail)."""
        workers = [*self.prefills, *self.decodes]
        await eventually(lambda: all(
            w.engine.stats().num_free_blocks == w.engine.stats().num_total_blocks
            for w in workers), timeout_s)

    async def post(self, path: str, body: Any, headers: dict[str, str] | None = None
                   ) -> tuple[int, Any]:
        async with aiohttp.ClientSession() as session, session.post(
            f"{self.gateway.url}{path}", json=body, headers=headers
        ) as response:
            return response.status, await response.json(content_type=None)


PATHS = ("disaggregated", "colocated")


def torch_stack_on(path: str, nats_url: str, model_dir: str, *,
                   conductor: dict[str, Any] | None = None,
                   gateway: dict[str, Any] | None = None, **worker: Any) -> Stack:
    """A stack on the torch engine serving by one path: `disaggregated` (a prefill and a
    decode worker) or `colocated` (one decode worker that prefills for itself)."""
    options = {"engine": "torch", "model_path": model_dir, "num_blocks": 256, **worker}
    common = {"gateway_options": {"model_path": model_dir, **(gateway or {})},
              "conductor_options": conductor or {}}
    if path == "colocated":
        return Stack(nats_url, num_prefill=0, worker={**options,
                                                      "local_prefill_max_tokens": 1 << 30},
                     **common)
    return Stack(nats_url, worker=options, **common)

"""Failover with real OS processes: SIGKILL the decode worker serving a stream."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import msgspec
import nats
import openai
import pytest

from engine.builtin_model import write_builtin_model
from services.gateway.tokenizer import HfTokenizer
from shared.messages import DecodeReservation
from shared.subjects import Subjects
from tests.integration.test_cli import free_port
from tests.integration.test_torch_stack import reference_tokens

pytestmark = pytest.mark.e2e

MODEL = "halfmoon-tiny"
CLUSTER = "sigkill"


def start(role: str, nats_url: str, model_dir: Path | None, *extra: str
          ) -> subprocess.Popen[bytes]:
    model = ["--model-path", str(model_dir)] if model_dir is not None else []
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", role, "--nats-url", nats_url,
         "--cluster", CLUSTER, "--log-level", "warning", *model, *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def wait_healthy(url: str, num_decode: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as response:
                body = json.loads(response.read())
                if body["status"] == "ok" and body["num_decode_workers"] >= num_decode:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError("stack not healthy")


async def test_sigkilled_decode_worker_is_replaced_mid_stream(
    nats_url: str, tmp_path: Path,
) -> None:
    model_dir = write_builtin_model(tmp_path / "tiny")
    tokenizer = HfTokenizer(model_dir)
    prompt = "The oldest star said: you already shine."
    expected = tokenizer.decode(await reference_tokens(model_dir, tokenizer.encode(prompt), 500))
    port = free_port()
    fast = ("--heartbeat-interval-s", "0.2")
    decodes = {f"d{i}": start("decode", nats_url, model_dir, "--worker-id", f"d{i}", *fast)
               for i in (1, 2)}
    others = [start("conductor", nats_url, None, "--heartbeat-timeout-s", "1.0"),
              start("prefill", nats_url, model_dir, *fast),
              start("gateway", nats_url, model_dir, "--port", str(port),
                    "--heartbeat-timeout-s", "1.0")]
    observer = await nats.connect(nats_url)
    reserved: list[str] = []
    decoder = msgspec.json.Decoder(DecodeReservation)
    subjects = Subjects(CLUSTER)
    for worker_id in decodes:
        async def seen(msg, worker_id=worker_id) -> None:  # type: ignore[no-untyped-def]
            decoder.decode(msg.data)
            reserved.append(worker_id)

        await observer.subscribe(subjects.decode_reserve(worker_id), cb=seen)
    try:
        await asyncio.to_thread(wait_healthy, f"http://127.0.0.1:{port}", 2)
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                                      max_retries=0) as sdk:
            stream = await sdk.completions.create(
                model=MODEL, prompt=prompt, max_tokens=500, temperature=0.0, stream=True,
                stream_options={"include_usage": True})
            texts, usage = [], None
            async for chunk in stream:
                texts += [c.text for c in chunk.choices]
                usage = chunk.usage or usage
                if len(texts) == 30:
                    decodes[reserved[0]].send_signal(signal.SIGKILL)
        assert "".join(texts) == expected
        assert usage is not None and usage.completion_tokens == 500
        assert reserved[1] != reserved[0]  # the continuation went to the survivor
    finally:
        await observer.close()
        for process in [*decodes.values(), *others]:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in [*decodes.values(), *others]:
            process.wait(timeout=30)

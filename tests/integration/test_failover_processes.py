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
import nats.js.errors
import openai
import pytest

from engine.builtin_model import write_builtin_model
from services.conductor.intake import ACK_WAIT_S
from services.gateway.tokenizer import HfTokenizer
from shared.config import ConductorConfig
from shared.messages import DecodeReservation
from shared.nats_client import subscribed
from shared.subjects import Subjects
from tests.integration.test_cli import free_port
from tests.integration.test_torch_stack import reference_tokens

pytestmark = pytest.mark.e2e

MODEL = "halfmoon-tiny"
CLUSTER = "sigkill"


def start(role: str, nats_url: str, model_dir: Path | None, *extra: str,
          cluster: str = CLUSTER) -> subprocess.Popen[bytes]:
    model = ["--model-path", str(model_dir)] if model_dir is not None else []
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", role, "--nats-url", nats_url,
         "--cluster", cluster, "--log-level", "warning", *model, *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "HALFMOON_TRANSFER_SECRET": "sigkill"},
    )


def stop_all(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        process.wait(timeout=30)


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


async def greedy_text(model_dir: Path, prompt: str, num_tokens: int) -> str:
    """The model's greedy continuation of `prompt`, computed in this process."""
    tokenizer = HfTokenizer(model_dir)
    return tokenizer.decode(await reference_tokens(model_dir, tokenizer.encode(prompt),
                                                   num_tokens))


async def test_sigkilled_decode_worker_is_replaced_mid_stream(
    nats_url: str, tmp_path: Path,
) -> None:
    model_dir = write_builtin_model(tmp_path / "tiny")
    prompt = "The oldest star said: you already shine."
    expected = await greedy_text(model_dir, prompt, 500)
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
    await subscribed(observer)
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
        stop_all([*decodes.values(), *others])


async def both_conductors_pulling(nats_url: str, subjects: Subjects,
                                  timeout_s: float = 30.0) -> None:
    """Wait until the conductors' consumer has every pull of both replicas waiting (a
    healthy gateway says nothing of conductors: one may still be starting)."""
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        async with asyncio.timeout(timeout_s):
            while True:
                try:
                    info = await js.consumer_info(subjects.requests_stream,
                                                  subjects.conductor_consumer)
                    if (info.num_waiting or 0) >= 2 * ConductorConfig().num_fetchers:
                        return
                except nats.js.errors.NotFoundError:
                    pass  # not made yet
                await asyncio.sleep(0.05)
    finally:
        await nc.close()


async def test_sigkilled_conductor_loses_no_request(nats_url: str) -> None:
    """Requests a conductor had fetched but not acknowledged when it died are redelivered by
    JetStream (after ack_wait) to the surviving replica; every client gets its whole answer."""
    def start_fake(role: str, *extra: str) -> subprocess.Popen[bytes]:
        engine = ("--engine", "fake") if role in ("prefill", "decode") else ()
        return start(role, nats_url, None, *engine, *extra, cluster="sigkill-conductor")

    port = free_port()
    doomed, survivor = (start_fake("conductor", "--heartbeat-timeout-s", "1.0")
                        for _ in range(2))
    others = [start_fake("prefill"), start_fake("decode", "--fake-token-delay-s", "0.01"),
              start_fake("gateway", "--port", str(port), "--tokenizer", "bytes")]
    processes = [doomed, survivor, *others]
    try:
        await asyncio.to_thread(wait_healthy, f"http://127.0.0.1:{port}", 1)
        await both_conductors_pulling(nats_url, Subjects("sigkill-conductor"))
        doomed.send_signal(signal.SIGSTOP)  # its open pulls still take requests ...
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                                      max_retries=0, timeout=60) as sdk:
            async def ask(i: int) -> tuple[str, float]:
                started = time.monotonic()
                response = await sdk.completions.create(model=MODEL, prompt=f"req {i}",
                                                        max_tokens=5, temperature=0.0)
                assert response.usage is not None
                assert response.usage.completion_tokens == 5
                return response.choices[0].text, time.monotonic() - started

            asking = asyncio.gather(*(ask(i) for i in range(12)))
            await asyncio.sleep(1.0)
            doomed.send_signal(signal.SIGKILL)  # ... and dies holding them, unacknowledged
            first = await asyncio.wait_for(asking, 60)
            again = await asyncio.gather(*(ask(i) for i in range(12)))
        assert [text for text, _ in first] == [text for text, _ in again]  # none lost or doubled
        # The dead replica really held some: those waited out the consumer's ack_wait (5 s)
        # before JetStream gave them to the survivor.
        assert max(seconds for _, seconds in first) >= ACK_WAIT_S - 1.0
        assert min(seconds for _, seconds in again) < ACK_WAIT_S - 1.0
    finally:
        stop_all(processes)


async def test_a_decode_worker_back_under_its_id_at_once_is_failed_over_not_waited_for(
    nats_url: str, tmp_path: Path,
) -> None:
    """SIGKILL the only decode worker (a fixed `--worker-id`) mid-stream and start it again
    at once: its heartbeats barely pause, so it never looks dead (heartbeat timeout 10 s
    here), but its heartbeat's later start says what it held is gone; the gateway places
    the rest of the stream again on the new process. Before, the stream stalled until the
    request timed out."""
    model_dir = write_builtin_model(tmp_path / "tiny")
    prompt = "The harbour kept its lights on all night."
    expected = await greedy_text(model_dir, prompt, 300)
    port = free_port()
    cluster = ("--heartbeat-timeout-s", "10")
    decode_args = ("--worker-id", "d-fixed", "--heartbeat-interval-s", "0.2")
    decode = start("decode", nats_url, model_dir, *decode_args, cluster="restart-same-id")
    others = [start("conductor", nats_url, None, *cluster, cluster="restart-same-id"),
              start("prefill", nats_url, model_dir, "--heartbeat-interval-s", "0.2",
                    cluster="restart-same-id"),
              start("gateway", nats_url, model_dir, "--port", str(port), *cluster,
                    "--request-timeout-s", "30", cluster="restart-same-id")]
    restarted: subprocess.Popen[bytes] | None = None
    try:
        await asyncio.to_thread(wait_healthy, f"http://127.0.0.1:{port}", 1)
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                                      max_retries=0, timeout=60) as sdk:
            started = time.monotonic()
            stream = await sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=300,
                                                  temperature=0.0, stream=True)
            texts = []
            async for chunk in stream:
                texts += [c.text for c in chunk.choices]
                if len(texts) == 30:
                    decode.send_signal(signal.SIGKILL)
                    decode.wait(timeout=10)
                    restarted = start("decode", nats_url, model_dir, *decode_args,
                                      cluster="restart-same-id")
        assert "".join(texts) == expected
        assert time.monotonic() - started < 25  # not the request timeout (30 s)
    finally:
        stop_all([p for p in (decode, restarted, *others) if p is not None])

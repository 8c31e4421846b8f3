"""Each service raises its soft limit on open files toward the hard one: a gateway started
with a low soft limit (Linux's usual 1,024; 128 here) serves more client connections at
once than that limit, where clients past it had their connections reset."""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import subprocess
import sys
from collections import Counter

import aiohttp
import pytest

from tests.integration.test_cli import free_port, wait_for_line

pytestmark = pytest.mark.e2e

MODEL = "halfmoon-tiny"
LOW_SOFT_LIMIT = 128
NUM_CLIENTS = 300


def _low_soft_limit() -> None:  # in the child, before it runs halfmoon
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (LOW_SOFT_LIMIT, hard))


def test_raising_takes_the_soft_limit_to_the_hard_one_and_never_lowers_it() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    script = ("import resource; from shared.process_limits import raise_open_files_limit; "
              "now = raise_open_files_limit(); again = raise_open_files_limit(wanted=16); "
              "print(now, again, resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True, preexec_fn=_low_soft_limit)
    expected = 65536 if hard == resource.RLIM_INFINITY else min(65536, hard)
    assert done.stdout.split() == [str(expected)] * 3


async def _stream(session: aiohttp.ClientSession, url: str, index: int) -> str:
    try:
        async with session.post(f"{url}/v1/completions", json={
                "model": MODEL, "prompt": f"client {index}", "max_tokens": 16,
                "stream": True}) as response:
            await response.read()
            return str(response.status)
    except aiohttp.ClientError as exc:
        return type(exc).__name__


async def _all_at_once(url: str) -> Counter[str]:
    connector = aiohttp.TCPConnector(limit=0)  # every client its own connection
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        return Counter(await asyncio.gather(*(_stream(session, url, i)
                                              for i in range(NUM_CLIENTS))))


def test_a_gateway_started_with_a_low_soft_limit_serves_more_clients_than_it() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2 * NUM_CLIENTS:
        pytest.skip(f"the hard limit on open files ({hard}) leaves no room to raise")
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--port", str(port), "--engine", "fake"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=_low_soft_limit)
    try:
        wait_for_line(process, "halfmoon is up", timeout_s=60)
        outcomes = asyncio.run(_all_at_once(f"http://127.0.0.1:{port}"))
    finally:
        os.killpg(process.pid, signal.SIGINT)
        process.wait(timeout=60)
    assert outcomes == {"200": NUM_CLIENTS}

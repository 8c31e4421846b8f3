"""`halfmoon up` supervises its children: a crashed one is restarted while the others serve, a
crash loop stops everything with the process's last lines, and Ctrl-C stops cleanly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.integration.test_cli import children_of, free_port, is_alive, wait_for_line

pytestmark = pytest.mark.e2e

MODEL = "halfmoon-tiny"


def up(*args: str) -> subprocess.Popen[str]:
    """`halfmoon up` in a session of its own (as a terminal would run it), stderr kept."""
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--engine", "fake", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})


def pids_of(launcher: int, role: str) -> list[int]:
    found = []
    for pid in children_of(launcher):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if b"services.cli" in command and command[command.index(b"services.cli") + 1] \
                == role.encode():
            found.append(pid)
    return found


def wait_until(condition, timeout_s: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def complete(port: int) -> int:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    done = client.completions.create(model=MODEL, prompt="hi", max_tokens=5)
    assert done.usage is not None
    return done.usage.completion_tokens


def test_a_killed_worker_is_restarted_and_counted_while_the_rest_serve() -> None:
    port = free_port()
    process = up("--port", str(port), "--decode", "2")
    try:
        line = wait_for_line(process, "halfmoon is up", 60)
        metrics_url = re.search(r"launcher metrics (\S+)\)", line).group(1)  # type: ignore[union-attr]
        first, _ = pids_of(process.pid, "decode")
        os.kill(first, signal.SIGKILL)
        assert complete(port) == 5  # the other decode worker serves meanwhile
        wait_until(lambda: len(pids_of(process.pid, "decode")) == 2, 30)
        assert first not in pids_of(process.pid, "decode")
        assert process.poll() is None
        with urllib.request.urlopen(metrics_url, timeout=5) as response:
            page = response.read().decode()
        assert 'halfmoon_process_restarts_total{service="decode"} 1.0' in page
        assert complete(port) == 5
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


def test_a_crash_loop_stops_everything_and_names_the_process() -> None:
    port = free_port()
    process = up("--port", str(port), "--max-restarts", "2", "--restart-window-s", "60")
    try:
        wait_for_line(process, "halfmoon is up", 60)
        children = children_of(process.pid)
        for _ in range(2):
            wait_until(lambda: len(pids_of(process.pid, "prefill")) == 1, 30)
            os.kill(pids_of(process.pid, "prefill")[0], signal.SIGKILL)
            time.sleep(0.3)
        assert process.wait(timeout=60) == 1
        _, stderr = process.communicate(timeout=10)
        assert re.search(r"prefill \(pid \d+\) exited with -9, its 2th crash", stderr)
        assert "its last lines:" in stderr
        wait_until(lambda: not any(is_alive(pid) for pid in children), 30)
    finally:
        if process.poll() is None:
            process.kill()


def test_ctrl_c_stops_services_before_nats_with_no_error_lines() -> None:
    port = free_port()
    process = up("--port", str(port), "--log-format", "json")
    wait_for_line(process, "halfmoon is up", 60)
    children = children_of(process.pid)
    assert complete(port) == 5
    os.killpg(process.pid, signal.SIGINT)  # the terminal's Ctrl-C: the launcher's group
    assert process.wait(timeout=60) == 0
    _, stderr = process.communicate(timeout=10)
    assert '"level": "error"' not in stderr and '"level":"error"' not in stderr, stderr[-3000:]
    wait_until(lambda: not any(is_alive(pid) for pid in children), 30)

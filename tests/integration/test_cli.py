"""The `halfmoon` command: the whole system as separate OS processes."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from shared.nats_server import free_port

pytestmark = pytest.mark.e2e

MODEL = "halfmoon-tiny"


def children_of(pid: int) -> set[int]:
    """All descendants of `pid`, from /proc."""
    found: set[int] = set()
    frontier = [pid]
    while frontier:
        current = frontier.pop()
        for task in Path(f"/proc/{current}/task").glob("*"):
            text = (task / "children").read_text() if (task / "children").exists() else ""
            for child in map(int, text.split()):
                if child not in found:
                    found.add(child)
                    frontier.append(child)
    return found


def is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def wait_for_line(process: subprocess.Popen[str], needle: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    assert process.stdout is not None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if needle in line:
            return line
        if not line and process.poll() is not None:
            break
    raise AssertionError(f"no line with {needle!r}; exit code {process.poll()}")


# Every requested token: sampled from random weights, an EOS may come before max_tokens.
WHOLE = {"ignore_eos": True}


def halfmoon(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", *args], stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def test_up_serves_openai_and_sigterm_leaves_no_process(tmp_path: Path) -> None:
    port = free_port()
    process = halfmoon("up", "--port", str(port), "--prefill", "2", "--decode", "1")
    try:
        line = wait_for_line(process, "halfmoon is up", 60)
        assert f"http://127.0.0.1:{port}/v1" in line
        children = children_of(process.pid)
        assert len(children) >= 5  # nats-server, conductor, 2 prefill, decode, gateway
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=7,
            extra_body=WHOLE)
        assert chat.usage is not None and chat.usage.completion_tokens == 7
        stream = client.completions.create(model=MODEL, prompt="a", max_tokens=9, stream=True,
                                           stream_options={"include_usage": True},
                                           extra_body=WHOLE)
        chunks = list(stream)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 9
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    deadline = time.monotonic() + 5
    while any(is_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in children if is_alive(pid)]


def test_up_runs_an_embedded_three_node_nats_cluster() -> None:
    port = free_port()
    process = halfmoon("up", "--port", str(port), "--engine", "fake", "--nats-cluster", "3")
    try:
        line = wait_for_line(process, "halfmoon is up", 60)
        assert line.count("nats://127.0.0.1:") == 3  # the three nodes' client URLs
        assert sum(b"nats-server" in _cmdline(pid) for pid in children_of(process.pid)) == 3
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
        completion = client.completions.create(model=MODEL, prompt="a", max_tokens=3,
                                               extra_body=WHOLE)
        assert completion.usage is not None and completion.usage.completion_tokens == 3
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_services_run_one_per_process_against_an_existing_server(nats_url: str) -> None:
    port = free_port()
    common = ["--nats", nats_url, "--cluster", "cli-split", "--log-level", "warning"]
    workers = ["--transfer-secret", "cli-split-secret"]
    processes = [halfmoon("conductor", *common),
                 *(halfmoon(role, *common, *workers) for role in ("prefill", "decode"))]
    processes.append(halfmoon("gateway", *common, "--port", str(port)))
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0)
        deadline = time.monotonic() + 30
        while True:
            try:
                response = client.completions.create(model=MODEL, prompt="a", max_tokens=4,
                                                     extra_body=WHOLE)
                break
            except (openai.APIConnectionError, openai.InternalServerError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        assert response.usage is not None and response.usage.completion_tokens == 4
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        assert [p.wait(timeout=20) for p in processes] == [0, 0, 0, 0]


def test_bad_flag_value_exits_2_with_a_clear_message() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "gateway", "--port", "eighty"],
        capture_output=True, text=True, timeout=30, check=False,
    )
    assert result.returncode == 2
    assert "invalid --port (HALFMOON_PORT): Expected `int`" in result.stderr


def test_up_refuses_a_bad_setting_before_it_starts_anything() -> None:
    """A zero batch budget once started every process and left each prompt waiting."""
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "up", "--max-batch-tokens", "0"],
        capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 2
    assert result.stderr == "halfmoon: invalid --max-batch-tokens " \
        "(HALFMOON_MAX_BATCH_TOKENS): Expected `int` >= 1\n"
    assert result.stdout == ""  # no NATS, no service was started


def test_up_refuses_heartbeats_too_sparse_for_the_timeout_that_loses_a_worker() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "up", "--heartbeat-timeout-s", "0.9"],
        capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 2
    assert "--heartbeat-interval-s 0.5 must be at most half of --heartbeat-timeout-s 0.9" \
        in result.stderr


def test_model_init_writes_a_loadable_checkpoint(tmp_path: Path) -> None:
    target = tmp_path / "tiny"
    result = subprocess.run([sys.executable, "-m", "services.cli", "model", "init", str(target)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert {p.name for p in target.iterdir()} >= {
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "generation_config.json"}
    again = subprocess.run([sys.executable, "-m", "services.cli", "model", "init", str(target)],
                           capture_output=True, text=True, timeout=60, check=False)
    assert again.returncode == 1
    assert "already exists" in again.stderr


def test_up_with_an_existing_nats_server_starts_no_embedded_one(nats_url: str) -> None:
    port = free_port()
    process = halfmoon("up", "--port", str(port), "--nats", nats_url, "--engine", "fake",
                       "--cluster", "cli-existing")
    try:
        line = wait_for_line(process, "halfmoon is up", 60)
        assert f"(NATS {nats_url}," in line
        commands = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in children_of(process.pid)]
        assert not any(b"nats-server" in c for c in commands)
        assert len(commands) == 4  # conductor, prefill, decode, gateway
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
        response = client.completions.create(model=MODEL, prompt="a", max_tokens=3,
                                             extra_body=WHOLE)
        assert response.usage is not None and response.usage.completion_tokens == 3
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0


def test_up_in_colocated_mode_runs_workers_that_prefill_and_decode(nats_url: str) -> None:
    port = free_port()
    process = halfmoon("up", "--port", str(port), "--nats", nats_url, "--mode", "colocated",
                       "--workers", "2", "--cluster", "cli-colocated")
    try:
        wait_for_line(process, "halfmoon is up", 90)
        commands = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in children_of(process.pid)]
        roles = sorted(c.split(b"\0")[3].decode() for c in commands)  # python -m cli ROLE
        assert roles == ["conductor", "decode", "decode", "gateway"]  # no prefill worker
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
        response = client.completions.create(model=MODEL, prompt="a half moon", max_tokens=5,
                                             extra_body=WHOLE)
        assert response.usage is not None and response.usage.completion_tokens == 5
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0


def test_up_serves_every_model_it_is_given(nats_url: str, tmp_path: Path) -> None:
    from engine.builtin_model import write_builtin_model

    first = write_builtin_model(tmp_path / "first", hidden_size=32, num_layers=1)
    second = write_builtin_model(tmp_path / "second", hidden_size=32, num_layers=1,
                                 vocab_size=400, max_position_embeddings=256)
    port = free_port()
    process = halfmoon("up", "--port", str(port), "--nats", nats_url, "--cluster", "cli-models",
                       "--model", str(first), "--model", str(second))
    try:
        wait_for_line(process, "halfmoon is up", 120)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
        listed = {m.id: m.model_extra["max_model_len"] for m in client.models.list().data}
        assert listed == {"first": 2048, "second": 256}
        for model in listed:  # the gateway read second's tokenizer where its workers did
            chat = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                extra_body=WHOLE)
            assert chat.model == model
            assert chat.usage is not None and chat.usage.completion_tokens == 3
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="third", prompt="a", max_tokens=1)
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0


def test_up_on_a_port_another_server_holds_says_the_gateway_could_not_start(
        nats_url: str) -> None:
    """A gateway port taken by something that is not HTTP (here: bytes back to anything, as a
    transfer engine's listener answers): `halfmoon up` reports the gateway's exit, not a
    traceback from its readiness probe."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        squatter.settimeout(0.2)
        port = squatter.getsockname()[1]
        process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", "--port", str(port), "--nats", nats_url,
             "--engine", "fake", "--cluster", "cli-squatted"], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 90
        while process.poll() is None and time.monotonic() < deadline:
            try:
                connection, _ = squatter.accept()
            except TimeoutError:
                continue
            with connection:
                connection.sendall(b"\x82\xa4kind\xa8protocol not HTTP\r\n\r\n")
        output = process.communicate(timeout=30)[0]
    assert process.returncode != 0
    assert re.search(r"gateway \(pid \d+\) exited with 1 during start-up", output), output
    assert "address already in use" in output.lower()
    assert "BadStatusLine" not in output

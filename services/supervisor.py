"""Supervising `halfmoon up`'s child processes: a child that exits unexpectedly is restarted,
the others keep serving.

Restarts back off from `initial_backoff_s`, doubling to `max_backoff_s` while a child keeps
crashing (a child that ran `stable_s` without crashing starts again from the initial delay).
`max_crashes` crashes of one child within `crash_window_s` is a crash loop: `poll()` raises
`CrashLoop`, naming the process and carrying its last log lines, and the launcher stops
everything. Each child's stderr passes through to the launcher's stderr as it comes (tagged
with nothing: services log their own name), and its last lines are kept for that message.

Every child runs in a session of its own, so a terminal's Ctrl-C reaches only the launcher,
which then stops the children in order; each also gets SIGTERM if the launcher dies
(PDEATHSIG), so nothing outlives it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shared.child_process import die_with_parent
from shared.errors import ServiceStartFailed

LOG_TAIL_LINES = 20


class CrashLoop(ServiceStartFailed):
    """One child crashed too often; the stack stops."""


@dataclass(frozen=True)
class RestartPolicy:
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    max_crashes: int = 5
    crash_window_s: float = 60.0
    stable_s: float = 30.0


@dataclass(eq=False)
class Child:
    """One supervised process: its command, the running process, its crash history."""

    role: str
    command: Sequence[str]
    env: dict[str, str]
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    crashes: deque[float] = field(default_factory=deque)
    backoff_s: float = 0.0
    restart_at: float | None = None  # when a crashed child starts again
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=LOG_TAIL_LINES))

    @property
    def name(self) -> str:
        pid = self.process.pid if self.process is not None else "-"
        return f"{self.role} (pid {pid})"

    def start(self) -> None:
        self.process = subprocess.Popen(
            list(self.command), env=self.env, stderr=subprocess.PIPE,
            preexec_fn=die_with_parent, start_new_session=True)
        self.started_at = time.monotonic()
        self.restart_at = None
        threading.Thread(target=self._pass_logs, args=(self.process,), daemon=True,
                         name=f"logs.{self.role}").start()

    def _pass_logs(self, process: subprocess.Popen[bytes]) -> None:
        assert process.stderr is not None
        for raw in process.stderr:
            line = raw.decode(errors="replace")
            self.tail.append(line.rstrip("\n"))
            sys.stderr.write(line)
        sys.stderr.flush()

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None


class Supervisor:
    """The children of `halfmoon up`, restarted when they crash; `on_restart(role)` counts."""

    def __init__(self, policy: RestartPolicy | None = None,
                 on_restart: Callable[[str], None] | None = None) -> None:
        self.policy = policy or RestartPolicy()
        self.children: list[Child] = []
        self._on_restart = on_restart
        self._is_stopping = False

    def spawn(self, role: str, command: Sequence[str], env: dict[str, str]) -> Child:
        child = Child(role, command, env)
        child.start()
        self.children.append(child)
        return child

    def poll(self, now: float | None = None) -> None:
        """Note crashed children and restart those whose backoff has passed; raises
        `CrashLoop` when one crashed `max_crashes` times within `crash_window_s`."""
        now = time.monotonic() if now is None else now
        for child in self.children:
            if child.restart_at is not None:
                if now >= child.restart_at and not self._is_stopping:
                    self._restart(child)
                continue
            if child.process is None or child.process.poll() is None:
                continue
            self._crashed(child, now)

    def _crashed(self, child: Child, now: float) -> None:
        policy = self.policy
        code = child.process.returncode if child.process is not None else None
        child.crashes.append(now)
        while child.crashes and child.crashes[0] < now - policy.crash_window_s:
            child.crashes.popleft()
        if len(child.crashes) >= policy.max_crashes:
            last = "\n".join(f"    {line}" for line in child.tail) or "    (no output)"
            raise CrashLoop(f"{child.name} exited with {code}, its {len(child.crashes)}th "
                            f"crash in {policy.crash_window_s:g} s; its last lines:\n{last}")
        is_stable = now - child.started_at >= policy.stable_s
        child.backoff_s = policy.initial_backoff_s if is_stable or not child.backoff_s \
            else min(policy.max_backoff_s, child.backoff_s * 2)
        child.restart_at = now + child.backoff_s
        print(f"halfmoon: {child.name} exited with {code}; restarting it in "
              f"{child.backoff_s:g} s", file=sys.stderr, flush=True)

    def _restart(self, child: Child) -> None:
        if self._on_restart is not None:  # counted first: a new process is never seen uncounted
            self._on_restart(child.role)
        child.start()
        print(f"halfmoon: restarted {child.name}", file=sys.stderr, flush=True)

    def first_exited(self) -> Child | None:
        """A child that is not running (during start-up, any exit is a failure)."""
        return next((c for c in self.children if not c.is_running()), None)

    def stop(self, order: Sequence[Sequence[str]], timeout_s: float) -> None:
        """SIGTERM the children group by group (roles in `order`), each group given
        `timeout_s` before what is left is killed; no restarts from here on."""
        self._is_stopping = True
        for group in order:
            members = [c.process for c in self.children
                       if c.role in group and c.process is not None and c.process.poll() is None]
            for process in members:
                process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for process in members:
                try:
                    process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()

"""Child processes that never outlive their parent."""

from __future__ import annotations

import ctypes
import os
import signal


def die_with_parent() -> None:
    """In the child, before exec: get SIGTERM if the parent dies (Linux; elsewhere nothing).
    Children started in sessions of their own are out of reach of the terminal's signals, so
    this is what ends them when the parent is killed. Linux sends it when the *thread* that
    started the child ends: start a child from a thread that outlives it (the main thread, or
    an executor's, which lives as long as its event loop)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except OSError:
        pass


def is_alive(pid: int) -> bool:
    """Whether process `pid` exists (it may belong to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

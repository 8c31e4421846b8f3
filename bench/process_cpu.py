"""CPU seconds of a `halfmoon up` stack's processes, by role, from `/proc` (Linux).

A process's role is read from its command line (`services.cli <role>`, `nats-server`);
each role's CPU is split into its main thread and every other thread (exporters, copies),
so a benchmark can say which process, and which thread of it, a cost lands on.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

ROLES = ("gateway", "conductor", "prefill", "decode", "nats-server")
_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (those alive now)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    return [pid, *(p for child in children for p in process_tree(int(child)))]


def role_of(pid: int) -> str:
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return "gone"
    for word in words:
        name = word.rsplit("/", 1)[-1]
        if name in ROLES:
            return name
    return "launcher"


def _thread_cpu_s(pid: int, tid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S  # utime + stime


def process_cpu_s(pid: int) -> float:
    """CPU seconds so far of one process, every thread of it."""
    try:
        tids = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return 0.0
    return sum(_thread_cpu_s(pid, tid) for tid in tids)


def stack_cpu_s(pid: int) -> Counter[str]:
    """CPU seconds so far of every process under `pid`, keyed `role` (main thread) and
    `role+threads` (its other threads)."""
    seconds: Counter[str] = Counter()
    for process in process_tree(pid):
        role = role_of(process)
        try:
            tids = [int(tid) for tid in os.listdir(f"/proc/{process}/task")]
        except OSError:
            continue
        for tid in tids:
            key = role if tid == process else f"{role}+threads"
            seconds[key] += _thread_cpu_s(process, tid)
    return seconds

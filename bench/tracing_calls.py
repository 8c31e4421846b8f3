"""What tracing adds to a request, counted: the function calls of the serving loop.

CPU time on this shared machine moves by more than tracing costs between equal runs (see
`bench.tracing_overhead --control`); the number of calls a request makes does not. Every
service runs in this process (`tests.stack.Stack`, as `bench.tracing_cost`), tracing off and
then on (every span recorded and encoded, in the exporter's thread, which is not counted);
a profile hook counts every call (Python and C) the main thread makes (every service's loop
and the clients', the same in both modes) over `--requests` streamed requests. Prints the
calls per request in each mode, and for tracing on the calls under each outermost tracing
frame (OpenTelemetry's, `shared.tracing`'s, the lean tracer's, and nats-py's header
parsing), by the line that called it, with tracing off's subtracted.

    python -m bench.tracing_calls [--requests 200]

The baseline is tracing off in the same run. Run from a checkout (the stack is the tests').
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
from pathlib import Path
from types import FrameType
from typing import Any

from bench.tracing_cost import stack_in_process, window
from shared import tracing
from shared.logs import configure_logging

# Frames whose calls are tracing's: the outermost one met gets the count of all beneath it.
TRACING_FILES = ("/opentelemetry/", "shared/tracing.py", "shared/lean_tracer.py")
TRACING_FUNCTIONS = ("_process_headers",)  # nats-py, for a message that carries headers
_ROOT = f"{Path(__file__).resolve().parents[1]}/"


class CallCounter:
    """A `sys.setprofile` hook: every call, and the calls under each tracing entry point.
    Tracing's code never awaits, so an entry's calls are done before another task runs."""

    def __init__(self) -> None:
        self.calls = 0
        self.by_entry: collections.Counter[str] = collections.Counter()
        self._depth = 0  # calls open under the current entry, 0 outside any
        self._entry = ""

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            self.calls += 1
            if self._depth:
                self._depth += 1
                self.by_entry[self._entry] += 1
            elif event == "call" and _is_tracing(frame):
                self._entry = f"{frame.f_code.co_name} <- {_where(frame.f_back)}"
                self._depth = 1
                self.by_entry[self._entry] += 1
        elif self._depth and event in ("return", "c_return", "c_exception"):
            self._depth -= 1


def _is_tracing(frame: FrameType) -> bool:
    code = frame.f_code
    return code.co_name in TRACING_FUNCTIONS or \
        any(part in code.co_filename for part in TRACING_FILES)


def _where(frame: FrameType | None) -> str:
    if frame is None:
        return "?"
    path = frame.f_code.co_filename.split("site-packages/")[-1].removeprefix(_ROOT)
    return f"{path}:{frame.f_lineno}"


async def count(args: argparse.Namespace) -> dict[str, CallCounter]:
    counters: dict[str, CallCounter] = {}
    async with stack_in_process("on") as (url, session, provider):
        for mode in ("off", "on"):
            if mode == "on":
                tracing.install(provider)
            await window(session, url, args)  # warm-up
            counters[mode] = CallCounter()
            sys.setprofile(counters[mode])
            try:
                await window(session, url, args)
            finally:
                sys.setprofile(None)
            provider.force_flush()
    return counters


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--requests", type=int, default=200, help="counted, in each mode")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--top", type=int, default=30, help="entry points listed")
    args = parser.parse_args(argv)
    configure_logging("warning")
    counters = asyncio.run(count(args))
    off, on = counters["off"], counters["on"]
    per = args.requests
    print(f"calls per request: off {off.calls / per:.0f}, on {on.calls / per:.0f} "
          f"({on.calls / off.calls:.3f}x)")
    added = {entry: (on.by_entry[entry] - off.by_entry[entry]) / per
             for entry in on.by_entry.keys() | off.by_entry.keys()}
    print(f"under tracing's frames: off {sum(off.by_entry.values()) / per:.0f}, "
          f"on {sum(on.by_entry.values()) / per:.0f}; by entry point, on - off:")
    for entry, calls in sorted(added.items(), key=lambda item: -abs(item[1]))[:args.top]:
        print(f"{calls:+8.1f}  {entry}")


if __name__ == "__main__":
    main()

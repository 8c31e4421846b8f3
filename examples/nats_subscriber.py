"""A live terminal view of a halfmoon cluster, built only on its public NATS events.

    python examples/nats_subscriber.py --nats nats://127.0.0.1:4222 [--cluster default]

Every second: requests per second finished, in flight, failed and aborted; TTFT and
inter-token latency percentiles over the last `--window-s` seconds (as the gateway measured
them for its clients); KV bytes moved per transport; and, where requests of several
priorities finished, each priority's median end-to-end latency. It needs only `nats-py` and the JSON
payloads documented in docs/contract/ (RequestEvent on
`halfmoon.<cluster>.v1.events.request.<kind>`), not halfmoon itself: copy it and adapt it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import nats


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by nearest rank; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


@dataclass
class View:
    """What the events said, kept for the last `window_s` seconds where it is a rate."""

    window_s: float = 10.0
    finished: deque[tuple[float, dict[str, Any]]] = field(default_factory=deque)
    open_requests: set[str] = field(default_factory=set)
    counts: Counter[str] = field(default_factory=Counter)
    kv_bytes: Counter[str] = field(default_factory=Counter)

    def apply(self, event: dict[str, Any]) -> None:
        kind, request_id = event["kind"], event["request_id"]
        self.counts[kind] += 1
        if kind == "accepted":
            self.open_requests.add(request_id)
        elif kind in ("finished", "failed"):
            self.open_requests.discard(request_id)
            if kind == "finished":
                self.counts["aborted"] += event.get("finish_reason") == "abort"
                self.finished.append((time.monotonic(), event))
        elif kind == "kv_committed":
            self.kv_bytes[event.get("transport", "")] += event.get("num_kv_bytes", 0)

    def lines(self) -> list[str]:
        cutoff = time.monotonic() - self.window_s
        while self.finished and self.finished[0][0] < cutoff:
            self.finished.popleft()
        events = [event for _, event in self.finished]
        ttft = [e["ttft_s"] * 1000 for e in events if e.get("ttft_s") is not None]
        itl = [e["itl_mean_s"] * 1000 for e in events if e.get("itl_mean_s") is not None]
        kv = ", ".join(f"{transport or 'none'} {num / 1e6:.2f} MB"
                       for transport, num in sorted(self.kv_bytes.items())) or "none yet"
        return [
            f"requests/s {len(events) / self.window_s:7.2f}   in flight "
            f"{len(self.open_requests):4d}   finished {self.counts['finished']}   failed "
            f"{self.counts['failed']}   aborted {self.counts['aborted']}   migrated "
            f"{self.counts['migrated']}",
            f"TTFT ms  p50 {_ms(percentile(ttft, 50))}  p90 {_ms(percentile(ttft, 90))}  "
            f"p99 {_ms(percentile(ttft, 99))}   (last {self.window_s:g} s)",
            f"ITL ms   p50 {_ms(percentile(itl, 50))}  p90 {_ms(percentile(itl, 90))}  "
            f"p99 {_ms(percentile(itl, 99))}   (per-request mean)",
            f"KV moved {kv}",
            *self._by_priority(events),
        ]

    @staticmethod
    def _by_priority(events: list[dict[str, Any]]) -> list[str]:
        """Where requests of more than one priority finished (a cluster that schedules by
        priority): each one's end-to-end latency."""
        e2e: dict[int, list[float]] = {}
        for event in events:
            if event.get("e2e_s") is not None:
                e2e.setdefault(event.get("priority", 0), []).append(event["e2e_s"] * 1000)
        if len(e2e) < 2:
            return []
        return ["E2E ms p50 by priority  " + "   ".join(
            f"{priority}: {_ms(percentile(values, 50)).strip()}"
            for priority, values in sorted(e2e.items()))]


def _ms(value: float | None) -> str:
    return "      -" if value is None else f"{value:7.1f}"


async def watch(url: str, cluster: str, window_s: float, duration_s: float | None,
                interval_s: float) -> View:
    nc = await nats.connect(url)
    view = View(window_s=window_s)

    async def on_event(msg: Any) -> None:
        try:
            view.apply(json.loads(msg.data))
        except (ValueError, KeyError) as exc:
            print(f"skipped a malformed event on {msg.subject}: {exc!r}", file=sys.stderr)

    await nc.subscribe(f"halfmoon.{cluster}.v1.events.request.>", cb=on_event)
    # Subscribed at the server before the first report. Twice: nats-py's flush() sends its
    # PING ahead of a SUB it still holds, so one PONG does not promise the subscription.
    await nc.flush()
    await nc.flush()
    is_terminal = sys.stdout.isatty()
    started = time.monotonic()
    try:
        while duration_s is None or time.monotonic() - started < duration_s:
            await asyncio.sleep(interval_s)
            if is_terminal:
                print("\033[2J\033[H", end="")  # clear the screen, cursor home
            print("\n".join(view.lines()), flush=True)
    finally:
        await nc.close()
    return view


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nats", default="nats://127.0.0.1:4222")
    parser.add_argument("--cluster", default="default")
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--interval-s", type=float, default=1.0)
    parser.add_argument("--duration-s", type=float, default=None, help="default: until Ctrl-C")
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(watch(args.nats, args.cluster, args.window_s, args.duration_s,
                          args.interval_s))


if __name__ == "__main__":
    main()

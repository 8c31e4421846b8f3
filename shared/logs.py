"""structlog set-up: JSON lines when not on a TTY, readable console output on one.

Bind `request_id` with `structlog.contextvars.bind_contextvars` (or pass it as a field) so
every line about a request carries it. Lines written inside a recording span also carry its
`trace_id` and `span_id` (hex, as Jaeger shows them), so logs join traces.

The libraries' records (stdlib logging: nats-py, aiohttp, OpenTelemetry's SDK and exporter)
are rendered the same way, warnings and up, and each of their messages at most once every
`LIBRARY_REPEAT_S`: with its collector down the span processor warns for every span it
drops, hundreds of lines a second; the next line let through says how many were left out
(`repeated`).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Literal

import structlog
from opentelemetry import trace

LIBRARY_REPEAT_S = 10.0


def configure_logging(
    level: str = "info", log_format: Literal["auto", "json", "console"] = "auto"
) -> None:
    """Configure structlog and the stdlib root logger once per process."""
    numeric_level = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    is_json = log_format == "json" or (log_format == "auto" and not sys.stderr.isatty())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if is_json else structlog.dev.ConsoleRenderer()
    )
    chain: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        _add_trace_ids,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info if is_json else _keep_exc_info,
    ]
    structlog.configure(
        processors=[*chain, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    # The libraries' stdlib records (nats-py, aiohttp, OpenTelemetry's exporter) come out
    # as ours do, one JSON object a line with the logger's name: a log pipeline that parses
    # the lines finds no plain-text ones among them.
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(Repeats(LIBRARY_REPEAT_S))
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_logger_name,
                           structlog.stdlib.ExtraAdder(allow=["repeated"]), *chain],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer]))
    logging.basicConfig(level=max(numeric_level, logging.WARNING), handlers=[handler])


class Repeats(logging.Filter):
    """Lets each message (its logger and format string) through at most once every
    `interval_s`; the next one let through carries how many were held back (`repeated`)."""

    _MAX_KEPT = 1024  # messages remembered: a library that formats its own varies them

    def __init__(self, interval_s: float) -> None:
        super().__init__()
        self._interval_s = interval_s
        self._seen: dict[tuple[str, object], list[float]] = {}  # -> [written at, held back]
        self._lock = threading.Lock()  # records come from any thread

    def filter(self, record: logging.LogRecord) -> bool:
        key, now = (record.name, record.msg), time.monotonic()
        with self._lock:
            seen = self._seen.get(key)
            if seen is not None and now - seen[0] < self._interval_s:
                seen[1] += 1
                return False
            if seen is not None and seen[1]:
                record.repeated = int(seen[1])
            if seen is None and len(self._seen) >= self._MAX_KEPT:
                self._seen = {k: v for k, v in self._seen.items()
                              if now - v[0] < self._interval_s}
            self._seen[key] = [now, 0]
        return True


def _add_trace_ids(
    _logger: object, _name: str, event: structlog.typing.EventDict
) -> structlog.typing.EventDict:
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        event.setdefault("trace_id", format(context.trace_id, "032x"))
        event.setdefault("span_id", format(context.span_id, "016x"))
    return event


def _keep_exc_info(
    _logger: object, _name: str, event: structlog.typing.EventDict
) -> structlog.typing.EventDict:
    return event


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(name)

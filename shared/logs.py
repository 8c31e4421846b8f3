"""structlog set-up: JSON lines when not on a TTY, readable console output on one.

Bind `request_id` with `structlog.contextvars.bind_contextvars` (or pass it as a field) so
every line about a request carries it. Lines written inside a recording span also carry its
`trace_id` and `span_id` (hex, as Jaeger shows them), so logs join traces.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog
from opentelemetry import trace


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
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_logger_name, *chain],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer]))
    logging.basicConfig(level=max(numeric_level, logging.WARNING), handlers=[handler])


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

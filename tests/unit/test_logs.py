"""Log lines: ours and the libraries' alike, one JSON object a line."""

from __future__ import annotations

import json
import subprocess
import sys

PROGRAM = """
import logging
from shared.logs import configure_logging, get_logger

configure_logging("info", "json")
get_logger("halfmoon.test").info("ours", worker_id="w1")
logging.getLogger("opentelemetry.exporter").warning("retrying in %.2fs", 1.5)
try:
    1 / 0
except ZeroDivisionError:
    logging.getLogger("aiohttp.server").exception("Error handling request")
logging.getLogger("nats").info("below the libraries' level: not written")
"""


def test_the_libraries_stdlib_records_are_json_lines_as_ours_are() -> None:
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                          timeout=60, check=True)
    lines = [json.loads(line) for line in done.stderr.splitlines()]
    ours, warning, error = lines
    assert (ours["event"], ours["level"], ours["worker_id"]) == ("ours", "info", "w1")
    assert warning["event"] == "retrying in 1.50s"
    assert (warning["logger"], warning["level"]) == ("opentelemetry.exporter", "warning")
    assert {"timestamp"} <= warning.keys()
    assert (error["logger"], error["level"]) == ("aiohttp.server", "error")
    assert error["exception"].rstrip().endswith("ZeroDivisionError: division by zero")


REPEATING = """
import logging, time
from shared import logs

logs.LIBRARY_REPEAT_S = 0.5
logs.configure_logging("info", "json")
processor = logging.getLogger("opentelemetry.sdk._shared_internal")
for _ in range(300):
    processor.warning("Queue full, dropping %s.", "Span")
logging.getLogger("nats.aio.client").warning("another message: not held back")
time.sleep(0.6)
processor.warning("Queue full, dropping %s.", "Span")
for i in range(5):
    logs.get_logger("halfmoon.test").warning("ours are never held back", i=i)
"""


def test_a_librarys_repeated_message_is_written_once_an_interval_with_a_count() -> None:
    done = subprocess.run([sys.executable, "-c", REPEATING], capture_output=True, text=True,
                          timeout=60, check=True)
    lines = [json.loads(line) for line in done.stderr.splitlines()]
    first, other, later, *ours = lines
    assert first["event"] == later["event"] == "Queue full, dropping Span."
    assert "repeated" not in first
    assert later["repeated"] == 299
    assert other["logger"] == "nats.aio.client"
    assert [line["i"] for line in ours] == list(range(5))

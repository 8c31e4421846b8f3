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

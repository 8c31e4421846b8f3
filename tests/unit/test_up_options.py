"""What `halfmoon up` passes each of its processes, from its own flags."""

from __future__ import annotations

from services.cli import build_parser
from services.launcher import UpOptions


def options(*flags: str) -> UpOptions:
    return UpOptions.from_args(build_parser().parse_args(["up", *flags]))


def conductor_max_age(up: UpOptions) -> str | None:
    flags = up.flags_for("conductor")
    return flags[flags.index("--request-max-age-s") + 1] \
        if "--request-max-age-s" in flags else None


def test_the_conductor_waits_for_a_request_as_long_as_its_gateway_does() -> None:
    """A gateway given more patience would otherwise still see its requests refused by the
    conductor after its own default (waiting in line for room) or dropped as expired."""
    patient = options("--request-timeout-s", "120")
    assert conductor_max_age(patient) == "120"
    assert "--request-timeout-s" in patient.flags_for("gateway")
    apart = options("--request-timeout-s", "120", "--request-max-age-s", "90")
    assert conductor_max_age(apart) == "90"  # said: kept
    assert conductor_max_age(options()) is None  # the conductor's own default

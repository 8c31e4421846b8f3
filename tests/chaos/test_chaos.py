"""Chaos scenarios (`bench/chaos.py`) against `halfmoon up`: every client's output equals the
fault-free run's, nothing is lost, duplicated or leaked. Two scenarios run in `make test`; the
rest with `-m chaos`."""

from __future__ import annotations

import pytest

from bench.chaos import parse_args, run_scenario, score

ARGS = parse_args(["--requests", "16", "--clients", "6", "--max-tokens", "32",
                   "--fault-at-s", "0.8", "--settle-s", "2.5"])
PROMPTS = [f"chaos request {i}: tell me something" for i in range(16)]


@pytest.fixture(scope="module")
async def reference() -> dict[str, str]:
    outcomes, _, _ = await run_scenario("none", ARGS, PROMPTS)
    assert all(o.status == 200 and o.text for o in outcomes)
    return {o.prompt: o.text for o in outcomes}


async def check(scenario: str, reference: dict[str, str]) -> None:
    outcomes, cluster, fault_at = await run_scenario(scenario, ARGS, PROMPTS)
    row = score(scenario, outcomes, reference, cluster, fault_at)
    assert (row.completed, row.truncated, row.wrong, dict(row.errors)) == (16, 0, 0, {}), row
    assert (row.missing_tokens, row.duplicated_tokens) == (0, 0)
    assert (row.leaked_blocks, row.leaked_leases) == (0, 0)


async def test_a_killed_decode_worker_loses_no_request(reference: dict[str, str]) -> None:
    await check("kill-decode", reference)


async def test_a_nats_restart_loses_no_request(reference: dict[str, str]) -> None:
    await check("restart-nats", reference)


@pytest.mark.chaos
@pytest.mark.parametrize("scenario", ["kill-prefill", "kill-conductor", "stop-prefill",
                                      "pause-decode", "pause-prefill", "pause-conductor"])
async def test_the_other_faults_lose_no_request(scenario: str,
                                                reference: dict[str, str]) -> None:
    await check(scenario, reference)


@pytest.mark.chaos
async def test_a_killed_gateway_affects_only_its_own_clients(
        reference: dict[str, str]) -> None:
    outcomes, cluster, fault_at = await run_scenario("kill-gateway", ARGS, PROMPTS)
    row = score("kill-gateway", outcomes, reference, cluster, fault_at)
    # Requests alternate between the two gateways: the survivor's half all complete.
    assert row.completed >= 8 and row.completed + row.own_affected == 16, row
    assert (row.truncated, row.wrong, dict(row.errors)) == (0, 0, {}), row
    assert (row.leaked_blocks, row.leaked_leases) == (0, 0)

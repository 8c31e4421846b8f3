"""Chaos scenarios (`bench/chaos.py`) against `halfmoon up`: every client's output equals the
fault-free run's, nothing is lost, duplicated or leaked. Two scenarios run in `make test`; the
rest with `-m chaos`."""

from __future__ import annotations

import argparse

import pytest

from bench.chaos import make_prompts, parse_args, run_scenario, score

ARGS = parse_args(["--requests", "16", "--clients", "6", "--max-tokens", "32",
                   "--fault-at-s", "0.8", "--settle-s", "2.5"])
PROMPTS = make_prompts(ARGS)


@pytest.fixture(scope="module")
async def reference() -> dict[str, str]:
    outcomes, _, _ = await run_scenario("none", ARGS, PROMPTS)
    assert all(o.status == 200 and o.text for o in outcomes)
    return {o.prompt: o.text for o in outcomes}


async def check(scenario: str, reference: dict[str, str], args: argparse.Namespace = ARGS,
                prompts: list[str] = PROMPTS) -> None:
    outcomes, cluster, fault_at = await run_scenario(scenario, args, prompts)
    row = score(scenario, outcomes, reference, cluster, fault_at)
    assert (row.completed, row.truncated, row.wrong, dict(row.errors)) == \
        (len(prompts), 0, 0, {}), row
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


@pytest.mark.chaos
@pytest.mark.parametrize("scenario", ["kill-decode", "pause-conductor"])
async def test_long_prompts_on_the_torch_engine_survive(scenario: str) -> None:
    """The built-in model, prompts of hundreds of tokens: the fault meets real prefill steps
    and KV handoffs (the fake engine moves no KV)."""
    args = parse_args(["--engine", "torch", "--long-prompts", "--requests", "12",
                       "--clients", "6", "--max-tokens", "24", "--fault-at-s", "0.5"])
    prompts = make_prompts(args)
    outcomes, _, _ = await run_scenario("none", args, prompts)
    assert all(o.status == 200 and o.text for o in outcomes)
    await check(scenario, {o.prompt: o.text for o in outcomes}, args, prompts)


def test_torch_chaos_runs_under_halfmoon_up_only() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--engine", "torch", "--launch", "processes"])
    with pytest.raises(SystemExit):
        parse_args(["--up-flags", "--num-blocks 72", "--launch", "processes"])
    long = make_prompts(parse_args(["--long-prompts", "--requests", "4"]))
    assert long == make_prompts(parse_args(["--long-prompts", "--requests", "4"]))
    assert all(40 <= len(p.split()) - 3 <= 450 for p in long)

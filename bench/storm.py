"""Storm: faults one after another under a load of every kind of request clients send, each
output compared with a fault-free run of the same stack.

`halfmoon up --gateways 2 --prefill 2 --decode 2` on the built-in model (`bench.chaos`'s
cluster; `--up-flags` adds flags: a small pool, the planner, two models, a NATS cluster),
`--requests` requests from `--clients` clients, in turn of each kind: a streamed greedy
completion; a chat completion; a JSON-schema structured output; a seeded n = 2 completion
with logprobs; a streamed chat with a stop string, penalties and usage; a forced tool call;
a Responses API request; a seeded streamed n = 2 completion; a seeded streamed chat with
top logprobs. Prompts run to 300 words, so faults meet real prefill steps and KV handoffs.
The load runs twice on one cluster: fault-free (the reference), then with a fault every
`--every-s` seconds (`--faults`, in turn, from `bench.chaos`'s: kills, pauses, a NATS
restart). Each request must end as its reference did (status and output: greedy and seeded
requests draw the same tokens after a failover, whatever moved them), every structured
output and whole tool call must parse, and no KV may stay held.

    python -m bench.storm [--requests 84 --every-s 6] [--faults kill-decode,restart-nats]
    python -m bench.storm --up-flags "--num-blocks 72"
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from bench.chaos_cluster import SCENARIOS, UpCluster, inject
from bench.control_path import MODEL

FAULTS = [s for s in SCENARIOS if s not in ("none", "kill-gateway")]
_WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "while", "seven",
          "wizards", "quietly", "hex", "bold", "jam", "river", "stone", "lantern", "harbor")
_PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                            "age": {"type": "integer"}},
           "required": ["name", "age"], "additionalProperties": False}
_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"]}}}]


def _chat(text: str, **fields: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], **fields}


KINDS: list[Callable[[int, str], tuple[str, dict[str, Any]]]] = [
    lambda i, text: ("/v1/completions", {"prompt": text, "max_tokens": 24, "temperature": 0,
                                          "stream": True}),
    lambda i, text: _chat(text, max_tokens=20, temperature=0),
    lambda i, text: _chat("json " + text, max_tokens=60, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": _PERSON}}),
    lambda i, text: ("/v1/completions", {"prompt": text, "max_tokens": 16, "temperature": 0.8,
                                          "seed": i, "n": 2, "logprobs": 2}),
    lambda i, text: _chat(text, max_tokens=24, temperature=0, stream=True, stop=["x."],
                          presence_penalty=0.5, frequency_penalty=0.3,
                          stream_options={"include_usage": True}),
    lambda i, text: _chat("weather " + text, max_tokens=96, temperature=0, tools=_TOOLS,
                          tool_choice="required"),
    lambda i, text: ("/v1/responses", {"input": text, "max_output_tokens": 16,
                                        "temperature": 0}),
    lambda i, text: ("/v1/completions", {"prompt": text, "max_tokens": 16, "temperature": 0.9,
                                          "seed": i, "n": 2, "stream": True}),
    lambda i, text: _chat(text, max_tokens=16, temperature=0.7, seed=i, logprobs=True,
                          top_logprobs=3, stream=True),
]


def make_requests(count: int) -> list[tuple[str, dict[str, Any]]]:
    draw = random.Random(11)  # the same requests in both runs
    return [KINDS[i % len(KINDS)](i, " ".join(draw.choices(_WORDS, k=draw.randint(20, 300))))
            for i in range(count)]


def _choice_summary(choice: dict[str, Any]) -> list[Any]:
    message = choice.get("message") or {}
    logprobs = choice.get("logprobs") or {}
    return [choice.get("text") or message.get("content"),
            [(c["function"]["name"], c["function"]["arguments"])
             for c in message.get("tool_calls") or []],
            choice["finish_reason"],
            logprobs.get("tokens") or [t["token"] for t in logprobs.get("content") or []]]


def summary(path: str, data: dict[str, Any]) -> list[Any]:
    """What of a whole response must equal the reference's."""
    if path == "/v1/responses":
        return [data["status"], data["usage"]["output_tokens"],
                [c.get("text") for item in data["output"] for c in item.get("content", [])]]
    return [_choice_summary(c) for c in sorted(data["choices"], key=lambda c: c["index"])]


async def streamed(response: aiohttp.ClientResponse) -> list[Any] | str:
    """What of a stream must equal the reference's; an error's text if it failed."""
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    tokens: list[str] = []
    usage, is_done = None, False
    async for line in response.content:
        if line.startswith(b"data: [DONE]"):
            is_done = True
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            return json.dumps(chunk)
        usage = (chunk.get("usage") or {}).get("completion_tokens", usage)
        for c in chunk["choices"]:
            piece = c.get("text") or (c.get("delta") or {}).get("content") or ""
            texts[c["index"]] = texts.get(c["index"], "") + piece
            tokens += [t["token"] for t in (c.get("logprobs") or {}).get("content") or []]
            if c.get("finish_reason"):
                finishes[c["index"]] = c["finish_reason"]
    if not is_done:
        return "the stream ended without [DONE]"
    return [sorted(texts.items()), sorted(finishes.items()), usage, tokens]


async def send(session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]
               ) -> tuple[int, Any]:
    try:
        async with session.post(url + path, json={"model": MODEL, **body}) as response:
            if response.status != 200:
                return response.status, (await response.text())[:300]
            if body.get("stream"):
                result = await streamed(response)
                return (200, result) if isinstance(result, list) else (598, result)
            return 200, summary(path, await response.json())
    except (aiohttp.ClientError, TimeoutError) as exc:
        return 599, repr(exc)


def malformed(path: str, body: dict[str, Any], status: int, result: Any) -> str | None:
    """Why a 200 output breaks its request's contract (its schema, a whole tool call)."""
    if status != 200 or path != "/v1/chat/completions" or body.get("stream"):
        return None
    text, calls, finish, _ = result[0]
    if finish == "length":  # cut short: what OpenAI sends too
        return None
    try:
        if "response_format" in body and set(json.loads(text)) != {"name", "age"}:
            return f"not the schema's keys: {text!r}"
        if "tools" in body and (not calls or calls[0][0] != "get_weather"
                                or not isinstance(json.loads(calls[0][1]), dict)):
            return f"no call: {result!r}"
    except ValueError:
        return f"not JSON: {result!r}"
    return None


async def run_load(urls: list[str], requests: list[tuple[str, dict[str, Any]]], clients: int
                   ) -> list[tuple[int, Any]]:
    """Every request sent once, request i to gateway i mod len(urls)."""
    results: list[tuple[int, Any]] = [(0, None)] * len(requests)
    queue = list(range(len(requests)))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        async def client() -> None:
            while queue:
                i = queue.pop(0)
                results[i] = await send(session, urls[i % len(urls)], *requests[i])

        await asyncio.gather(*(client() for _ in range(clients)))
    return results


async def storm(cluster: UpCluster, faults: list[str], every_s: float,
                stop: asyncio.Event) -> None:
    for turn in itertools.count():
        try:
            await asyncio.wait_for(stop.wait(), every_s)
            return
        except TimeoutError:
            fault = faults[turn % len(faults)]
            print(f"{time.strftime('%X')} {fault}", flush=True)
            await inject(cluster, fault)


async def run(args: argparse.Namespace) -> int:
    requests = make_requests(args.requests)
    cluster = UpCluster(argparse.Namespace(engine="torch", token_delay_s=0.0,
                                           up_flags=args.up_flags))
    await cluster.start()
    try:
        started = time.monotonic()
        reference = await run_load(cluster.urls, requests, args.clients)
        print(f"reference: {time.monotonic() - started:.0f} s", flush=True)
        stop = asyncio.Event()
        faults = asyncio.ensure_future(storm(cluster, args.faults, args.every_s, stop))
        started = time.monotonic()
        stormed = await run_load(cluster.urls, requests, args.clients)
        stop.set()
        await faults
        print(f"storm: {time.monotonic() - started:.0f} s", flush=True)
        await cluster.settle(args.settle_s)
    finally:
        await cluster.stop()
    return report(requests, reference, stormed, cluster)


def report(requests: list[tuple[str, dict[str, Any]]], reference: list[tuple[int, Any]],
           stormed: list[tuple[int, Any]], cluster: UpCluster) -> int:
    problems = []
    for i, ((path, body), expected, got) in enumerate(zip(requests, reference, stormed,
                                                          strict=True)):
        for run_name, result in (("reference", expected), ("storm", got)):
            if why := malformed(path, body, *result):
                problems.append(f"#{i} {path} ({run_name}): {why}")
        if got != expected:
            problems.append(f"#{i} {path}: expected {str(expected)[:200]}, got {str(got)[:200]}")
    blocks, leases = cluster.leaked()
    statuses = sorted({status for status, _ in reference})
    print(f"{len(requests)} requests (reference statuses {statuses}): {len(problems)} "
          f"problems; KV blocks held {blocks}, leases {leases}; placed twice "
          f"{cluster.placed_twice()}")
    for problem in problems:
        print(" ", problem)
    return 0 if not problems and not blocks and not leases else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=84)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--every-s", type=float, default=6.0)
    parser.add_argument("--faults", type=lambda s: s.split(","), default=FAULTS)
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--up-flags", type=str.split, default=[],
                        help="more `halfmoon up` flags, in one string")
    args = parser.parse_args(argv)
    if unknown := set(args.faults) - set(FAULTS):
        parser.error(f"unknown faults {sorted(unknown)}; known: {', '.join(FAULTS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(run(parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())

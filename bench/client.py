"""A streaming OpenAI `/v1/completions` client that times each request.

Per request: when it was sent, when each chunk carrying text arrived (the first one is the
TTFT; the gaps between them the inter-token latencies), when the stream ended, the token
counts from the final usage chunk (or the chunks, for servers that send no usage), and how it
failed, if it did: `rejected` for 429 (an SLO admission refusal or a full server), `error`
for anything else, with the server's message.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field

import aiohttp

from bench.workload import BenchRequest


@dataclass
class RequestRecord:
    sent_at_s: float  # from the start of the run
    num_prompt_tokens: int
    max_tokens: int
    status: str = "ok"  # ok | rejected | error
    http_status: int = 0
    error: str = ""
    chunk_times_s: list[float] = field(default_factory=list)  # from sent_at_s
    end_s: float = float("nan")  # from sent_at_s
    num_output_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def ttft_s(self) -> float:
        return self.chunk_times_s[0] if self.chunk_times_s else float("nan")

    @property
    def itls_s(self) -> list[float]:
        times = self.chunk_times_s
        return [b - a for a, b in itertools.pairwise(times)]

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first."""
        if self.num_output_tokens < 2 or not self.chunk_times_s:
            return float("nan")
        return (self.end_s - self.ttft_s) / (self.num_output_tokens - 1)


class CompletionClient:
    def __init__(self, base_url: str, model: str, *, api_key: str | None = None,
                 timeout_s: float = 600.0) -> None:
        self.url = base_url.rstrip("/") + "/v1/completions"
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s))

    async def close(self) -> None:
        await self._session.close()

    async def send(self, request: BenchRequest, run_started_s: float) -> RequestRecord:
        body = {"model": request.model or self.model, "prompt": request.prompt_token_ids,
                "max_tokens": request.max_tokens, "ignore_eos": True, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        started = time.perf_counter()
        record = RequestRecord(sent_at_s=started - run_started_s,
                               num_prompt_tokens=len(request.prompt_token_ids),
                               max_tokens=request.max_tokens)
        try:
            async with self._session.post(self.url, json=body) as response:
                record.http_status = response.status
                if response.status != 200:
                    record.status = "rejected" if response.status == 429 else "error"
                    record.error = _error_message(await response.text())
                    return record
                await self._read_stream(response, record, started)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            record.status, record.error = "error", f"{type(exc).__name__}: {exc}"
        record.end_s = time.perf_counter() - started
        return record

    async def _read_stream(self, response: aiohttp.ClientResponse, record: RequestRecord,
                           started: float) -> None:
        num_chunks = 0
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            payload = json.loads(line[6:])
            if "error" in payload:
                record.status, record.error = "error", _error_message(line[6:].decode())
                return
            if any(choice.get("text") for choice in payload.get("choices", ())):
                record.chunk_times_s.append(time.perf_counter() - started)
                num_chunks += 1
            if usage := payload.get("usage"):
                record.num_output_tokens = usage.get("completion_tokens", 0)
                details = usage.get("prompt_tokens_details") or {}
                record.num_cached_tokens = details.get("cached_tokens") or 0
        record.num_output_tokens = record.num_output_tokens or num_chunks


def _error_message(text: str) -> str:
    try:
        error = json.loads(text).get("error", {})
    except ValueError:
        return text[:200]
    return str(error.get("message", error))[:200] if isinstance(error, dict) else str(error)

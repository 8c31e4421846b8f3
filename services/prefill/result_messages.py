"""What a prefill's result tells the others: each choice's first token, to the gateway
(`TokenDelta`s: this is TTFT), and the commit that joins the request to its decode worker's
batch once the KV is there (`KvCommitted`).
"""

from __future__ import annotations

from typing import Any

from engine.protocol import FirstToken, PrefillResult
from services.kv_handoff import HandoffReport
from shared.messages import GenerateRequest, KvCommitted, TokenDelta, choice_id


def first_tokens(result: PrefillResult) -> list[FirstToken]:
    """Every choice's first token (one, unless n > 1)."""
    return [FirstToken(result.first_token_id, result.logprob, result.finish_reason),
            *result.forks]


def first_token_deltas(request: GenerateRequest, result: PrefillResult) -> list[TokenDelta]:
    """Each choice's first token, under the choice's own id (`choice_id`)."""
    n, asks = request.sampling.n, request.sampling.logprobs is not None
    return [TokenDelta(request_id=choice_id(request.request_id, choice, n),
                       index=request.output_offset, token_ids=[first.token_id],
                       finish_reason=first.finish_reason,
                       num_cached_tokens=result.num_cached_tokens,
                       logprobs=[first.logprob] if asks and first.logprob else None,
                       prompt_logprobs=result.prompt_logprobs)
            for choice, first in enumerate(first_tokens(result))]


def kv_committed(request: GenerateRequest, result: PrefillResult, report: HandoffReport,
                 prefill_worker_id: str) -> KvCommitted:
    """The commit of a request whose KV `report` says has landed at its decode worker."""
    asks = request.sampling.logprobs is not None
    return KvCommitted(
        request_id=request.request_id, prefill_worker_id=prefill_worker_id,
        first_token_id=result.first_token_id,
        num_prompt_tokens=len(request.prompt_token_ids),
        num_kv_bytes=report.num_bytes, transport=report.transport,
        kv_compression=report.compression, num_kv_wire_bytes=report.wire_bytes,
        first_logprob=result.logprob if asks else None,
        **_choices_commit(request, result),
    )


def _choices_commit(request: GenerateRequest, result: PrefillResult) -> dict[str, Any]:
    """The `KvCommitted` fields of an n > 1 request: each choice's first token."""
    if request.sampling.n == 1:
        return {}
    firsts = first_tokens(result)
    asks = request.sampling.logprobs is not None
    return {"first_token_ids": [f.token_id for f in firsts],
            "first_logprobs": [f.logprob for f in firsts if f.logprob] if asks else [],
            "finished_choices": [j for j, f in enumerate(firsts) if f.finish_reason]}

"""The sampler's controls against transformers' logits processors (and OpenAI's formula for
the presence and frequency penalties, which transformers lacks), on a real checkpoint's
logits; the engine's logprobs against transformers' `log_softmax`, prompt and output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers.generation import logits_process as hf

from engine import model_runner
from engine.protocol import PrefillRequest
from engine.sampler import Draw, apply_controls, prompt_logprobs, sample, warp
from engine.torch_engine import EngineOptions, TorchEngine
from shared.messages import SamplingParams
from tests.engine.hf_models import hf_model

PROMPT = [5, 17, 17, 40, 5, 9, 17, 63, 2, 40, 11]
OUTPUT_START = 7  # the last four tokens play earlier output


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> Any:
    return hf_model(llama_dir)


@pytest.fixture(scope="module")
def logits(reference: Any) -> torch.Tensor:
    """The checkpoint's next-token logits after PROMPT, `[1, V]`."""
    with torch.no_grad():
        return reference(torch.tensor([PROMPT])).logits[:, -1].float()


def controlled(logits: torch.Tensor, params: SamplingParams, eos: tuple[int, ...] = ()
               ) -> torch.Tensor:
    row = logits[0].clone()
    apply_controls(row, Draw(params, None, PROMPT, OUTPUT_START), eos)
    return row.unsqueeze(0)


def test_repetition_penalty_equals_transformers(logits: torch.Tensor) -> None:
    for penalty in (0.5, 1.3, 2.0):
        expected = hf.RepetitionPenaltyLogitsProcessor(penalty)(
            torch.tensor([PROMPT]), logits.clone())
        got = controlled(logits, SamplingParams(max_tokens=1, repetition_penalty=penalty))
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_frequency_and_presence_penalties_follow_openai_formula(logits: torch.Tensor) -> None:
    # logit[j] - count[j] * frequency_penalty - (count[j] > 0) * presence_penalty, over
    # the output tokens only.
    params = SamplingParams(max_tokens=1, frequency_penalty=0.7, presence_penalty=-1.1)
    expected = logits.clone()
    output = PROMPT[OUTPUT_START:]
    for token in set(output):
        expected[0, token] -= output.count(token) * 0.7 + 1 * -1.1
    torch.testing.assert_close(controlled(logits, params), expected, rtol=0, atol=1e-6)


def test_logit_bias_equals_transformers_sequence_bias(logits: torch.Tensor) -> None:
    bias = ((3, 100.0), (40, -100.0), (7, 2.5))
    expected = hf.SequenceBiasLogitsProcessor([[[t], b] for t, b in bias])(
        torch.tensor([PROMPT]), logits.clone())
    got = controlled(logits, SamplingParams(max_tokens=1, logit_bias=bias))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    (pick,) = sample(logits, [Draw(SamplingParams(max_tokens=1, temperature=0.0,
                                                  logit_bias=bias), None, PROMPT, 7)])
    assert pick.token_id == 3  # +100 wins; the logprob stays the model's own
    assert pick.logprob.logprob == pytest.approx(torch.log_softmax(logits, -1)[0, 3].item())


def test_min_tokens_masks_eos_and_stop_tokens_like_transformers(logits: torch.Tensor) -> None:
    eos = (2, 9)
    # Four output tokens so far: min_tokens 6 masks, min_tokens 4 no longer does.
    expected = hf.MinNewTokensLengthLogitsProcessor(OUTPUT_START, 6, list(eos))(
        torch.tensor([PROMPT]), logits.clone())
    got = controlled(logits, SamplingParams(max_tokens=1, min_tokens=6), eos)
    torch.testing.assert_close(got, expected)
    stops = controlled(logits, SamplingParams(max_tokens=1, min_tokens=6,
                                              stop_token_ids=(11,), ignore_eos=True), eos)
    assert stops[0, 11] == float("-inf") and torch.isfinite(stops[0, list(eos)]).all()
    torch.testing.assert_close(
        controlled(logits, SamplingParams(max_tokens=1, min_tokens=4), eos), logits)


def test_bad_words_mask_like_transformers_over_the_output(logits: torch.Tensor) -> None:
    """vLLM's bad words: a word's last token is masked where the output (not the prompt)
    ends with the rest of it; a one-token word always. Transformers' processor matches over
    the ids it is given: here the output alone."""
    output = PROMPT[OUTPUT_START:]  # [63, 2, 40, 11]
    words = ((3,), (40, 11, 5), (2, 40, 8), (17, 63, 2, 40, 11, 12), (11, 6))
    expected = hf.NoBadWordsLogitsProcessor([list(w) for w in words], eos_token_id=None)(
        torch.tensor([output]), logits.clone())
    got = controlled(logits, SamplingParams(max_tokens=1, bad_words=words))
    torch.testing.assert_close(got, expected)
    assert {t for t in range(logits.shape[-1]) if got[0, t] == float("-inf")} == {3, 5, 6}


def test_allowed_token_ids_keep_only_those_tokens(logits: torch.Tensor) -> None:
    allowed = (4, 40, 63)
    expected = hf.PrefixConstrainedLogitsProcessor(lambda batch, ids: list(allowed), 1)(
        torch.tensor([PROMPT]), logits.clone())
    got = controlled(logits, SamplingParams(max_tokens=1, allowed_token_ids=allowed))
    torch.testing.assert_close(got, expected)
    params = SamplingParams(max_tokens=1, temperature=2.0, allowed_token_ids=allowed)
    drawn = {sample(logits, [Draw(params, seed, PROMPT, OUTPUT_START)])[0].token_id
             for seed in range(40)}
    assert drawn <= set(allowed) and len(drawn) > 1


def test_a_filter_that_would_leave_no_token_yields(logits: torch.Tensor) -> None:
    """Allowing only eos while min_tokens bans it, or banning every allowed token: the later
    mask is not applied (a pick, not an empty row that would draw nothing)."""
    eos = (2,)
    only_eos = controlled(logits, SamplingParams(max_tokens=1, allowed_token_ids=eos,
                                                 min_tokens=9), eos)
    assert torch.isfinite(only_eos[0]).nonzero().flatten().tolist() == [2]
    params = SamplingParams(max_tokens=1, temperature=1.0, allowed_token_ids=(4, 5),
                            bad_words=((4,), (5,)))
    (pick,) = sample(logits, [Draw(params, 1, PROMPT, OUTPUT_START)])
    assert pick.token_id in (4, 5)


@pytest.mark.parametrize(("params", "warper"), [
    (SamplingParams(max_tokens=1, temperature=0.7, min_p=0.05),
     [hf.TemperatureLogitsWarper(0.7), hf.MinPLogitsWarper(0.05)]),
    (SamplingParams(max_tokens=1, temperature=1.3, top_k=12),
     [hf.TemperatureLogitsWarper(1.3), hf.TopKLogitsWarper(12)]),
    (SamplingParams(max_tokens=1, temperature=0.9, top_p=0.6),
     [hf.TemperatureLogitsWarper(0.9), hf.TopPLogitsWarper(0.6)]),
    (SamplingParams(max_tokens=1, temperature=0.9, top_p=0.0),  # the likeliest token alone
     [hf.TemperatureLogitsWarper(0.9), hf.TopPLogitsWarper(0.0)]),
])
def test_warpers_keep_the_tokens_transformers_keeps(
        logits: torch.Tensor, params: SamplingParams, warper: list[Any]) -> None:
    expected = hf.LogitsProcessorList(warper)(torch.tensor([PROMPT]), logits.clone())[0]
    got = warp(logits[0].clone(), params)
    assert torch.equal(torch.isfinite(got), torch.isfinite(expected))
    kept = torch.isfinite(got)
    torch.testing.assert_close(got[kept], expected[kept])


def test_top_logprobs_are_the_most_likely_tokens(logits: torch.Tensor) -> None:
    params = SamplingParams(max_tokens=1, temperature=1.0, seed=3, logprobs=5)
    (pick,) = sample(logits, [Draw(params, 3, PROMPT, 7)])
    log_probs = torch.log_softmax(logits[0], -1)
    values, ids = torch.topk(log_probs, 5)
    assert [t for t, _ in pick.logprob.top] == ids.tolist()
    assert [v for _, v in pick.logprob.top] == pytest.approx(values.tolist())
    assert pick.logprob.logprob == pytest.approx(log_probs[pick.token_id].item())
    rows = prompt_logprobs(logits.repeat(2, 1), [4, 8], 0)
    assert [r.logprob for r in rows] == pytest.approx([log_probs[4].item(),
                                                       log_probs[8].item()])
    assert rows[0].top == []


@pytest.mark.parametrize("rows_per_pass", [model_runner.SCORED_ROWS_PER_PASS, 3])
async def test_engine_logprobs_equal_transformers_log_softmax(
        llama_dir: Path, reference: Any, rows_per_pass: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompt logprobs (a prefill that also has the prompt in its prefix cache; scored a
    chunk at a time, or a few rows at a time) and every output token's, first (prefill) and
    later (decode), within 1e-4."""
    monkeypatch.setattr(model_runner, "SCORED_ROWS_PER_PASS", rows_per_pass)
    engine = TorchEngine(EngineOptions(model_dir=llama_dir, num_blocks=64, block_size=4,
                                       max_batch_tokens=8))  # the prompt spans two chunks
    await engine.start()
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3,
                                prompt_logprobs=2)
        warm = await engine.prefill(PrefillRequest("warm", PROMPT, params))
        engine.release("warm")
        result = await engine.prefill(PrefillRequest("p", PROMPT, params))
        engine.release("p")
        engine.generate(PrefillRequest("g", PROMPT, params))
        outputs = []
        while not outputs or outputs[-1].finish_reason is None:
            outputs += await engine.next_step()
    finally:
        await engine.close()
    assert result.num_cached_tokens == 0  # computed whole though the cache holds it
    tokens = [o.token_id for o in outputs]
    assert tokens[0] == result.first_token_id == warm.first_token_id
    with torch.no_grad():
        expected = torch.log_softmax(
            reference(torch.tensor([PROMPT + tokens])).logits[0].float(), -1)
    got_prompt = result.prompt_logprobs
    assert got_prompt is not None and outputs[0].prompt_logprobs == got_prompt
    assert len(got_prompt) == len(PROMPT) and got_prompt[0].logprob is None
    for position in range(1, len(PROMPT)):
        entry = got_prompt[position]
        row = expected[position - 1]
        assert entry.logprob == pytest.approx(row[PROMPT[position]].item(), abs=1e-4)
        assert entry.rank == int((row > row[PROMPT[position]]).sum()) + 1
        assert len(entry.top) == 2
    for i, output in enumerate(outputs):
        row = expected[len(PROMPT) - 1 + i]
        assert output.logprob is not None
        assert output.logprob.logprob == pytest.approx(row[output.token_id].item(), abs=1e-4)
        assert [t for t, _ in output.logprob.top] == torch.topk(row, 3).indices.tolist()

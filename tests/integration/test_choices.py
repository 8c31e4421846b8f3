"""n > 1 through the `openai` SDK: the prompt is prefilled once and its KV moved once, then
decode forks it into n choices, each with its own random stream; streamed choices
interleave by index; usage counts the prompt once."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from shared.metrics import PrefillMetrics
from tests.stack import PATHS, Stack, torch_stack_on

pytestmark = pytest.mark.e2e

MODEL = "halfmoon-tiny"
PROMPT = "The half moon rose over the quiet harbour while the boats"


@pytest.fixture(params=PATHS)
async def stack(request: pytest.FixtureRequest, nats_url: str, tiny_dir: Path
                ) -> AsyncIterator[Stack]:
    async with torch_stack_on(request.param, nats_url, str(tiny_dir), num_blocks=512,
                              enable_prefix_caching=False) as running:
        yield running


def counter(metrics: PrefillMetrics | Any, name: str) -> float:
    return sum(sample.value for metric in metrics.registry.collect()
               for sample in metric.samples if sample.name == name)


async def test_n_choices_cost_one_prefill_and_one_transfer(stack: Stack) -> None:
    async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="x", max_retries=0) as sdk:
        workers = [*stack.prefills, *stack.decodes]

        def computed() -> int:
            return sum(w.engine.stats().num_prompt_tokens_computed for w in workers)

        def moved() -> float:
            return sum(counter(w.metrics, "halfmoon_kv_transfer_bytes_total") for w in workers)

        async def spend(**options: Any) -> tuple[Any, float, float]:
            tokens, kv_bytes = computed(), moved()
            response = await sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                                    extra_body={"ignore_eos": True}, **options)
            return response, computed() - tokens, moved() - kv_bytes

        one, one_tokens, one_bytes = await spend(temperature=1.0, seed=3)
        four, four_tokens, four_bytes = await spend(temperature=1.0, seed=3, n=4)
        greedy, _, _ = await spend(temperature=0.0, n=3)
    assert four_tokens == one_tokens > 0 and four_bytes == one_bytes
    if stack.prefills:
        assert one_bytes > 0  # the KV did cross, once
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    assert len({c.text for c in four.choices}) > 1  # sampled: choices differ
    assert four.choices[0].text == one.choices[0].text  # choice 0 draws from `seed`
    assert len({c.text for c in greedy.choices}) == 1  # greedy: all equal
    assert four.usage is not None and one.usage is not None
    assert four.usage.prompt_tokens == one.usage.prompt_tokens
    assert four.usage.completion_tokens == 4 * one.usage.completion_tokens
    await stack.wait_blocks_free(timeout_s=10)


async def test_the_most_choices_openai_allows_fork_off_one_prefill(stack: Stack) -> None:
    """n = 128 (pass@k evaluations sample as many): every choice its own 4 tokens, choice 0
    what n = 1 draws from the seed, and the same choices again for the same seed."""
    async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="x", max_retries=0) as sdk:
        async def draw(n: int) -> Any:
            return await sdk.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=4, n=n, temperature=1.0, seed=17,
                extra_body={"ignore_eos": True})

        many, again, one = await draw(128), await draw(128), await draw(1)
    assert [c.index for c in many.choices] == list(range(128))
    assert many.usage is not None and many.usage.completion_tokens == 128 * 4
    assert [c.text for c in again.choices] == [c.text for c in many.choices]
    assert many.choices[0].text == one.choices[0].text
    assert len({c.text for c in many.choices}) > 64  # each its own random stream
    await stack.wait_blocks_free(timeout_s=10)


async def test_streamed_choices_interleave_by_index(stack: Stack) -> None:
    async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="x", max_retries=0) as sdk:
        whole = await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me."}], max_tokens=6,
            temperature=0.8, seed=9, n=3, extra_body={"ignore_eos": True})
        stream = await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me."}], max_tokens=6,
            temperature=0.8, seed=9, n=3, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        texts, finishes, usage, order = ["", "", ""], [None] * 3, None, []
        async for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                finishes[choice.index] = choice.finish_reason or finishes[choice.index]
                order.append(choice.index)
            usage = chunk.usage or usage
    assert texts == [c.message.content for c in whole.choices]
    assert finishes == ["length"] * 3 and set(order) == {0, 1, 2}
    assert usage is not None and whole.usage is not None
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == 18
    await stack.wait_blocks_free(timeout_s=10)


async def test_several_prompts_times_n_are_numbered_in_order(stack: Stack) -> None:
    async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="x", max_retries=0) as sdk:
        singles = [await sdk.completions.create(
            model=MODEL, prompt=p, max_tokens=4, n=2, temperature=0.9, seed=5,
            extra_body={"ignore_eos": True}) for p in ("Once upon", "The moon")]
        both = await sdk.completions.create(
            model=MODEL, prompt=["Once upon", "The moon"], max_tokens=4, n=2, temperature=0.9,
            seed=5, extra_body={"ignore_eos": True})
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [c.text for s in singles for c in s.choices]
    assert both.usage is not None and both.usage.completion_tokens == 16
    assert both.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)  # type: ignore[union-attr]


async def test_a_stop_string_ends_one_choice_only(stack: Stack) -> None:
    async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="x", max_retries=0) as sdk:
        free = await sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                            temperature=1.0, seed=21, n=2,
                                            extra_body={"ignore_eos": True})
        text = free.choices[0].text
        stop = text[len(text) // 2:len(text) // 2 + 2]
        if not stop.strip() or stop in free.choices[1].text:
            pytest.skip("no stop string that only choice 0 contains")
        cut = await sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                           temperature=1.0, seed=21, n=2, stop=[stop],
                                           extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    assert cut.choices[1].text == free.choices[1].text
    assert cut.choices[1].finish_reason == "length"
    await stack.wait_blocks_free(timeout_s=10)


async def test_best_of_returns_the_candidates_of_highest_cumulative_logprob(
        stack: Stack) -> None:
    """best_of draws its candidates as n does (candidate j from `seed + j`) and returns the
    n whose tokens' logprobs sum highest, numbered per prompt; usage counts every candidate,
    as they were all generated."""
    async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="x", max_retries=0) as sdk:
        options: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "temperature": 1.0,
                                   "seed": 11, "extra_body": {"ignore_eos": True}}
        candidates = [await sdk.completions.create(prompt=p, n=4, logprobs=0, **options)
                      for p in ("Once upon", "The moon")]
        best = await sdk.completions.create(prompt=["Once upon", "The moon"], n=2, best_of=4,
                                            **options)
        echoed = await sdk.completions.create(prompt="Once upon", n=2, best_of=4, echo=True,
                                              **options)
    expected = []
    for response in candidates:
        ranked = sorted(response.choices,
                        key=lambda c: -sum(c.logprobs.token_logprobs))  # type: ignore[union-attr,arg-type]
        assert len({c.text for c in ranked}) > 1  # sampled: the ranking picks
        expected += [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1, 2, 3]
    assert [c.text for c in best.choices] == expected
    assert [c.text for c in echoed.choices] == ["Once upon" + t for t in expected[:2]]
    assert all(c.logprobs is None for c in best.choices)  # not asked for
    assert best.usage is not None and best.usage.completion_tokens == 2 * 4 * 6
    assert best.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in candidates)  # type: ignore[union-attr]
    await stack.wait_blocks_free(timeout_s=10)

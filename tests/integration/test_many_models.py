"""Two checkpoints served by one cluster: each answers with its own weights, tokenizer, chat
template and context limit, and no request reaches a worker of the other model."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest

from engine.builtin_model import write_builtin_model
from services.gateway.chat_template import ChatTemplate
from services.gateway.tokenizer import HfTokenizer
from services.worker import DecodeService, PrefillService
from tests.engine.hf_models import greedy_reference, hf_model
from tests.integration.test_events import subscriber
from tests.stack import Stack, eventually

pytestmark = pytest.mark.e2e

PROMPT = "The half moon rose over the quiet harbour"
NUM_TOKENS = 6
# beta's own template: not ChatML, so a prompt rendered with alpha's would count otherwise.
BETA_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "assistant:")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """alpha: the built-in model's shape; beta: smaller, another vocabulary, a 512-token
    context and its own chat template."""
    root = tmp_path_factory.mktemp("models")
    alpha = write_builtin_model(root / "alpha", seed=0)
    beta = write_builtin_model(root / "beta", seed=7, hidden_size=64, num_layers=2,
                               vocab_size=600, max_position_embeddings=512)
    config_path = beta / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": BETA_TEMPLATE}))
    return {"alpha": alpha, "beta": beta}


@pytest.fixture
async def stack(nats_url: str, checkpoints: dict[str, Path]) -> AsyncIterator[Stack]:
    """One prefill and one decode worker per model; the gateway is told of alpha only and
    finds beta's files from its workers' heartbeats."""
    alpha, beta = str(checkpoints["alpha"]), str(checkpoints["beta"])
    running = Stack(nats_url, worker={"engine": "torch", "num_blocks": 256,
                                      "model": "alpha", "model_path": alpha},
                    gateway_options={"model": "alpha", "model_path": alpha})
    beta_worker = running.worker_config(model="beta", model_path=beta)
    running.prefills.append(PrefillService(beta_worker))
    running.decodes.append(DecodeService(beta_worker))
    async with running:
        await eventually(lambda: running.gateway.health()["models"].get("beta", {}).get(
            "is_ready", False), timeout_s=10)
        yield running


def workers_of(stack: Stack, model: str) -> set[str]:
    return {w.worker_id for w in [*stack.prefills, *stack.decodes] if w.config.model == model}


async def test_each_model_answers_greedy_as_transformers_on_its_own_checkpoint(
        stack: Stack, checkpoints: dict[str, Path]) -> None:
    async with subscriber(stack) as events, openai.AsyncOpenAI(
            base_url=stack.base_url, api_key="x", max_retries=0) as sdk:
        listed = {m.id: m.model_extra["max_model_len"] for m in (await sdk.models.list()).data}
        assert listed == {"alpha": 2048, "beta": 512}
        answers = {}
        for model, path in checkpoints.items():
            tokenizer = HfTokenizer(path)
            prompt = tokenizer.encode(PROMPT, add_special_tokens=True)
            expected, _ = greedy_reference(hf_model(path), prompt, NUM_TOKENS)
            answer = await sdk.completions.create(model=model, prompt=PROMPT, temperature=0,
                                                  max_tokens=NUM_TOKENS)
            assert answer.model == model
            assert answer.usage is not None and answer.usage.prompt_tokens == len(prompt)
            assert answer.choices[0].text == tokenizer.decode(expected)
            answers[model] = answer.id
        await eventually(lambda: {e.request_id for e in events if e.kind == "finished"}
                         >= set(answers.values()))
    for model, request_id in answers.items():
        [done] = [e for e in events if e.kind == "finished" and e.request_id == request_id]
        assert done.model == model
        assert {done.prefill_worker_id, done.decode_worker_id} <= workers_of(stack, model)


async def test_each_model_renders_chat_with_its_own_template(
        stack: Stack, checkpoints: dict[str, Path]) -> None:
    messages = [{"role": "user", "content": "hi there"}]
    async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="x", max_retries=0) as sdk:
        for model, path in checkpoints.items():
            tokenizer = HfTokenizer(path)
            template = ChatTemplate(tokenizer.chat_template or "")
            text = template.render(messages, bos_token=tokenizer.bos_token,
                                   eos_token=tokenizer.eos_token)
            chat = await sdk.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                                     max_tokens=2, temperature=0)
            assert chat.usage is not None
            assert chat.usage.prompt_tokens == len(tokenizer.encode(text))
    assert "assistant:" in BETA_TEMPLATE and "assistant:" not in (
        HfTokenizer(checkpoints["alpha"]).chat_template or "")


async def test_each_model_keeps_its_own_context_limit(stack: Stack) -> None:
    long_prompt = [5] * 600  # a token id both vocabularies hold
    status, body = await stack.post("/v1/completions", {
        "model": "beta", "prompt": long_prompt, "max_tokens": 1})
    assert status == 400
    assert "maximum context length is 512" in body["error"]["message"]
    status, _ = await stack.post("/v1/completions", {
        "model": "alpha", "prompt": long_prompt, "max_tokens": 1})
    assert status == 200


async def test_a_model_no_worker_serves_is_not_found(stack: Stack) -> None:
    status, body = await stack.post("/v1/completions", {
        "model": "gamma", "prompt": "hi", "max_tokens": 2})
    assert status == 404
    assert body["error"]["param"] == "model" and "gamma" in body["error"]["message"]

"""Our engine against Hugging Face transformers on the same checkpoints (float32)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from engine.attention import AttentionMetadata, SequenceSlice
from engine.kv_cache import KvCache
from engine.model import CausalLM
from engine.model_config import ModelConfig
from engine.protocol import DecodeRequest, PrefillRequest
from engine.torch_engine import EngineOptions, TorchEngine
from engine.weights import load_weights
from shared.messages import SamplingParams
from tests.engine.hf_models import hf_model

PROMPTS = [[(7 * i + 3 * j) % 290 + 5 for j in range(n)]
           for i, n in enumerate([5, 17, 33, 1, 48, 9, 24, 16])]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def hf_greedy(hf: object, prompt: list[int], num_tokens: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = hf(torch.tensor([ids])).logits[0, -1]  # type: ignore[operator]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def references(llama_dir: Path, qwen2_dir: Path) -> dict[Path, list[list[int]]]:
    out = {}
    for path in (llama_dir, qwen2_dir):
        hf = hf_model(path)
        out[path] = [hf_greedy(hf, p, 32) for p in PROMPTS]
    return out


async def start_engine(model_dir: Path, **options: object) -> TorchEngine:
    engine = TorchEngine(EngineOptions(model_dir=model_dir, **{  # type: ignore[arg-type]
        "num_blocks": 256, "block_size": 4, **options}))
    await engine.start()
    return engine


async def collect(engine: TorchEngine, request_ids: set[str]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {r: [] for r in request_ids}
    pending = set(request_ids)
    async with asyncio.timeout(60):
        while pending:
            for out in await engine.next_step():
                assert out.error is None, out.error
                tokens[out.request_id].append(out.token_id)
                if out.finish_reason is not None:
                    pending.discard(out.request_id)
    return tokens


async def generate(engine: TorchEngine, prompts: list[list[int]], tag: str = "r"
                   ) -> list[list[int]]:
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.generate(PrefillRequest(request_id, prompt, GREEDY))
    tokens = await collect(engine, set(ids))
    return [tokens[r] for r in ids]


@pytest.fixture(scope="module", params=["llama2-linear", "mistral", "qwen3", "qwen3_moe"])
def other_family_dir(request: pytest.FixtureRequest,
                     tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.engine.hf_models import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def test_logits_match_for_the_other_families(other_family_dir: Path) -> None:
    test_logits_of_a_mixed_length_batch_match(other_family_dir)


async def test_greedy_generation_matches_for_the_other_families(other_family_dir: Path) -> None:
    """Batched (8 prompts at once), so a routed MLP sees tokens of several sequences."""
    hf = hf_model(other_family_dir)
    expected = [hf_greedy(hf, prompt, 32) for prompt in PROMPTS]
    engine = await start_engine(other_family_dir, max_batch_size=8)
    try:
        assert await generate(engine, PROMPTS) == expected
    finally:
        await engine.close()


def test_logits_of_a_mixed_length_batch_match(model_dir: Path) -> None:
    config = ModelConfig.from_dir(model_dir)
    model = CausalLM(config)
    load_weights(model, model_dir, torch.float32)
    model.init_runtime(512, torch.device("cpu"))
    kv = KvCache(num_layers=config.num_layers, num_blocks=64, block_size=4,
                 num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                 dtype=torch.float32, device=torch.device("cpu"))
    prompts = PROMPTS[:5]
    slices, slots, next_block, offset = [], [], 0, 0
    for prompt in prompts:
        blocks = torch.arange(next_block, next_block + (len(prompt) + 3) // 4)
        next_block += len(blocks)
        pos = torch.arange(len(prompt))
        slots.append(blocks[pos // 4] * 4 + pos % 4)
        slices.append(SequenceSlice(offset, len(prompt), len(prompt), blocks.tolist()))
        offset += len(prompt)
    with torch.inference_mode():
        hidden = model(torch.tensor([t for p in prompts for t in p]),
                       torch.cat([torch.arange(len(p)) for p in prompts]),
                       AttentionMetadata(torch.cat(slots), slices), kv)
        ours = model.logits(hidden)
    hf = hf_model(model_dir)
    with torch.no_grad():
        reference = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
    relative = (ours - reference).norm() / reference.norm()
    assert relative < 1e-4


@pytest.mark.parametrize("batch_size", [1, 8])
@pytest.mark.parametrize("is_prefix_caching", [False, True])
async def test_greedy_generation_matches(
    model_dir: Path, references: dict[Path, list[list[int]]], batch_size: int,
    is_prefix_caching: bool,
) -> None:
    engine = await start_engine(model_dir, is_prefix_caching=is_prefix_caching,
                                max_batch_size=batch_size)
    try:
        # Twice: the second round reuses the prefix cache when it is on.
        for round_ in range(2):
            assert await generate(engine, PROMPTS, f"r{round_}-") == references[model_dir]
        if is_prefix_caching:
            assert engine.allocator.num_cached > 0
    finally:
        await engine.close()


async def test_chunked_prefill_gives_the_same_tokens(
    model_dir: Path, references: dict[Path, list[list[int]]],
) -> None:
    engine = await start_engine(model_dir, max_batch_tokens=7)
    try:
        assert await generate(engine, PROMPTS) == references[model_dir]
    finally:
        await engine.close()


async def test_prefill_on_one_engine_decode_on_another(
    model_dir: Path, references: dict[Path, list[list[int]]],
) -> None:
    """The disaggregation invariant: KV copied into other block ids decodes the same."""
    prefill_engine = await start_engine(model_dir)
    decode_engine = await start_engine(model_dir)
    try:
        decode_engine.reserve("pad", 40)  # so the decode side's block ids differ
        outputs: dict[str, list[int]] = {}
        for i, prompt in enumerate(PROMPTS):
            request_id = f"d{i}"
            result = await prefill_engine.prefill(PrefillRequest(request_id, prompt, GREEDY))
            targets = decode_engine.reserve(request_id, len(prompt) + GREEDY.max_tokens)
            assert targets[: len(result.block_ids)] != result.block_ids
            source = prefill_engine.kv.data[:, :, result.block_ids]  # type: ignore[union-attr]
            decode_engine.kv.data[:, :, targets[: len(result.block_ids)]] = source  # type: ignore[union-attr]
            prefill_engine.release(request_id)
            decode_engine.join(DecodeRequest(request_id, prompt, result.first_token_id, GREEDY))
            rest = await collect(decode_engine, {request_id})
            outputs[request_id] = [result.first_token_id, *rest[request_id]]
        assert [outputs[f"d{i}"] for i in range(len(PROMPTS))] == references[model_dir]
    finally:
        await prefill_engine.close()
        await decode_engine.close()


async def test_decode_can_recompute_the_prompt_when_no_kv_arrives(
    llama_dir: Path, references: dict[Path, list[list[int]]],
) -> None:
    engine = await start_engine(llama_dir)
    try:
        prompt, expected = PROMPTS[2], references[llama_dir][2]
        engine.reserve("x", len(prompt) + 32)
        engine.join(DecodeRequest("x", prompt, expected[0], GREEDY, is_kv_ready=False))
        assert (await collect(engine, {"x"}))["x"] == expected[1:]
    finally:
        await engine.close()


async def test_builtin_model_is_a_hugging_face_checkpoint(tmp_path: Path) -> None:
    from engine.builtin_model import write_builtin_model

    model_dir = write_builtin_model(tmp_path / "tiny")
    hf = hf_model(model_dir)
    prompt = [5, 100, 200, 300, 7]
    engine = await start_engine(model_dir)
    try:
        ours = await generate(engine, [prompt])
    finally:
        await engine.close()
    assert ours == [hf_greedy(hf, prompt, 32)]

"""Decode steps through graphs' static buffers: padded to batch and context buckets, the
tokens are those of the plain engine. On a CPU the buffers run without a graph ("eager"),
which checks everything but the CUDA capture; that runs where a CUDA device exists (`gpu`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.protocol import PrefillRequest
from shared.errors import ConfigError
from shared.messages import SamplingParams
from tests.engine.test_against_transformers import collect, start_engine

# Contexts from 9 to 130 tokens (blocks of 4: the 64-, 128- and 256-token buckets); outputs
# of different lengths, so the batch shrinks from 7 through every size to 1.
PROMPTS = [[(13 * i + 7 * j) % 250 + 3 for j in range(9 + 15 * i)] for i in range(7)]


async def greedy(engine: object, prompts: list[list[int]]) -> list[list[int]]:
    ids = [f"g{i}" for i in range(len(prompts))]
    for i, (request_id, prompt) in enumerate(zip(ids, prompts, strict=True)):
        sampling = SamplingParams(max_tokens=6 + 4 * i, temperature=0.0, ignore_eos=True)
        engine.generate(PrefillRequest(request_id, prompt, sampling))  # type: ignore[attr-defined]
    tokens = await collect(engine, set(ids))  # type: ignore[arg-type]
    return [tokens[r] for r in ids]


@pytest.mark.parametrize("mode", ["eager", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                        reason="no CUDA device: graph capture is untested")])])
async def test_graph_decode_steps_give_the_plain_engines_tokens(llama_dir: Path,
                                                                mode: str) -> None:
    device = "cuda" if mode == "cuda" else "cpu"
    plain = await start_engine(llama_dir, device=device, attention_backend="torch")
    try:
        expected = await greedy(plain, PROMPTS)
    finally:
        await plain.close()
    graphed = await start_engine(llama_dir, device=device, attention_backend="torch",
                                 decode_graphs=mode)
    try:
        assert await greedy(graphed, PROMPTS) == expected
        assert graphed.num_decode_graphs >= 4  # several batch and context buckets
        stats = graphed.stats()
        assert stats.num_free_blocks == stats.num_total_blocks - 1  # the padding rows' block
    finally:
        await graphed.close()


async def test_cuda_graphs_need_a_cuda_device(llama_dir: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        await start_engine(llama_dir, decode_graphs="cuda", attention_backend="torch")


async def test_a_cuda_device_this_torch_cannot_see_is_a_config_error(llama_dir: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    with pytest.raises(ConfigError, match="--device cuda: this torch build sees no CUDA"):
        await start_engine(llama_dir, device="cuda")


async def test_decode_graphs_need_the_batched_torch_attention(llama_dir: Path) -> None:
    with pytest.raises(ConfigError, match="--attention-backend torch"):
        await start_engine(llama_dir, decode_graphs="eager", attention_backend="reference")

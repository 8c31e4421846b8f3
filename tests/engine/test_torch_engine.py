"""TorchEngine behaviour: sampling, stopping, aborts, capacity, block accounting."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from engine.protocol import PrefillRequest, TokenOutput
from engine.sampler import Draw, sample
from engine.torch_engine import EngineOptions, TorchEngine
from shared.errors import CapacityExhausted, InvalidRequest
from shared.messages import SamplingParams
from tests.stack import eventually

PROMPT = list(range(10, 30))


@pytest.fixture
async def engine(llama_dir: Path) -> AsyncIterator[TorchEngine]:
    running = TorchEngine(EngineOptions(model_dir=llama_dir, num_blocks=64, block_size=4))
    await running.start()
    yield running
    await running.close()


def check_blocks(engine: TorchEngine) -> None:
    a = engine.allocator
    assert a.num_free + a.num_used + a.num_cached == a.num_blocks


async def run(engine: TorchEngine, request_id: str, params: SamplingParams,
              prompt: list[int] = PROMPT) -> list[TokenOutput]:
    engine.generate(PrefillRequest(request_id, prompt, params))
    outputs: list[TokenOutput] = []
    async with asyncio.timeout(30):
        while not outputs or (outputs[-1].finish_reason is None and outputs[-1].error is None):
            outputs += [o for o in await engine.next_step() if o.request_id == request_id]
    return outputs


async def test_same_seed_same_tokens_other_seed_other_tokens(engine: TorchEngine) -> None:
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=42, ignore_eos=True)
    first = [o.token_id for o in await run(engine, "a", params)]
    again = [o.token_id for o in await run(engine, "b", params)]
    other = [o.token_id for o in await run(engine, "c", SamplingParams(
        max_tokens=16, temperature=1.0, seed=43, ignore_eos=True))]
    assert first == again
    assert first != other


async def test_max_tokens_ends_with_length_and_frees_blocks(engine: TorchEngine) -> None:
    outputs = await run(engine, "a", SamplingParams(max_tokens=5, temperature=0.0,
                                                    ignore_eos=True))
    assert [o.index for o in outputs] == [0, 1, 2, 3, 4]
    assert outputs[-1].finish_reason == "length"
    check_blocks(engine)
    assert engine.allocator.num_used == 0


async def test_stop_token_ends_with_stop(engine: TorchEngine) -> None:
    greedy = await run(engine, "a", SamplingParams(max_tokens=8, temperature=0.0,
                                                   ignore_eos=True))
    stop_id = greedy[3].token_id
    outputs = await run(engine, "b", SamplingParams(max_tokens=8, temperature=0.0,
                                                    stop_token_ids=(stop_id,), ignore_eos=True))
    first_stop = [o.token_id for o in greedy].index(stop_id)
    assert len(outputs) == first_stop + 1
    assert outputs[-1].finish_reason == "stop"


async def test_logprobs_are_those_of_the_chosen_tokens(engine: TorchEngine) -> None:
    outputs = await run(engine, "a", SamplingParams(max_tokens=4, temperature=0.0,
                                                    ignore_eos=True))
    assert all(o.logprob is not None and o.logprob.logprob is not None
               and o.logprob.logprob <= 0.0 for o in outputs)


def test_top_k_one_is_greedy_and_top_p_keeps_the_first_token() -> None:
    logits = torch.tensor([[0.1, 3.0, 0.2, 2.9]])
    for params in (SamplingParams(max_tokens=1, top_k=1, seed=1),
                   SamplingParams(max_tokens=1, top_p=0.01, seed=1)):
        (pick,) = sample(logits, [Draw(params, 0, [], 0)])
        assert pick.token_id == 1
        assert pick.logprob.logprob == pytest.approx(
            torch.log_softmax(logits, -1)[0, 1].item())


async def test_abort_mid_decode_frees_every_block(engine: TorchEngine) -> None:
    engine.generate(PrefillRequest("long", PROMPT, SamplingParams(
        max_tokens=200, temperature=0.0, ignore_eos=True)))
    await eventually(lambda: engine.stats().num_running == 1)
    assert engine.abort("long")
    await eventually(lambda: engine.allocator.num_used == 0)
    check_blocks(engine)


async def test_a_prefill_placed_again_while_its_aborted_run_computes_gets_its_own_result(
        engine: TorchEngine) -> None:
    """The first run of "p" is cancelled by its caller (an abort) while the engine thread is
    in its last layer; the request is placed here again before that step ends. The first
    run's result must not answer the second run, and neither run's blocks may leak."""
    in_last_layer, go_on = threading.Event(), threading.Event()
    num_layers = engine.kv_layout().num_layers

    def hold_last_layer(layer: int, block_ids: list[int]) -> None:  # engine thread
        if layer == num_layers - 1:
            in_last_layer.set()
            go_on.wait(10)

    params = SamplingParams(max_tokens=4, temperature=0.0)
    first = asyncio.create_task(engine.prefill(PrefillRequest(
        "p", PROMPT, params, on_layer=hold_last_layer)))
    await asyncio.to_thread(in_last_layer.wait, 10)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    layers_of_second: list[int] = []

    def count_layer(layer: int, block_ids: list[int]) -> None:
        layers_of_second.append(layer)

    second = asyncio.create_task(engine.prefill(PrefillRequest(
        "p", PROMPT, params, on_layer=count_layer)))
    await asyncio.sleep(0)  # the second run is registered before the first one's step ends
    go_on.set()
    result = await asyncio.wait_for(second, 30)
    assert layers_of_second == list(range(num_layers))  # computed before it was answered
    assert engine.allocator.num_used == len(result.block_ids)
    engine.release("p")
    await eventually(lambda: engine.allocator.num_used == 0)
    check_blocks(engine)


async def test_prefill_holds_kv_until_release_then_caches_it(engine: TorchEngine) -> None:
    result = await engine.prefill(PrefillRequest("p", PROMPT, SamplingParams(
        max_tokens=4, temperature=0.0)))
    assert engine.allocator.num_used == len(result.block_ids) == 5
    engine.release("p")
    await eventually(lambda: engine.allocator.num_used == 0)
    assert engine.allocator.num_cached == 5  # every full prompt block stays reusable
    again = await engine.prefill(PrefillRequest("q", PROMPT, SamplingParams(
        max_tokens=4, temperature=0.0)))
    assert again.num_cached_tokens == 16  # all but the last block: one token must be computed
    assert again.first_token_id == result.first_token_id
    engine.release("q")
    check_blocks(engine)


async def test_reserve_beyond_the_pool_raises_capacity_exhausted(engine: TorchEngine) -> None:
    with pytest.raises(CapacityExhausted, match="need 100 KV blocks"):
        engine.reserve("big", 400)
    check_blocks(engine)


async def test_prompt_with_unknown_token_ids_is_refused(engine: TorchEngine) -> None:
    with pytest.raises(InvalidRequest, match="token ids must lie in"):
        await engine.prefill(PrefillRequest("bad", [1, 5000], SamplingParams(max_tokens=1)))


async def test_prompt_larger_than_the_pool_fails_that_request_only(engine: TorchEngine) -> None:
    """The pool caps the context: such a prompt is past it."""
    with pytest.raises(InvalidRequest, match="does not fit the context"):
        await engine.prefill(PrefillRequest("huge", list(range(300)), SamplingParams(
            max_tokens=1)))
    outputs = await run(engine, "ok", SamplingParams(max_tokens=3, temperature=0.0,
                                                     ignore_eos=True))
    assert len(outputs) == 3
    check_blocks(engine)


async def test_each_layer_reports_once_when_the_prompt_completes(llama_dir: Path) -> None:
    engine = TorchEngine(EngineOptions(model_dir=llama_dir, num_blocks=64, block_size=4,
                                       max_batch_tokens=8))
    await engine.start()
    reports: list[tuple[int, list[int]]] = []
    try:
        result = await engine.prefill(PrefillRequest(
            "p", PROMPT, SamplingParams(max_tokens=1),
            on_layer=lambda layer, block_ids: reports.append((layer, block_ids))))
    finally:
        await engine.close()
    num_layers = engine.config.num_layers
    # 20 tokens in chunks of 8: three steps; only the last one (the prompt is then whole)
    # reports, every layer in order, with all five blocks.
    assert [layer for layer, _ in reports] == list(range(num_layers))
    assert all(block_ids == result.block_ids for _, block_ids in reports)
    assert len(result.block_ids) == 5


async def test_sharded_checkpoint_loads_like_a_single_file(tmp_path: Path,
                                                          llama_dir: Path) -> None:
    from tests.engine.hf_models import hf_model

    hf_model(llama_dir).save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    results = []
    for path in (llama_dir, tmp_path / "sharded"):
        engine = TorchEngine(EngineOptions(model_dir=path, num_blocks=64, block_size=4))
        await engine.start()
        try:
            results.append([o.token_id for o in await run(engine, "s", params)])
        finally:
            await engine.close()
    assert results[0] == results[1]


async def test_scattered_blocks_decode_like_consecutive_ones(engine: TorchEngine,
                                                            llama_dir: Path) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    consecutive = [o.token_id for o in await run(engine, "a", params)]
    held = [engine.reserve(f"hole{i}", 4) for i in range(16)]  # one block each
    for i in range(0, 16, 2):  # free every other one: the free list alternates
        engine.abort(f"hole{i}")
    scattered = [o.token_id for o in await run(engine, "b", params)]
    assert scattered == consecutive
    assert held  # the odd reservations were holding the gaps open


async def test_bfloat16_engine_keeps_bf16_kv_and_generates(llama_dir: Path) -> None:
    engine = TorchEngine(EngineOptions(model_dir=llama_dir, num_blocks=64, block_size=4,
                                       dtype=torch.bfloat16))
    await engine.start()
    try:
        # A 20-token prompt takes the upcast path on CPUs without bf16 units (16+ tokens),
        # single-token decode steps the bf16 kernel.
        outputs = await run(engine, "bf", SamplingParams(max_tokens=6, temperature=0.0,
                                                         ignore_eos=True))
    finally:
        await engine.close()
    assert engine.kv is not None and engine.kv.data.dtype == torch.bfloat16
    assert len(outputs) == 6
    assert all(0 <= o.token_id < engine.config.vocab_size for o in outputs)


async def test_compute_never_blocks_the_event_loop(llama_dir: Path) -> None:
    engine = TorchEngine(EngineOptions(model_dir=llama_dir, num_blocks=1024, block_size=4,
                                       max_batch_tokens=480))
    await engine.start()
    gaps: list[float] = []
    try:
        loop = asyncio.get_running_loop()
        prefill = asyncio.gather(*(engine.prefill(PrefillRequest(
            f"long{n}", [(i + n) % 290 + 5 for i in range(480)], SamplingParams(max_tokens=1)))
            for n in range(6)))  # six model steps of 480 tokens each
        last = loop.time()
        while not prefill.done():
            await asyncio.sleep(0.005)
            now = loop.time()
            gaps.append(now - last)
            last = now
        await prefill
    finally:
        await engine.close()
    assert len(gaps) > 3  # the loop kept ticking while the engine thread computed
    assert max(gaps) < 0.25


def test_loading_a_model_does_not_import_the_compiler(llama_dir: Path) -> None:
    """The model is built on the meta device without random init: an init there (an
    embedding's `normal_`) imports torch._dynamo and triton, ~1 s and ~100 MB a worker, and
    triton's extension then prints leak reports at every worker's exit."""
    script = (
        "import asyncio, sys\n"
        "from pathlib import Path\n"
        "from engine.torch_engine import EngineOptions, TorchEngine\n"
        "async def main():\n"
        f"    engine = TorchEngine(EngineOptions(model_dir=Path({str(llama_dir)!r})))\n"
        "    await engine.start()\n"
        "    await engine.close()\n"
        "asyncio.run(main())\n"
        "print(sorted(m for m in ('torch._dynamo', 'triton') if m in sys.modules))\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).parents[2])
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "[]"

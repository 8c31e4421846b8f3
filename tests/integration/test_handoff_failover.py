"""A KV handoff that fails after prefill computed the KV is retried on another decode worker
with the same KV: the prompt is never computed twice, the client's output is unchanged."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from services.conductor.service import ConductorService
from services.decode.duty import DecodeDuty
from services.worker import DecodeService
from shared.messages import (
    DecodeReplacement,
    DispatchReply,
    GenerateRequest,
    KvCommitted,
    SamplingParams,
)
from shared.nats_client import dispatch
from tests.integration.test_events import subscriber
from tests.stack import Stack

pytestmark = pytest.mark.e2e

MODEL = "halfmoon-tiny"


class RefusingDecodeDuty(DecodeDuty):
    """Implements the decode role, but loses every request just before its commit (as a
    worker that restarted or expired the reservation would)."""

    async def _on_commit(self, message: KvCommitted) -> DispatchReply:
        self.abort(message.request_id)
        return self.worker.refusal("simulated: the reservation is gone")


class RefusingDecode(DecodeService):
    duty_types = {**DecodeService.duty_types, "decode": RefusingDecodeDuty}


class RefusingOnceDecodeDuty(DecodeDuty):
    """Implements the decode role; its first commit is refused after `before_refusal` ran
    (a passing failure: the bus's, say, while a NATS node restarts)."""

    before_refusal: Callable[[], Awaitable[None]] | None = None

    async def _on_commit(self, message: KvCommitted) -> DispatchReply:
        if self.before_refusal is None:
            return await super()._on_commit(message)
        before, self.before_refusal = self.before_refusal, None
        await before()
        self.abort(message.request_id)
        return self.worker.refusal("simulated: a passing failure")


class RefusingOnceDecode(DecodeService):
    duty_types = {**DecodeService.duty_types, "decode": RefusingOnceDecodeDuty}


def prefill_count(stack: Stack) -> float:
    value = stack.prefills[0].metrics.registry.get_sample_value("halfmoon_prefill_seconds_count")
    return value or 0.0


async def test_a_refused_commit_moves_the_computed_kv_to_another_decode_worker(
        nats_url: str, tiny_dir: Path) -> None:
    worker = {"engine": "torch", "model_path": str(tiny_dir), "num_blocks": 256}
    stack = Stack(nats_url, num_decode=2, worker=worker,
                  gateway_options={"model_path": str(tiny_dir)})
    # The refusing worker's id sorts first: placement tries it first (all else equal).
    stack.decodes[0] = RefusingDecode(msgspec.structs.replace(
        stack.decodes[0].config, worker_id="decode-0-refuses"))
    body: dict[str, Any] = {"model": MODEL, "prompt": "Once upon a time in a far land",
                            "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    async with stack, subscriber(stack) as events:
        refusing, healthy = stack.decodes
        status, first = await stack.post("/v1/completions", body)
        assert status == 200, first
        (migrated,) = [e for e in events if e.kind == "migrated"]
        assert (migrated.lost_worker_id, migrated.decode_worker_id) == (
            refusing.worker_id, healthy.worker_id)
        assert prefill_count(stack) == 1  # computed once, sent twice
        assert refusing.kv_commits == {} and healthy.kv_commits == {"shm": 1}
        await refusing.stop()  # the reference run goes straight to the healthy worker
        status, again = await stack.post("/v1/completions", body)
        assert status == 200, again
        assert first["choices"][0]["text"] == again["choices"][0]["text"]
        assert len(stack.prefills[0].leases) == 0
        await stack.wait_blocks_free(timeout_s=10)



async def test_a_decode_worker_whose_transfer_listener_closed_is_bypassed(
        nats_url: str, tiny_dir: Path) -> None:
    # Over TCP, as between hosts (shared memory on one host needs no listener).
    worker = {"engine": "torch", "model_path": str(tiny_dir), "num_blocks": 256,
              "transfer_transports": "tcp"}
    stack = Stack(nats_url, num_decode=2, worker=worker,
                  gateway_options={"model_path": str(tiny_dir)})
    stack.decodes[0] = DecodeService(msgspec.structs.replace(  # tried first, all else equal
        stack.decodes[0].config, worker_id="decode-0-deaf"))
    body: dict[str, Any] = {"model": MODEL, "prompt": "Once upon a time in a far land",
                            "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    async with stack, subscriber(stack) as events:
        deaf, other = stack.decodes
        assert deaf.transfer is not None
        await deaf.transfer.stop_listening()  # nothing lands there any more; it still serves
        status, first = await stack.post("/v1/completions", body)
        assert status == 200, first
        (migrated,) = [e for e in events if e.kind == "migrated"]
        assert (migrated.lost_worker_id, migrated.decode_worker_id) == (
            deaf.worker_id, other.worker_id)
        assert prefill_count(stack) == 1 and other.kv_commits == {"tcp": 1}
        await deaf.stop()
        status, again = await stack.post("/v1/completions", body)
        assert first["choices"][0]["text"] == again["choices"][0]["text"]


async def test_a_lone_decode_worker_whose_commit_failed_gets_the_kv_again(
        nats_url: str, tiny_dir: Path) -> None:
    """With no other decode worker alive, the one whose commit failed is asked again; and
    the prefill worker asks for it again while it holds the KV, though for a moment no
    conductor listens (this one was replaced as the commit failed)."""
    worker = {"engine": "torch", "model_path": str(tiny_dir), "num_blocks": 256}
    stack = Stack(nats_url, worker=worker, gateway_options={"model_path": str(tiny_dir)})
    body: dict[str, Any] = {"model": MODEL, "prompt": "Once upon a time in a far land",
                            "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    async with stack:
        status, reference = await stack.post("/v1/completions", body)
        assert status == 200, reference
        await stack.decodes[0].stop()
        stack.decodes[0] = RefusingOnceDecode(stack.decodes[0].config)
        await stack.decodes[0].start()
        await stack.wait_healthy()

        async def replace_the_conductor() -> None:
            await stack.conductor.stop()
            asyncio.get_running_loop().call_later(0.5, lambda: started.append(
                asyncio.ensure_future(stack.conductor.start())))
            stack.conductor = ConductorService(stack.conductor.config)

        started: list[asyncio.Future[Any]] = []
        duty = stack.decodes[0].duty
        assert isinstance(duty, RefusingOnceDecodeDuty)
        duty.before_refusal = replace_the_conductor
        async with subscriber(stack) as events:
            status, again = await stack.post("/v1/completions", body)
        assert status == 200, again
        assert again["choices"][0]["text"] == reference["choices"][0]["text"]
        assert duty.before_refusal is None  # it was refused once
        (restarted,) = started
        await restarted  # the conductor that answered
        (migrated,) = [e for e in events if e.kind == "migrated"]
        lone = stack.decodes[0].worker_id
        assert (migrated.lost_worker_id, migrated.decode_worker_id) == (lone, lone)
        assert prefill_count(stack) == 2  # once per request: the KV was sent twice
        await stack.wait_blocks_free(timeout_s=10)


async def test_a_replacement_for_an_unknown_prefill_worker_is_refused_not_prefilled_anew(
        nats_url: str) -> None:
    """The KV lives on the asking prefill worker; one the conductor does not know cannot be
    kept, and placing the request afresh would compute its prompt on another one."""
    async with Stack(nats_url) as stack:
        request = GenerateRequest(request_id="r1", model=MODEL, prompt_token_ids=list(range(40)),
                                  sampling=SamplingParams(max_tokens=4),
                                  reply_subject="_INBOX.unused", created_at_s=0.0)
        reply = await dispatch(stack.gateway.nc, stack.conductor.subjects.decode_replacement,
                               DecodeReplacement(request=request, prefill_worker_id="ghost",
                                                 failed_decode_worker_id="gone"), 5)
        assert not reply.is_accepted and "ghost" in reply.reason
        assert stack.prefills[0].duty.is_idle() and stack.decodes[0].duty.is_idle()


@pytest.mark.parametrize("transports", ["shm,tcp", "tcp"])
async def test_a_decode_worker_restarted_under_its_id_gets_the_kv_in_its_new_memory(
        nats_url: str, tiny_dir: Path, transports: str) -> None:
    """A decode worker with a fixed `--worker-id` restarts (or reloads): a prefill worker
    that kept its transfer descriptor must write the next requests' KV into the new
    process's pool, not into the old one's mapping (which the new worker would never see:
    it would decode from blocks nothing wrote) or to its old address."""
    worker = {"engine": "torch", "model_path": str(tiny_dir), "num_blocks": 256,
              "transfer_transports": transports}
    stack = Stack(nats_url, worker=worker, gateway_options={"model_path": str(tiny_dir)})
    stack.decodes[0] = DecodeService(msgspec.structs.replace(
        stack.decodes[0].config, worker_id="decode-fixed"))
    bodies: list[dict[str, Any]] = [
        {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0,
         "ignore_eos": True} for prompt in ("Once upon a time in a far land",
                                            "The harbour lights went out one by one")]
    async with stack:
        before = [await stack.post("/v1/completions", body) for body in bodies]
        old = stack.decodes[0]
        await old.stop()
        stack.decodes[0] = DecodeService(old.config)  # the same id, a new process's memory
        await stack.decodes[0].start()
        await stack.wait_healthy()
        after = [await stack.post("/v1/completions", body) for body in bodies]
        assert [status for status, _ in before + after] == [200] * 4, after
        assert [b["choices"][0]["text"] for _, b in after] == [
            b["choices"][0]["text"] for _, b in before]
        assert prefill_count(stack) == 4
        assert stack.decodes[0].kv_commits == {transports.split(",")[0]: 2}

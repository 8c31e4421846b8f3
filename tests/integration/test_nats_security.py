"""NATS security against a real nats-server: mutual TLS with a CA made here, one user per
service role with least-privilege allow-lists (`shared.nats_auth`). The stack works as those
users; a wrong password or an untrusted certificate is refused with a clear error; a role
publishing or subscribing outside its allow-list is refused by the server."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import nats
import openai
import pytest
from nats.aio.client import Client as NatsClient

from services.cli import main as cli_main
from shared.config import NatsAuth
from shared.errors import ConfigError
from shared.messages import RoleChange
from shared.nats_auth import NatsUser, authorization_conf, new_nkey_seed, role_users
from shared.nats_client import auth_options, connect, dispatch, subscribed
from shared.nats_server import EmbeddedNatsServer
from shared.subjects import Subjects
from tests.certs import CertFiles, TestCA
from tests.integration.test_abandoned import leave_after
from tests.integration.test_choices import counter
from tests.stack import Stack, eventually

pytestmark = pytest.mark.e2e

CLUSTER = "secure"
SUBJECTS = Subjects(CLUSTER)
GATEWAYS = ("gateway-0", "gateway-1")


@dataclass
class SecureNats:
    server: EmbeddedNatsServer
    ca: TestCA
    client: CertFiles
    passwords: dict[str, str]
    directory: Path

    def auth(self, user: str, **changes: str) -> NatsAuth:
        settings = {"user": user, "password": self.passwords[user], "tls_ca": str(self.ca.cert),
                    "tls_cert": str(self.client.cert), "tls_key": str(self.client.key),
                    **changes}
        return NatsAuth(**settings)

    def flags(self, user: str) -> dict[str, str | None]:
        """`auth(user)` as the flat settings a worker's flags carry."""
        auth = self.auth(user)
        return {f"nats_{name}": getattr(auth, name) for name in auth.__struct_fields__}

    def violations(self) -> list[str]:
        return [line for line in self.server.log_tail(1 << 20).splitlines()
                if "Permissions Violation" in line]


@pytest.fixture(scope="module")
def secure_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureNats]:
    directory = tmp_path_factory.mktemp("nats-security")
    ca = TestCA(directory, "halfmoon-test-ca")
    server_cert = ca.issue("nats-server", is_server=True)
    users = role_users(SUBJECTS, GATEWAYS)
    passwords = {name: secrets.token_urlsafe(16) for name, _ in users}
    conf = directory / "nats.conf"
    conf.write_text(
        f'tls: {{cert_file: "{server_cert.cert}", key_file: "{server_cert.key}", '
        f'ca_file: "{ca.cert}", verify: true, timeout: 5}}\n'
        + authorization_conf(NatsUser(name=name, permissions=allowed, password=passwords[name])
                             for name, allowed in users))
    server = EmbeddedNatsServer(config_file=conf)
    server.start()
    yield SecureNats(server, ca, ca.issue("halfmoon-client", is_server=False), passwords,
                     directory)
    server.stop()


@pytest.fixture
async def as_errors(secure_nats: SecureNats) -> AsyncIterator[
        tuple[list[str], dict[str, NatsClient]]]:
    """Clients connected as role users (`clients[user]`) and the errors the server sent them."""
    errors: list[str] = []
    clients: dict[str, NatsClient] = {}

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    for user in ("decode", "gateway-0", "gateway-1"):
        clients[user] = await nats.connect(secure_nats.server.url, error_cb=on_error,
                                           max_reconnect_attempts=0,
                                           **auth_options(secure_nats.auth(user)))
    yield errors, clients
    for client in clients.values():
        await client.close()


async def test_the_stack_serves_with_one_least_privilege_user_per_role(
        secure_nats: SecureNats, tiny_dir: Path) -> None:
    """On the real engine, so every kind of message flows: placement, the KV handoff (its
    target, commit and lease renewal), the transfer registry, a prefix fetched from the
    other prefill worker, prefix-cache events, the conductor's snapshot, stored responses."""
    worker = {"engine": "torch", "model_path": str(tiny_dir), "num_blocks": 256}
    violations_before = len(secure_nats.violations())
    async with Stack(
            secure_nats.server.url, cluster=CLUSTER, num_prefill=2, worker=worker,
            prefill_options=secure_nats.flags("prefill"),
            decode_options=secure_nats.flags("decode"),
            conductor_options={"nats": secure_nats.auth("conductor")},
            gateway_options={"nats": secure_nats.auth("gateway-0"), "gateway_id": "gateway-0",
                             "model_path": str(tiny_dir)}) as stack:
        prompt = "a prompt long enough to fill a few KV blocks " * 4
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="x",
                                      max_retries=0) as sdk:
            # ignore_eos: random weights may sample the end of text at any step.
            completions = [await sdk.completions.create(
                model="halfmoon-tiny", prompt=prompt, max_tokens=6,
                extra_body={"ignore_eos": True}) for _ in range(3)]
            stream = await sdk.chat.completions.create(
                model="halfmoon-tiny", messages=[{"role": "user", "content": "hi"}],
                max_tokens=5, stream=True, extra_body={"ignore_eos": True})
            chunks = [chunk async for chunk in stream]
            # A stored response (the gateway's KV bucket), continued, fetched and deleted.
            first = await sdk.responses.create(model="halfmoon-tiny", input="hi",
                                               max_output_tokens=2)
            second = await sdk.responses.create(model="halfmoon-tiny", input="more",
                                                max_output_tokens=2,
                                                previous_response_id=first.id)
            assert (await sdk.responses.retrieve(second.id)).previous_response_id == first.id
            await sdk.responses.delete(first.id)
        assert all(c.usage is not None and c.usage.completion_tokens == 6 for c in completions)
        assert chunks[-1].choices[0].finish_reason == "length"
        moved = sum(counter(w.metrics, "halfmoon_kv_transfer_bytes_total")
                    for w in [*stack.prefills, *stack.decodes])
        assert moved > 0  # the KV crossed from prefill to decode
    assert secure_nats.violations()[violations_before:] == []


async def test_a_worker_user_serves_either_role_and_the_conductor_may_switch_it(
        secure_nats: SecureNats) -> None:
    violations_before = len(secure_nats.violations())
    async with Stack(
            secure_nats.server.url, cluster=CLUSTER, num_decode=2,
            prefill_options=secure_nats.flags("prefill"),
            decode_options=secure_nats.flags("worker"),
            conductor_options={"nats": secure_nats.auth("conductor")},
            gateway_options={"nats": secure_nats.auth("gateway-0"),
                             "gateway_id": "gateway-0"}) as stack:
        switching = stack.decodes[1]
        reply = await dispatch(stack.conductor.nc, SUBJECTS.role_change(switching.worker_id),
                               RoleChange(role="prefill", requested_by="conductor"), 10)
        assert reply.is_accepted, reply
        await eventually(lambda: switching.worker_id in {
            hb.worker_id for hb in stack.conductor.workers.healthy("prefill")})
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="x",
                                      max_retries=0) as sdk:
            done = await asyncio.gather(*(sdk.completions.create(
                model="halfmoon-tiny", prompt=f"p{i}", max_tokens=4) for i in range(8)))
        assert all(c.usage is not None and c.usage.completion_tokens == 4 for c in done)
        assert switching.metrics.registry.get_sample_value("halfmoon_prefill_seconds_count")
    assert secure_nats.violations()[violations_before:] == []


async def test_a_wrong_password_is_refused_by_name_without_the_secret(
        secure_nats: SecureNats) -> None:
    wrong = secure_nats.auth("prefill", password="not-the-password")
    with pytest.raises(ConfigError, match="refused prefill") as caught:
        await connect(secure_nats.server.url, "prefill", timeout_s=5, auth=wrong)
    assert "not-the-password" not in str(caught.value)
    assert secure_nats.passwords["prefill"] not in str(caught.value)


async def test_an_untrusted_certificate_is_refused_either_way(secure_nats: SecureNats) -> None:
    stranger = TestCA(secure_nats.directory, "stranger-ca")
    untrusted_client = stranger.issue("stranger-client", is_server=False)
    # The server does not trust the client's certificate...
    with pytest.raises(ConfigError, match="refused decode"):
        await connect(secure_nats.server.url, "decode", timeout_s=5,
                      auth=secure_nats.auth("decode", tls_cert=str(untrusted_client.cert),
                                            tls_key=str(untrusted_client.key)))
    # ...nor does a client that trusts another CA trust the server's.
    with pytest.raises(ConfigError, match="certificate"):
        await connect(secure_nats.server.url, "decode", timeout_s=5,
                      auth=secure_nats.auth("decode", tls_ca=str(stranger.cert)))


async def test_a_decode_worker_cannot_publish_to_the_request_stream(
        secure_nats: SecureNats,
        as_errors: tuple[list[str], dict[str, NatsClient]]) -> None:
    errors, clients = as_errors
    await clients["decode"].publish(SUBJECTS.requests, b"forged request")
    await clients["decode"].flush()
    await eventually(lambda: any(
        f'permissions violation for publish to "{SUBJECTS.requests}"' in e for e in errors))


async def test_a_gateway_cannot_subscribe_to_another_gateways_tokens(
        secure_nats: SecureNats,
        as_errors: tuple[list[str], dict[str, NatsClient]]) -> None:
    errors, clients = as_errors
    delivered: list[bytes] = []

    async def on_message(message: nats.aio.msg.Msg) -> None:
        delivered.append(message.data)

    await clients["gateway-1"].subscribe(SUBJECTS.gateway("gateway-0"), cb=on_message)
    await subscribed(clients["gateway-1"])
    await eventually(lambda: any(
        f'permissions violation for subscription to "{SUBJECTS.gateway("gateway-0")}"' in e
        for e in errors))
    await clients["decode"].publish(SUBJECTS.gateway("gateway-0"), b"tokens of gateway-0")
    await clients["decode"].flush()
    await asyncio.sleep(0.2)
    assert delivered == []


async def test_a_gateway_user_takes_a_request_its_client_left_out_of_the_queue(
        secure_nats: SecureNats) -> None:
    """No conductor runs to hear the abort: the gateway deletes the queued message itself
    (`generation._unqueue`), which its user is allowed."""
    violations_before = len(secure_nats.violations())
    async with Stack(secure_nats.server.url, cluster=CLUSTER,
                     prefill_options=secure_nats.flags("prefill"),
                     decode_options=secure_nats.flags("decode"),
                     conductor_options={"nats": secure_nats.auth("conductor")},
                     gateway_options={"nats": secure_nats.auth("gateway-0"),
                                      "gateway_id": "gateway-0"}) as stack:
        await stack.conductor.stop()
        await leave_after(stack, 0.5)
        await eventually(lambda: len(stack.gateway.table) == 0)
        info = await stack.gateway.nc.jetstream().stream_info(SUBJECTS.requests_stream)
        assert info.state.messages == 0
    assert secure_nats.violations()[violations_before:] == []


async def test_nats_auth_writes_nkey_users_the_server_accepts(tmp_path: Path) -> None:
    assert cli_main(["nats-auth", "--out", str(tmp_path / "auth"), "--cluster", CLUSTER,
                     "--gateways", "1"]) == 0
    conf = tmp_path / "nats.conf"
    conf.write_text('include "auth/users.conf"\n')
    server = EmbeddedNatsServer(config_file=conf)
    server.start()
    try:
        seed = tmp_path / "auth" / "prefill.nk"
        assert seed.stat().st_mode & 0o777 == 0o600
        nc = await connect(server.url, "prefill", timeout_s=5, auth=NatsAuth(nkey_seed=str(seed)))
        await nc.close()
        stranger = tmp_path / "stranger.nk"
        stranger.write_bytes(new_nkey_seed())
        with pytest.raises(ConfigError, match="refused prefill"):
            await connect(server.url, "prefill", timeout_s=5,
                          auth=NatsAuth(nkey_seed=str(stranger)))
    finally:
        server.stop()

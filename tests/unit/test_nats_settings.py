"""How services are told to reach NATS: several servers, credentials and TLS from flags,
environment and TOML, and secrets kept out of logs and errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.config import GatewayConfig, NatsAuth
from shared.config_loading import load_config
from shared.errors import ConfigError
from shared.nats_auth import permissions, role_users
from shared.nats_client import auth_options, nats_servers, redact
from shared.subjects import Subjects


def test_a_nats_url_may_list_the_servers_of_a_cluster() -> None:
    assert nats_servers("nats://a:4222, nats://b:4222,nats://c:4222") == [
        "nats://a:4222", "nats://b:4222", "nats://c:4222"]
    with pytest.raises(ConfigError, match="names no server"):
        nats_servers(" , ")


def test_user_info_in_a_url_is_redacted() -> None:
    assert redact("nats://u:secret@a:4222,tls://token@b:4222,nats://c:4222") == (
        "nats://***@a:4222,tls://***@b:4222,nats://c:4222")


def test_security_settings_come_from_the_environment_and_hide_secrets() -> None:
    config = load_config(GatewayConfig, env={
        "HALFMOON_NATS_USER": "gateway-0", "HALFMOON_NATS_PASSWORD": "hunter2",
        "HALFMOON_NATS_TOKEN": "t0ken", "HALFMOON_JS_REPLICAS": "3"})
    assert config.nats.user == "gateway-0" and config.nats.password == "hunter2"
    assert config.js_replicas == 3
    assert "hunter2" not in repr(config) and "t0ken" not in repr(config)
    assert "user='gateway-0'" in repr(config.nats)


def test_security_settings_come_from_toml(tmp_path: Path) -> None:
    path = tmp_path / "halfmoon.toml"
    path.write_text('nats_tls_ca = "/etc/nats/ca.pem"\nnats_creds = "/etc/nats/x.creds"\n')
    config = load_config(GatewayConfig, toml_path=str(path))
    assert config.nats == NatsAuth(tls_ca="/etc/nats/ca.pem", creds="/etc/nats/x.creds")


def test_missing_files_and_half_pairs_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nats_creds: no file at"):
        auth_options(NatsAuth(creds=str(tmp_path / "absent.creds")))
    with pytest.raises(ConfigError, match="nats_user and nats_password together"):
        auth_options(NatsAuth(user="prefill"))
    cert = tmp_path / "cert.pem"
    cert.write_text("")
    with pytest.raises(ConfigError, match="nats_tls_cert and nats_tls_key together"):
        auth_options(NatsAuth(tls_cert=str(cert)))
    assert auth_options(NatsAuth(token="t")) == {"token": "t"}


def test_roles_get_disjoint_duties_on_the_bus() -> None:
    subjects = Subjects("prod")
    decode = permissions("decode", subjects)
    gateway = permissions("gateway", subjects, "gateway-0")
    assert subjects.requests not in decode.publish
    assert subjects.requests in gateway.publish
    assert gateway.subscribe.count(subjects.gateway("gateway-0")) == 1
    assert "halfmoon.prod.v1.gateway.*" not in gateway.subscribe
    assert "halfmoon.prod.v1.worker.*.reserve" in decode.subscribe
    assert [name for name, _ in role_users(subjects, ["gateway-0", "gateway-1"])] == [
        "gateway-0", "gateway-1", "conductor", "prefill", "decode", "worker"]
    worker = permissions("worker", subjects)
    prefill = permissions("prefill", subjects)
    assert set(decode.publish) | set(prefill.publish) == set(worker.publish)
    assert subjects.requests not in worker.publish
    with pytest.raises(ValueError, match="gateway id"):
        permissions("gateway", subjects)

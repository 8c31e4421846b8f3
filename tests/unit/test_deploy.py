"""compose.yaml and deploy/: what can be checked without a Docker engine."""

from __future__ import annotations

from pathlib import Path

import yaml

from services.cli import SERVICES, build_parser

ROOT = Path(__file__).resolve().parents[2]


def compose() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_compose_runs_nats_and_every_service() -> None:
    services = compose()["services"]
    assert {"nats", *SERVICES} <= set(services)


def test_every_file_compose_references_exists() -> None:
    services = compose()["services"]
    for name in SERVICES:
        build = services[name]["build"]
        assert (ROOT / build["context"] / build["dockerfile"]).is_file()
    for volume in services["nats"]["volumes"]:
        source = volume.split(":")[0]
        if source.startswith("./"):
            assert (ROOT / source).is_file(), source


def test_compose_commands_parse_with_the_real_cli() -> None:
    parser = build_parser()
    for name in SERVICES:
        args = parser.parse_args(compose()["services"][name]["command"])
        assert args.command == name


def test_dockerfile_copies_every_package() -> None:
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    for package in ("services", "shared", "engine", "transfer_engine"):
        assert f"COPY {package} ./{package}" in dockerfile


def test_compose_workers_can_move_kv_between_containers() -> None:
    services = compose()["services"]
    for name in ("prefill", "decode"):
        worker = services[name]
        assert worker["shm_size"] == "2gb"  # room for the shared-memory KV pool
        environment = worker["environment"]
        assert environment["HALFMOON_TRANSFER_HOST"] == "0.0.0.0"
        assert environment["HALFMOON_TRANSFER_SECRET"].startswith("${HALFMOON_TRANSFER_SECRET:?")
        assert environment["HALFMOON_NATS_URL"] == "nats://nats:4222"

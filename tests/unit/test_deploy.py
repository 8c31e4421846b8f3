"""compose.yaml and deploy/: what can be checked without a Docker engine."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from services.cli import SERVICES, build_parser
from shared.metrics import ConductorMetrics, DecodeMetrics, GatewayMetrics, PrefillMetrics

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
    mounts = [volume.split(":")[0] for service in services.values()
              for volume in service.get("volumes", [])]
    assert "./deploy/prometheus.yml" in mounts and "./deploy/grafana/dashboards" in mounts
    for source in mounts:
        if source.startswith("./"):
            assert (ROOT / source).exists(), source


def test_compose_runs_the_observability_stack_and_points_services_at_it() -> None:
    services = compose()["services"]
    assert {"jaeger", "prometheus", "grafana"} <= set(services)
    assert "16686:16686" in services["jaeger"]["ports"]
    for name in SERVICES:
        environment = services[name]["environment"]
        assert environment["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
        assert environment["HALFMOON_METRICS_PORT"] == "9100"
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in scrape["scrape_configs"]}
    assert set(jobs) == set(SERVICES)
    assert jobs["gateway"]["dns_sd_configs"][0]["port"] == 8000


def test_the_dashboard_plots_metrics_that_exist() -> None:
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/halfmoon.json").read_text())
    titles = {panel["title"] for panel in dashboard["panels"]}
    assert {"Time to first token", "Inter-token latency", "Throughput", "KV blocks",
            "KV transfer bandwidth"} <= titles
    exported = {name for metrics in (GatewayMetrics(), ConductorMetrics(), PrefillMetrics(),
                                     DecodeMetrics())
                for family in metrics.registry.collect() for name in
                (family.name, f"{family.name}_total", f"{family.name}_bucket")}
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"halfmoon_[a-z_]+", target["expr"]):
                assert name in exported, (panel["title"], name)


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

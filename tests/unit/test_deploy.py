"""compose.yaml and deploy/: what can be checked without a Docker engine."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import yaml

from services.cli import SERVICES, build_parser
from shared.metrics import ConductorMetrics, DecodeMetrics, GatewayMetrics, PrefillMetrics
from shared.nats_auth import write_nkey_users
from shared.nats_server import find_nats_server
from shared.subjects import Subjects

ROOT = Path(__file__).resolve().parents[2]


def compose() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


NATS_NODES = ("nats-1", "nats-2", "nats-3")
# Written by `halfmoon nats-auth --out deploy/nats-auth --gateways 1` before the first `up`.
GENERATED = "./deploy/nats-auth/"
# What compose runs: every service, its workers by their starting role (`halfmoon prefill`,
# `halfmoon decode`), so no `halfmoon worker` of its own.
DEPLOYED = [name for name in SERVICES if name != "worker"]


def test_compose_runs_a_three_node_nats_cluster_and_every_service() -> None:
    services = compose()["services"]
    assert {*NATS_NODES, *DEPLOYED} <= set(services)
    for node in NATS_NODES:
        assert services[node]["command"] == ["-c", "/etc/nats/nats.conf", "--server_name", node]
    routes = (ROOT / "deploy" / "nats.conf").read_text()
    assert all(f"nats://{node}:6222" in routes for node in NATS_NODES)
    for name in DEPLOYED:
        environment = services[name]["environment"]
        assert environment["HALFMOON_NATS_URL"] == ",".join(
            f"nats://{node}:4222" for node in NATS_NODES)
        assert environment["HALFMOON_JS_REPLICAS"] == "3"


def test_compose_gives_each_service_its_own_nats_user(tmp_path: Path) -> None:
    document = compose()
    written = {path.name for path in write_nkey_users(tmp_path, Subjects("default"),
                                                      ["gateway-0"])}
    for name in DEPLOYED:
        service = document["services"][name]
        user = "gateway-0" if name == "gateway" else name
        assert service["secrets"] == [f"{user}.nk"]
        assert service["environment"]["HALFMOON_NATS_NKEY_SEED"] == f"/run/secrets/{user}.nk"
        assert document["secrets"][f"{user}.nk"]["file"] == f"{GENERATED}{user}.nk"
    assert document["services"]["gateway"]["environment"]["HALFMOON_GATEWAY_ID"] == "gateway-0"
    generated = {Path(secret["file"]).name for secret in document["secrets"].values()}
    generated |= {Path(volume.split(":")[0]).name for node in NATS_NODES
                  for volume in document["services"][node]["volumes"]
                  if volume.startswith(GENERATED)}
    assert generated <= written and "users.conf" in generated


def test_every_file_compose_references_exists() -> None:
    services = compose()["services"]
    for name in DEPLOYED:
        build = services[name]["build"]
        assert (ROOT / build["context"] / build["dockerfile"]).is_file()
    mounts = [volume.split(":")[0] for service in services.values()
              for volume in service.get("volumes", [])]
    assert "./deploy/prometheus.yml" in mounts and "./deploy/grafana/dashboards" in mounts
    for source in mounts:
        if source.startswith("./") and not source.startswith(GENERATED):
            assert (ROOT / source).exists(), source


def test_compose_runs_the_observability_stack_and_points_services_at_it() -> None:
    services = compose()["services"]
    assert {"jaeger", "prometheus", "grafana"} <= set(services)
    assert "16686:16686" in services["jaeger"]["ports"]
    for name in DEPLOYED:
        environment = services[name]["environment"]
        assert environment["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
        assert environment["HALFMOON_METRICS_PORT"] == "9100"
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in scrape["scrape_configs"]}
    assert set(jobs) == set(DEPLOYED)
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
    for name in DEPLOYED:
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


def test_compose_nats_config_is_one_the_server_accepts(tmp_path: Path) -> None:
    (tmp_path / "nats.conf").write_text((ROOT / "deploy" / "nats.conf").read_text())
    write_nkey_users(tmp_path / "auth", Subjects("default"), ["gateway-0"])
    checked = subprocess.run([str(find_nats_server()), "-c", str(tmp_path / "nats.conf"), "-t",
                              "--server_name", "nats-1"], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr

"""deploy/k8s: every manifest valid against the Kubernetes schemas (kubernetes-validate, offline),
both overlays rendered by kustomize where `kubectl` is installed, and every container checked
to reference images, ports, flags, secrets and settings that exist."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from services.cli import SERVICES, build_parser
from shared.config_loading import flat_fields, load_config
from shared.nats_auth import write_nkey_users
from shared.nats_server import find_nats_server
from shared.subjects import Subjects

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30.0"
IMAGES = {"halfmoon:latest", "nats:2.10-alpine"}  # deploy/Dockerfile's image, NATS's own

Resource = dict[str, Any]


def base_resources() -> list[Resource]:
    kustomization = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    return [doc for name in kustomization["resources"]
            for doc in yaml.safe_load_all((K8S / "base" / name).read_text()) if doc]


def by_kind(resources: list[Resource], kind: str) -> dict[str, Resource]:
    return {r["metadata"]["name"]: r for r in resources if r["kind"] == kind}


def workloads(resources: list[Resource]) -> dict[str, Resource]:
    return {**by_kind(resources, "Deployment"), **by_kind(resources, "StatefulSet")}


def validate(resources: list[Resource]) -> None:
    for resource in resources:
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)


def test_every_base_manifest_is_valid_kubernetes() -> None:
    resources = base_resources()
    validate(resources)
    assert set(workloads(resources)) == {"nats", "gateway", "conductor", "prefill", "decode"}
    assert set(by_kind(resources, "PodDisruptionBudget")) == set(workloads(resources))


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) not installed")
@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_each_overlay_renders_to_valid_kubernetes(overlay: str) -> None:
    rendered = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / overlay)],
                              capture_output=True, text=True, check=True).stdout
    resources = [doc for doc in yaml.safe_load_all(rendered) if doc]
    validate(resources)
    for name, workload in workloads(resources).items():
        container = workload["spec"]["template"]["spec"]["containers"][0]
        gpus = container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        is_gpu_worker = overlay == "gpu" and name in ("prefill", "decode")
        assert gpus == (1 if is_gpu_worker else None), name
        if is_gpu_worker:
            assert container["args"][-2:] == ["--device", "cuda"]
        assert workload["metadata"]["namespace"] == "halfmoon"


def halfmoon_containers() -> dict[str, Resource]:
    return {name: workload["spec"]["template"]["spec"]["containers"][0]
            for name, workload in workloads(base_resources()).items() if name != "nats"}


def expanded(value: str) -> str:
    """`$(VAR)` as Kubernetes fills it in, with a sample value."""
    return re.sub(r"\$\((\w+)\)", lambda m: {"POD_NAME": "gateway-0",
                                             "POD_IP": "10.0.0.7"}[m.group(1)], value)


def test_containers_run_images_that_exist_with_flags_that_parse() -> None:
    parser = build_parser()
    for name, workload in workloads(base_resources()).items():
        container = workload["spec"]["template"]["spec"]["containers"][0]
        assert container["image"] in IMAGES, name
        if name == "nats":
            continue
        args = parser.parse_args([expanded(arg) for arg in container["args"]])
        assert args.command == name
        config_type, _ = SERVICES[name]
        config = load_config(config_type, flags=vars(args))
        if name in ("prefill", "decode"):
            assert config.transfer.port == 7700  # type: ignore[attr-defined]
            assert config.transfer.advertise_host == "10.0.0.7"  # type: ignore[attr-defined]


def test_settings_in_the_environment_name_real_config_fields() -> None:
    env_map = by_kind(base_resources(), "ConfigMap")["halfmoon-env"]["data"]
    for name, container in halfmoon_containers().items():
        config_type, _ = SERVICES[name]
        variables = {key: value for key, value in env_map.items()
                     if key.startswith("HALFMOON_")}
        variables |= {item["name"]: "x" for item in container.get("env", [])
                      if item["name"].startswith("HALFMOON_") and "value" not in item}
        config = load_config(config_type, env=variables)
        assert config.js_replicas == 3
        assert len(config.nats_url.split(",")) == 3
        names = {field.name for field in flat_fields(config_type)}
        for variable in variables:
            assert variable.removeprefix("HALFMOON_").lower() in names, (name, variable)


def test_probes_and_scrape_annotations_point_at_ports_that_serve_them() -> None:
    for name, workload in workloads(base_resources()).items():
        template = workload["spec"]["template"]
        container = template["spec"]["containers"][0]
        ports = {port["name"]: port["containerPort"] for port in container["ports"]}
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"]["port"] in ports, (name, probe)
        if name == "nats":
            continue
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) in ports.values()
        metrics_port = 8000 if name == "gateway" else 9100
        assert int(annotations["prometheus.io/port"]) == metrics_port


def test_workers_get_a_memory_backed_dev_shm_and_the_transfer_secret() -> None:
    for name in ("prefill", "decode"):
        spec = workloads(base_resources())[name]["spec"]["template"]["spec"]
        shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"
        mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
        assert mounts["/dev/shm"] == "dshm"
        secret = next(e for e in spec["containers"][0]["env"]
                      if e["name"] == "HALFMOON_TRANSFER_SECRET")
        assert secret["valueFrom"]["secretKeyRef"]["name"] == "halfmoon-transfer"


def test_each_service_mounts_only_its_own_nkey_as_nats_auth_writes_it(tmp_path: Path) -> None:
    written = {path.name for path in write_nkey_users(
        tmp_path, Subjects("default"), ["gateway-0", "gateway-1"])}
    resources = base_resources()
    for name, workload in workloads(resources).items():
        spec = workload["spec"]["template"]["spec"]
        users = next(v for v in spec["volumes"] if v["name"] in ("users", "nats-users"))
        assert users["secret"]["secretName"] == "halfmoon-nats-users"
        keys = {item["key"] for item in users["secret"]["items"]}
        assert keys <= written
        if name == "nats":
            assert keys == {"users.conf"}  # public keys only
            continue
        expected = {"gateway-0.nk", "gateway-1.nk"} if name == "gateway" else {f"{name}.nk"}
        assert keys == expected
    # One gateway user per gateway replica (a StatefulSet: stable names gateway-0, gateway-1).
    assert workloads(resources)["gateway"]["spec"]["replicas"] == 2


def test_the_nats_config_is_one_the_server_accepts(tmp_path: Path) -> None:
    conf = by_kind(base_resources(), "ConfigMap")["nats-config"]["data"]["nats.conf"]
    (tmp_path / "nats.conf").write_text(conf)
    write_nkey_users(tmp_path / "auth", Subjects("default"), ["gateway-0", "gateway-1"])
    checked = subprocess.run([str(find_nats_server()), "-c", str(tmp_path / "nats.conf"), "-t"],
                             capture_output=True, text=True, env={"POD_NAME": "nats-0"})
    assert checked.returncode == 0, checked.stderr
    assert conf.count("nats-headless:6222") == 3  # a route to each of the three nodes

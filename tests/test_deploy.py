"""The deployment files cannot be run here (no container engine): check what can be checked
offline. Every container's command, health check and environment must be one the CLI accepts, and
the services must reach each other where the others listen."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from specsplit.cli import parser as _parser

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = sorted((ROOT / "deploy").glob("compose.*.yaml"))


def known_environment() -> set[str]:
    """SPECSPLIT_* variables the code reads, and the OTEL_* ones it or the SDK honours."""
    names = set()
    for package in ("specsplit", "gateway", "draft_service", "verify_service"):
        for path in (ROOT / package).rglob("*.py"):
            names |= set(re.findall(r"SPECSPLIT_[A-Z_]+", path.read_text()))
    return names


def serve_args(command: list[str]):
    assert command[:2] == ["specsplit", "serve"], command
    return _parser().parse_args(command[1:])


def test_there_are_both_layouts():
    assert {p.name for p in COMPOSE} == {"compose.colocated.yaml", "compose.split.yaml"}


@pytest.mark.parametrize("path", COMPOSE, ids=lambda p: p.name)
def test_compose_services_are_valid_cli_invocations_that_reach_each_other(path):
    compose = yaml.safe_load(path.read_text())
    services = compose["services"]
    assert set(services["jaeger"]["ports"]) >= {"16686:16686", "4317:4317"}
    known = known_environment()
    listens, args = {}, {}
    for name in ("verify", "draft", "gateway"):
        service = services[name]
        a = serve_args(service["command"])
        assert a.role == name
        listens[name], args[name] = a.listen, a
        env = service["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
        unknown = {k for k in env if k.startswith("SPECSPLIT_")} - known
        assert not unknown, f"{name}: {unknown} are read by nothing"
        # The health check asks this very service, on its own address, with a command the CLI has.
        test = service["healthcheck"]["test"]
        assert test[:3] == ["CMD", "specsplit", "health"]
        health = _parser().parse_args(test[2:])
        local = a.listen.replace("0.0.0.0", "127.0.0.1")
        assert health.address == local, (name, health.address, a.listen)
        if a.metrics_port:
            assert env.get("SPECSPLIT_METRICS_HOST") == "0.0.0.0"  # scrapable from outside the container
    gateway = args["gateway"]
    for backend, address in (("verify", gateway.verify), ("draft", gateway.draft)):
        listen = listens[backend]
        if listen.startswith("unix://"):
            assert address == listen
            # The socket's directory is a volume both containers mount at the same place.
            mounts = [set(v.rsplit(":ro", 1)[0] for v in services[n]["volumes"]) for n in (backend, "gateway")]
            socket = listen.removeprefix("unix://")
            assert any(socket.startswith(m.split(":")[1] + "/") for m in mounts[0] & mounts[1]), (backend, mounts)
        else:  # every container of the service: replicas with --scale
            assert address == f"dns:///{backend}:{listen.rsplit(':', 1)[1]}"
    published = {p.split(":")[1] for p in services["gateway"]["ports"]}
    assert gateway.listen.rsplit(":", 1)[1] in published and gateway.http_listen.rsplit(":", 1)[1] in published
    if path.name == "compose.colocated.yaml":
        # One /dev/shm for all three (segments and fast-path sockets live there) and one socket directory.
        assert services["verify"]["ipc"] == "shareable"
        assert services["draft"]["ipc"] == services["gateway"]["ipc"] == "service:verify"
        assert all(listens[n].startswith("unix:///run/specsplit/") for n in ("verify", "draft"))
        assert all("sockets:/run/specsplit" in services[n]["volumes"] for n in ("verify", "draft", "gateway"))


def test_health_command_reports_a_missing_server(tmp_path):
    result = subprocess.run([sys.executable, "-m", "specsplit.cli", "health", f"unix://{tmp_path}/none.sock",
                             "--timeout", "1"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "UNAVAILABLE" in result.stdout, result


# Kubernetes: kustomize overlays rendered with kubectl's built-in kustomize, every resource checked
# against a pinned Kubernetes schema (kubernetes-validate, strict: unknown fields are errors).
K8S_VERSION = "1.33.0"
OVERLAYS = ("colocated", "split")


def render(overlay: str) -> list[dict]:
    out = subprocess.run(["kubectl", "kustomize", str(ROOT / "deploy" / "k8s" / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_manifests_are_valid_kubernetes(overlay):
    import kubernetes_validate

    docs = render(overlay)
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    broken = next(d for d in docs if d["kind"] == "Deployment")
    broken["spec"]["template"]["spec"]["containers"][0]["livenessprobe"] = {}  # a typo: strict mode refuses it
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def containers(docs: list[dict]) -> dict[str, tuple[dict, dict]]:
    """specsplit containers by role: (container, its pod spec)."""
    found = {}
    for deployment in by_kind(docs, "Deployment").values():
        pod = deployment["spec"]["template"]["spec"]
        for c in pod["containers"]:
            if c.get("command", [""])[0] == "specsplit":
                found[serve_args(c["command"]).role] = (c, pod)
    return found


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_manifests_run_what_the_cli_accepts_and_wire_up(overlay):
    docs = render(overlay)
    known = known_environment()
    config = by_kind(docs, "ConfigMap")["specsplit-config"]["data"]
    assert not {k for k in config if k.startswith("SPECSPLIT_")} - known
    assert config["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317" and "jaeger" in by_kind(docs, "Service")
    roles = containers(docs)
    assert set(roles) == {"verify", "draft", "gateway"}
    args = {}
    for role, (c, pod) in roles.items():
        a = args[role] = serve_args(c["command"])
        assert c["envFrom"] == [{"configMapRef": {"name": "specsplit-config"}}]
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        ports = {p["containerPort"] for p in c["ports"]}
        assert a.metrics_port in ports
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c[kind]
            if "grpc" in probe:  # kubelet's native probe: plaintext TCP only
                assert not a.tls_cert and probe["grpc"]["port"] == int(a.listen.rsplit(":", 1)[1])
            else:
                health = _parser().parse_args(probe["exec"]["command"][1:])
                assert probe["exec"]["command"][0] == "specsplit" and health.command == "health"
                assert health.address == a.listen if a.listen.startswith("unix:") else \
                    health.address == f"localhost:{a.listen.rsplit(':', 1)[1]}"
                if a.tls_cert:  # mTLS: the probe presents a certificate the server's CA accepts
                    assert health.tls_ca == a.tls_client_ca and health.tls_cert and health.tls_key
    if overlay == "colocated":
        # One pod: sockets in a shared emptyDir, /dev/shm a shared memory-backed emptyDir, distinct ports.
        pods = {id(pod) for _, pod in roles.values()}
        assert len(pods) == 1
        pod = next(pod for _, pod in roles.values())
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
        for role, (c, _) in roles.items():
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert mounts["/dev/shm"] == "dshm" and mounts["/run/specsplit"] == "sockets"
        assert args["gateway"].verify == args["verify"].listen and args["gateway"].draft == args["draft"].listen
        assert len({a.metrics_port for a in args.values()}) == 3  # one network namespace
    else:
        services = by_kind(docs, "Service")
        for backend in ("verify", "draft"):
            host, port = getattr(args["gateway"], backend).removeprefix("dns:///").rsplit(":", 1)
            service = services[host]
            assert int(port) in {p["port"] for p in service["spec"]["ports"]}
            assert service["spec"]["selector"] == by_kind(docs, "Deployment")[host]["spec"]["selector"]["matchLabels"]
            assert args[backend].tls_client_ca  # mutual TLS between the tiers
        # Verify and draft replicas: headless Services the gateway resolves itself, pinning each session
        # to one replica of each; an autoscaler per tier.
        hpas = {h["spec"]["scaleTargetRef"]["name"] for h in by_kind(docs, "HorizontalPodAutoscaler").values()}
        for backend, port in (("verify", 50051), ("draft", 50052)):
            name = f"specsplit-{backend}"
            assert services[name]["spec"]["clusterIP"] == "None"
            assert getattr(args["gateway"], backend) == f"dns:///{name}:{port}"
            assert by_kind(docs, "Deployment")[name]["spec"]["replicas"] > 1 and name in hpas
        gw = args["gateway"]
        assert gw.upstream_ca and gw.upstream_cert and gw.upstream_key
    # Every Service points at container ports that exist in the pods it selects.
    for service in by_kind(docs, "Service").values():
        selected = [d for d in by_kind(docs, "Deployment").values()
                    if d["spec"]["template"]["metadata"]["labels"].items() >= service["spec"]["selector"].items()]
        assert len(selected) == 1, service["metadata"]["name"]
        ports = [p for c in selected[0]["spec"]["template"]["spec"]["containers"] for p in c["ports"]]
        names, numbers = {p.get("name") for p in ports}, {p["containerPort"] for p in ports}
        for p in service["spec"]["ports"]:
            assert p["targetPort"] in names | numbers, (service["metadata"]["name"], p)
    for hpa in by_kind(docs, "HorizontalPodAutoscaler").values():
        assert hpa["spec"]["scaleTargetRef"]["name"] in by_kind(docs, "Deployment")

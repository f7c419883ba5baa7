"""TLS and mutual TLS between the gateway and its backends, with certificates made here by openssl:
the right certificates connect, wrong or missing ones are refused."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from conftest import running_stack
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc
from specsplit.api.verify.v1 import verify_pb2 as vpb
from specsplit.api.verify.v1 import verify_pb2_grpc as vpb_grpc
from specsplit.serving.server import aio_channel
from specsplit.serving.settings import ClientTLS


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-subj", f"/CN={name}", cwd=d)


def _leaf(d: Path, name: str, ca: str, ext: str) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
             f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    (d / f"{name}.ext").write_text(ext)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-days", "2", "-out", f"{name}.pem", "-extfile", f"{name}.ext", cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _ca(d, "rogue-ca")
    _leaf(d, "server", "ca", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    _leaf(d, "gateway", "ca", "extendedKeyUsage=clientAuth\n")
    _leaf(d, "intruder", "rogue-ca", "extendedKeyUsage=clientAuth\n")
    _leaf(d, "service", "ca", "subjectAltName=DNS:specsplit-verify\nextendedKeyUsage=serverAuth\n")  # no IP
    return d


async def _info(address: str, tls: ClientTLS | None) -> str:
    async with aio_channel(address, tls) as channel:
        return (await vpb_grpc.VerifierStub(channel).Info(vpb.InfoRequest(), timeout=5)).model_id


async def test_mutual_tls_accepts_the_right_certificates_and_refuses_others(models, tmp_path, pki):
    server_tls = {"tls_cert": str(pki / "server.pem"), "tls_key": str(pki / "server.key"),
                  "tls_client_ca": str(pki / "ca.pem")}
    gateway_tls = ClientTLS(str(pki / "ca.pem"), str(pki / "gateway.pem"), str(pki / "gateway.key"))
    async with running_stack(tmp_path, "tcp", models["target"], models["draft"], tls=server_tls, shared_memory=False,
                             upstream_tls=gateway_tls) as stack:
        assert await _info(stack.verify, gateway_tls) == "target"
        refused = {
            "plaintext": None,
            "no client certificate": ClientTLS(str(pki / "ca.pem")),
            "client certificate from another CA": ClientTLS(str(pki / "ca.pem"), str(pki / "intruder.pem"),
                                                           str(pki / "intruder.key")),
            "server not trusted": ClientTLS(str(pki / "rogue-ca.pem"), str(pki / "gateway.pem"),
                                            str(pki / "gateway.key")),
        }
        assert await _health(stack.draft, gateway_tls) == health_pb2.HealthCheckResponse.SERVING
        for case, tls in refused.items():
            for service, probe in (("verify", _info), ("draft", _health)):  # both backends ask for the certificate
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await probe(getattr(stack, service), tls)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE, (service, case)
        # The gateway reached both backends over mTLS: a request runs end to end.
        async with grpc.aio.insecure_channel(stack.gateway) as ch:
            out = await pb_grpc.GatewayStub(ch).Generate(pb.GenerateRequest(
                text="def add(a, b):", max_new_tokens=8, speculation=pb.SPECULATION_ON, drafter="model"))
        assert len(out.token_ids) == 8 and out.stats.speculation_used
        assert not out.stats.fast_path  # no shared memory, as across hosts: the rounds went over mTLS streams
        # Health checks (the split Kubernetes layout's probes) speak mTLS too, naming the certificate's host.
        health = ["health", stack.verify.replace("127.0.0.1", "localhost"), "--tls-ca", str(pki / "ca.pem")]
        client = ["--tls-cert", str(pki / "gateway.pem"), "--tls-key", str(pki / "gateway.key")]
        probe = [sys.executable, "-m", "specsplit.cli", *health]
        ok, refused = [await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True, timeout=60)
                       for cmd in (probe + client + ["--tls-server-name", "localhost"], probe)]
        assert ok.returncode == 0 and ok.stdout.strip().endswith(": SERVING"), ok
        assert refused.returncode == 1 and "UNAVAILABLE" in refused.stdout, refused


async def _health(address: str, tls: ClientTLS | None) -> int:
    async with aio_channel(address, tls) as channel:
        return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)).status


async def test_mutual_tls_on_the_gateway_serves_clients_with_certificates_only(models, tmp_path, pki):
    client_tls = ClientTLS(str(pki / "ca.pem"), str(pki / "gateway.pem"), str(pki / "gateway.key"))
    gateway_tls = {"tls_cert": str(pki / "server.pem"), "tls_key": str(pki / "server.key"),
                   "tls_client_ca": str(pki / "ca.pem")}
    async with running_stack(tmp_path, "tcp", models["target"], models["draft"], gateway_tls=gateway_tls) as stack:
        async with aio_channel(stack.gateway, client_tls) as channel:
            out = await pb_grpc.GatewayStub(channel).Generate(pb.GenerateRequest(
                text="def add(a, b):", max_new_tokens=8, speculation=pb.SPECULATION_ON), timeout=60)
        assert len(out.token_ids) == 8 and out.stats.speculation_used
        for case, tls in {"plaintext": None, "no client certificate": ClientTLS(str(pki / "ca.pem")),
                          "client certificate from another CA": ClientTLS(
                              str(pki / "ca.pem"), str(pki / "intruder.pem"), str(pki / "intruder.key"))}.items():
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async with aio_channel(stack.gateway, tls) as channel:
                    await pb_grpc.GatewayStub(channel).Generate(pb.GenerateRequest(text="hi", max_new_tokens=2),
                                                                timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, case


async def test_tls_without_client_certificates(models, tmp_path, pki):
    server_tls = {"tls_cert": str(pki / "server.pem"), "tls_key": str(pki / "server.key")}
    async with running_stack(tmp_path, "tcp", models["target"], None, tls=server_tls,
                             upstream_tls=ClientTLS(str(pki / "ca.pem"))) as stack:
        assert await _info(stack.verify, ClientTLS(str(pki / "ca.pem"))) == "target"
        with pytest.raises(grpc.aio.AioRpcError) as err:  # the handshake fails at once: not a timeout
            await _info(stack.verify, ClientTLS(str(pki / "rogue-ca.pem")))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value


async def test_replicas_found_by_dns_are_reached_by_ip_under_the_services_name(pki):
    """The split Kubernetes layout: the gateway resolves a headless Service to pod IPs and connects to
    each by IP, while the backends' certificate names the Service (not the pods)."""
    import socket

    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from gateway.replicas import Replicas

    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    pair = ((pki / "service.key").read_bytes(), (pki / "service.pem").read_bytes())
    credentials = grpc.ssl_server_credentials([pair], root_certificates=(pki / "ca.pem").read_bytes(),
                                              require_client_auth=True)
    port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    tls = ClientTLS(str(pki / "ca.pem"), str(pki / "gateway.pem"), str(pki / "gateway.key"))

    def lookup(host, port, type=0):
        assert host == "specsplit-verify"
        return [(socket.AF_INET, type, 6, "", ("127.0.0.1", port))]

    by_name = Replicas("verify", f"dns:///specsplit-verify:{port}", tls, lookup=lookup)
    by_ip = Replicas("verify", f"127.0.0.1:{port}", tls)  # no name to check the certificate against
    try:
        await by_name.refresh()
        replica = by_name.replicas[f"127.0.0.1:{port}"]
        reply = await replica.health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await by_ip.replicas[f"127.0.0.1:{port}"].health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await by_name.close()
        await by_ip.close()
        await server.stop(None)

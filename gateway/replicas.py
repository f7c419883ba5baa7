"""The verify service's replicas behind one gateway. A session's KV cache lives on the replica that
prefilled it, so the gateway keeps affinity itself rather than leaving it to a per-call load
balancer: each request (one session) is pinned to one replica for all its calls, and a new session
goes to the serving replica with the fewest sessions in flight.

`--verify` takes one address, several separated by commas, or `dns:///NAME:PORT`: every address NAME
resolves to, re-resolved every few seconds (a Kubernetes headless Service lists its ready pods).
A replica that stops answering health checks gets no new sessions; sessions on it fail as with a
failed verifier (UNAVAILABLE naming the verify service); one that leaves DNS is dropped once its
sessions have ended."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2_grpc

from gateway.load import Load
from specsplit.errors import Failure
from specsplit.serving import aio_channel
from specsplit.settings import ClientTLS
from specsplit.verify.v1 import verify_pb2_grpc as vpb_grpc

log = logging.getLogger("specsplit.gateway")
RESOLVE_EVERY_S = 5.0
DNS = "dns:///"


@dataclass
class Replica:
    address: str
    channel: grpc.aio.Channel
    stub: vpb_grpc.VerifierStub
    health: health_pb2_grpc.HealthStub
    serving: bool = False  # new sessions come here once it answered SERVING and serves the target
    sessions: int = 0  # requests pinned here now
    gone: bool = False  # no longer resolved: close once its sessions ended
    load: Load = field(default_factory=Load)  # what its sessions' rounds put into its forwards


def resolve(spec: str, lookup: Callable = socket.getaddrinfo) -> list[str]:
    """The addresses `spec` names now: its comma-separated entries, each `dns:///NAME:PORT`
    expanded into one `IP:PORT` per address NAME resolves to (sorted, so the order is stable)."""
    addresses = []
    for entry in (e.strip() for e in spec.split(",") if e.strip()):
        if not entry.startswith(DNS):
            addresses.append(entry)
            continue
        host, _, port = entry.removeprefix(DNS).rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--verify {entry!r}: use dns:///NAME:PORT")
        found = {info[4][0] for info in lookup(host, int(port), type=socket.SOCK_STREAM)}
        addresses += sorted(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in found)
    return addresses


class VerifyReplicas:
    def __init__(self, spec: str, tls: ClientTLS | None, interceptors=(), lookup: Callable = socket.getaddrinfo,
                 clock: Callable[[], float] = time.monotonic):
        self.spec, self._tls, self._interceptors, self._lookup, self._clock = spec, tls, list(interceptors), \
            lookup, clock
        self._resolved_at: float | None = None
        self._dynamic = DNS in spec
        # Certificates name the Service, not the pods' IPs.
        self._server_name = next((e.strip().removeprefix(DNS).rpartition(":")[0] for e in spec.split(",")
                                  if e.strip().startswith(DNS)), None)
        self.replicas: dict[str, Replica] = {}
        self.sync(resolve(spec, lookup) if not self._dynamic else [])

    def sync(self, addresses: list[str]) -> None:
        """Adds the replicas new in `addresses` and marks the missing ones gone."""
        for address in addresses:
            replica = self.replicas.get(address)
            if replica is None:
                options = [("grpc.ssl_target_name_override", self._server_name)] if self._tls and \
                    self._server_name else []
                channel = aio_channel(address, self._tls, self._interceptors, options)
                self.replicas[address] = Replica(address, channel, vpb_grpc.VerifierStub(channel),
                                                 health_pb2_grpc.HealthStub(channel))
                if len(self.replicas) > 1 or self._dynamic:
                    log.info("verify replica %s added", address)
            elif replica.gone:
                replica.gone = False
        for address, replica in self.replicas.items():
            if address not in addresses and not replica.gone:
                replica.gone = True
                log.warning("verify replica %s left %s: no new sessions", address, self.spec)

    async def refresh(self) -> None:
        """Re-resolves a dns:/// spec (at most every RESOLVE_EVERY_S; the health loop calls this more
        often); drops replicas that left once their sessions ended."""
        now = self._clock()
        if self._dynamic and (self._resolved_at is None or now - self._resolved_at >= RESOLVE_EVERY_S):
            self._resolved_at = now
            try:
                self.sync(await asyncio.to_thread(resolve, self.spec, self._lookup))
            except (OSError, ValueError) as e:  # DNS hiccup: keep what we have
                log.warning("resolving %s: %s", self.spec, e)
        for address, replica in list(self.replicas.items()):
            if replica.gone and replica.sessions == 0:
                del self.replicas[address]
                await replica.channel.close()

    @property
    def any(self) -> Replica:
        """A replica to ask what the target is (they must all serve the same one)."""
        if not self.replicas:
            raise Failure(grpc.StatusCode.UNAVAILABLE, f"verify service: {self.spec} resolves to no address")
        return next(iter(self.replicas.values()))

    def pick(self) -> Replica:
        """The serving replica with the fewest sessions in flight (ties: the first listed)."""
        live = [r for r in self.replicas.values() if r.serving and not r.gone]
        if not live:
            raise Failure(grpc.StatusCode.UNAVAILABLE, f"verify service: no replica of {self.spec} is serving")
        return min(live, key=lambda r: r.sessions)

    @property
    def serving(self) -> bool:
        return any(r.serving and not r.gone for r in self.replicas.values())

    async def close(self) -> None:
        for replica in self.replicas.values():
            await replica.channel.close()
        self.replicas.clear()

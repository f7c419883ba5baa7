"""A service's replicas behind one gateway: the verify service's, and the draft service's. Both keep
per-session state (the verifier a session's KV cache, the drafter its context, cache and tree), so
the gateway keeps affinity itself rather than leaving it to a per-call load balancer: each request
(one session) is pinned to one replica of each service for all its calls, and a new session goes to
the available replica with the fewest sessions in flight.

`--verify` / `--draft` take one address, several separated by commas, or `dns:///NAME:PORT`: every
address NAME resolves to, re-resolved every few seconds (a Kubernetes headless Service lists its
ready pods). A replica that stops answering health checks, or that serves something else than the
first one the gateway connected to, gets no new sessions; one that leaves DNS is dropped once its
sessions have ended. What a session on a lost replica sees differs by service: on a verify replica
it fails (UNAVAILABLE naming the verify service); on a draft replica it loses its drafts and goes on
target-only (gateway.draftwatch), since speculation is an optimisation."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2_grpc

from gateway.draftwatch import PROBE_TIMEOUT_S, DraftWatch
from gateway.load import Load
from specsplit.api.draft.v1 import draft_pb2 as dpb
from specsplit.api.draft.v1 import draft_pb2_grpc as dpb_grpc
from specsplit.api.verify.v1 import verify_pb2_grpc as vpb_grpc
from specsplit.errors import Failure
from specsplit.serving.server import aio_channel
from specsplit.serving.settings import ClientTLS

log = logging.getLogger("specsplit.gateway")
RESOLVE_EVERY_S = 5.0
DNS = "dns:///"


@dataclass
class Replica:
    address: str
    channel: grpc.aio.Channel
    stub: object  # the service's stub (VerifierStub, DrafterStub)
    health: health_pb2_grpc.HealthStub
    serving: bool = False  # new sessions come here once it answered SERVING and fits (Backends)
    fits: bool = False  # it was checked to serve what the first replica serves
    why: str = ""  # why it is not serving, as the last check found
    sessions: int = 0  # requests pinned here now
    gone: bool = False  # no longer resolved: close once its sessions ended
    load: Load = field(default_factory=Load)  # what its sessions' rounds put into its forwards
    watch: DraftWatch | None = None  # a draft replica's: whether it answers in time

    @property
    def available(self) -> bool:
        return self.serving and not self.gone and (self.watch is None or self.watch.up)


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
            raise ValueError(f"{entry!r}: use dns:///NAME:PORT")
        found = {info[4][0] for info in lookup(host, int(port), type=socket.SOCK_STREAM)}
        addresses += sorted(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in found)
    return addresses


class Replicas:
    """The replicas of one service: "verify" (VerifierStub) or "draft" (DrafterStub, each replica
    watched for stalls by its own DraftWatch), as failures name it."""

    STUBS = {"verify": vpb_grpc.VerifierStub, "draft": dpb_grpc.DrafterStub}

    def __init__(self, service: str, spec: str, tls: ClientTLS | None, interceptors=(),
                 lookup: Callable = socket.getaddrinfo, clock: Callable[[], float] = time.monotonic):
        self.service, self.spec, self._tls, self._interceptors, self._lookup, self._clock = \
            service, spec, tls, list(interceptors), lookup, clock
        self._stub = self.STUBS[service]
        self._resolved_at: float | None = None
        self._dynamic = DNS in spec
        # Certificates name the Service, not the pods' IPs.
        self._server_name = next((e.strip().removeprefix(DNS).rpartition(":")[0] for e in spec.split(",")
                                  if e.strip().startswith(DNS)), None)
        self.replicas: dict[str, Replica] = {}
        self.sync(resolve(spec, lookup) if not self._dynamic else [])

    def _watch(self, replica: Replica) -> DraftWatch | None:
        """A draft replica's DraftWatch, named in the log as the service when it is the only one."""
        if self.service != "draft":
            return None
        name = "draft service" if not self._dynamic and "," not in self.spec else f"draft replica {replica.address}"
        return DraftWatch(lambda: replica.stub.Info(dpb.InfoRequest(), timeout=PROBE_TIMEOUT_S), name=name)

    def sync(self, addresses: list[str]) -> None:
        """Adds the replicas new in `addresses` and marks the missing ones gone."""
        for address in addresses:
            replica = self.replicas.get(address)
            if replica is None:
                options = [("grpc.ssl_target_name_override", self._server_name)] if self._tls and \
                    self._server_name else []
                channel = aio_channel(address, self._tls, self._interceptors, options)
                replica = self.replicas[address] = Replica(address, channel, self._stub(channel),
                                                           health_pb2_grpc.HealthStub(channel))
                replica.watch = self._watch(replica)
                if len(self.replicas) > 1 or self._dynamic:
                    log.info("%s replica %s added", self.service, address)
            elif replica.gone:
                replica.gone = False
        for address, replica in self.replicas.items():
            if address not in addresses and not replica.gone:
                replica.gone = True
                log.warning("%s replica %s left %s: no new sessions", self.service, address, self.spec)

    async def refresh(self, force: bool = False) -> None:
        """Re-resolves a dns:/// spec (at most every RESOLVE_EVERY_S unless `force`; the health loop
        calls this more often); drops replicas that left once their sessions ended."""
        now = self._clock()
        if self._dynamic and (force or self._resolved_at is None or now - self._resolved_at >= RESOLVE_EVERY_S):
            self._resolved_at = now
            try:
                self.sync(await asyncio.to_thread(resolve, self.spec, self._lookup))
            except (OSError, ValueError) as e:  # DNS hiccup: keep what we have
                log.warning("resolving %s: %s", self.spec, e)
        for address, replica in list(self.replicas.items()):
            if replica.gone and replica.sessions == 0:
                del self.replicas[address]
                await self._drop(replica)

    async def first(self, timeout_s: float, every_s: float = 0.5) -> Replica:
        """A replica to ask what the service serves (they must all serve the same): waits up to
        `timeout_s` for a dns:/// spec to resolve to something (pods become ready after the gateway)."""
        deadline = self._clock() + timeout_s
        while not self.replicas:
            if self._clock() >= deadline:
                raise RuntimeError(f"{self.service} service: {self.spec} resolved to no address within {timeout_s} s")
            await asyncio.sleep(every_s)
            await self.refresh(force=True)
        return next(iter(self.replicas.values()))

    def other(self, avoid: set[str] = frozenset()) -> Replica | None:
        """The available replica with the fewest sessions in flight (ties: the first listed), other
        than those at the addresses in `avoid`; None when there is none."""
        return min((r for r in self.replicas.values() if r.available and r.address not in avoid),
                   key=lambda r: r.sessions, default=None)

    def pick(self) -> Replica:
        """other(), or UNAVAILABLE saying why no replica can take a new session."""
        replica = self.other()
        if replica is None:
            raise Failure(grpc.StatusCode.UNAVAILABLE, f"{self.service} service: {self.why_none()}")
        return replica

    async def wait_pick(self, timeout_s: float, every_s: float = 0.1) -> Replica:
        """pick(), waiting up to `timeout_s` for a replica to become available (one restarting, or
        draining while another starts) before failing as pick() does."""
        deadline = time.monotonic() + timeout_s
        while (replica := self.other()) is None and time.monotonic() < deadline:
            await asyncio.sleep(every_s)
        return replica or self.pick()

    @property
    def serving(self) -> bool:
        """Some replica can take a new session."""
        return self.other() is not None

    def why_none(self) -> str:
        """Why no replica can take a new session (for messages)."""
        if not self.replicas:
            return f"{self.spec} resolves to no address"
        why = {address: (r.watch.reason if r.watch is not None and not r.watch.up else
                         "left DNS" if r.gone else r.why or "no health check answered yet")
               for address, r in self.replicas.items()}
        if len(why) == 1:
            return next(iter(why.values()))
        return f"no replica of {self.spec} is serving ({'; '.join(f'{a}: {w}' for a, w in why.items())})"

    async def _drop(self, replica: Replica) -> None:
        if replica.watch is not None:
            replica.watch.close()
        await replica.channel.close()

    async def close(self) -> None:
        for replica in self.replicas.values():
            await self._drop(replica)
        self.replicas.clear()

"""The gateway's two backends, the verify and draft services: their replicas, what they serve and
whether it fits together (tokenizer, target weights, drafters), where each drafter drafts, and the
health watch that takes replicas in and out of rotation."""

from __future__ import annotations

import asyncio
import logging
from typing import NamedTuple

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway import policy
from gateway.controller import Controller
from gateway.replicas import Replicas
from gateway.upstream import Upstream
from specsplit.api.draft.v1 import draft_pb2 as dpb
from specsplit.api.verify.v1 import verify_pb2 as vpb
from specsplit.model.identity import pairing_problem, tokenizer_fingerprint
from specsplit.serving import shm
from specsplit.serving.settings import GatewaySettings

VERIFY_SERVICE = vpb.DESCRIPTOR.services_by_name["Verifier"].full_name
DRAFT_SERVICE = dpb.DESCRIPTOR.services_by_name["Drafter"].full_name
HEALTH_EVERY_S = 0.5  # how often the gateway checks its backends' health

log = logging.getLogger("specsplit.gateway")


def incompatibility(target: vpb.InfoResponse, drafters: dict[str, dpb.DrafterInfo], name: str) -> str:
    """Why drafter `name` cannot draft for `target`, or "" when it can."""
    drafter = drafters.get(name)
    if drafter is None:
        return f"unknown drafter {name!r}; the draft service has {sorted(drafters)}"
    return pairing_problem(f"drafter {name!r} ({drafter.model_id})", drafter.tokenizer_fingerprint,
                           drafter.target_model_fingerprint, target.tokenizer_fingerprint, target.model_fingerprint)


async def _check(stub: health_pb2_grpc.HealthStub) -> tuple[bool, str]:
    """A backend's health: (serving, why not)."""
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_EVERY_S * 2)
        return reply.status == health_pb2.HealthCheckResponse.SERVING, "not SERVING"
    except grpc.aio.AioRpcError as e:
        return False, f"{e.code().name}: {e.details()}"


def _drafters_signature(drafters) -> list[tuple]:
    """What a draft replica must serve alike for sessions to go to any of them."""
    return sorted((d.name, d.kind, d.model_id, d.tokenizer_fingerprint, d.target_model_fingerprint, d.needs_features)
                  for d in drafters)


class OwnDrafts(NamedTuple):
    """Where a request's drafter drafts (Backends.own_drafts)."""

    in_verifier: bool  # every draft made by the verify service: no draft session, no round crosses
    lookup: bool  # the verifier's prompt lookup drafts (in its own steps, or in an AUTO request's runs)
    head: bool  # the verifier's feature head drafts where the lookup finds nothing

class Backends:
    """Channels to the draft and verify services' replicas and what the gateway learnt from them at
    start."""

    def __init__(self, settings: GatewaySettings, tokenizer, interceptors=()):
        self.settings = settings
        self.tokenizer = tokenizer
        self.verify = Replicas("verify", settings.verify_address, settings.upstream_tls, interceptors)
        self.draft = Replicas("draft", settings.draft_address, settings.upstream_tls, interceptors)
        self.upstream = Upstream()
        self.controller = Controller(settings.controller)
        # The co-located fast path: this gateway's shared-memory segments (None: off or no /dev/shm).
        self.segments = shm.Creator() if settings.server.shared_memory and shm.available() else None
        self.target: vpb.InfoResponse | None = None
        self.drafters: dict[str, dpb.DrafterInfo] = {}
        self.default_drafter = ""
        # The drafters that copy from the context (kind ngram): requests for one are drafted in the
        # verifier (docs/architecture.md#drafted-in-the-verifier), and AUTO weighs the first against
        # the default.
        self.copiers: list[str] = []

    async def connect(self) -> None:
        """Waits for both services and checks that they fit together; raises with a clear message
        when they do not. Requests are refused as UNAVAILABLE until this has finished."""
        timeout = self.settings.connect_timeout_s
        first = await self.verify.first(timeout)
        target = await first.stub.Info(vpb.InfoRequest(), timeout=timeout, wait_for_ready=True)
        ours = tokenizer_fingerprint(self.tokenizer)
        if ours != target.tokenizer_fingerprint:
            raise RuntimeError(f"the gateway's tokenizer ({ours}) is not the target's "
                               f"({target.tokenizer_fingerprint}); pass the target's --tokenizer")
        first = await self.draft.first(timeout)
        info = await first.stub.Info(dpb.InfoRequest(), timeout=timeout, wait_for_ready=True)
        drafters = {d.name: d for d in info.drafters}
        default = self.settings.default_drafter or info.default_drafter
        problem = incompatibility(target, drafters, default)
        if problem:
            raise RuntimeError(f"default drafter: {problem}")
        if self.settings.policy_file:
            for warning in policy.apply(self.settings.policy_file, self.controller, target, drafters):
                log.warning("%s", warning)
        self.drafters, self.default_drafter, self.target = drafters, default, target
        self.copiers = [name for name, d in sorted(drafters.items()) if d.kind == "ngram"]
        self.controller.cost_curve = list(target.forward_ms_by_rows)  # what a forward of n rows costs
        for replicas in (self.verify, self.draft):  # the others in rotation once they fit
            for replica in replicas.replicas.values():
                replica.serving, replica.why = await self._fits(replicas, replica)

    def incompatibility(self, name: str) -> str:
        return incompatibility(self.target, self.drafters, name)

    def own_drafts(self, name: str, greedy: bool) -> OwnDrafts:
        """Where drafter `name` drafts, and what the verifier drafts itself: an n-gram drafter's
        copies are the verifier's prompt lookup; a self or hybrid drafter whose head the verifier
        runs (InfoResponse.head_model_id) is drafted there too, for greedy requests (its head drafts
        chains of the target's own choices), so that a round crosses no process; any other drafter
        drafts in the draft service, with the verifier's lookup and head in an AUTO request's runs
        without asking (docs/architecture.md#drafted-in-the-verifier)."""
        kind, head = self.drafters[name].kind, self.target.head_model_id if greedy else ""
        heads = bool(head) and kind in ("self", "hybrid") and self.drafters[name].model_id == head
        if kind == "ngram" or heads:
            return OwnDrafts(in_verifier=True, lookup=kind != "self", head=heads)
        return OwnDrafts(in_verifier=False, lookup=True, head=bool(head))

    async def watch_health(self, report) -> None:
        """Health that tells the truth: the gateway is SERVING only while some verify replica says
        SERVING; each backend also has an entry under its own service name. A draft replica that
        is not SERVING costs speculation, not service: it is marked down (DraftWatch), its sessions
        go on without drafts, and new sessions go to another draft replica, else run without
        speculation until one answers again."""
        seen: dict[str, bool] = {}
        while True:
            for name, replicas in ((VERIFY_SERVICE, self.verify), (DRAFT_SERVICE, self.draft)):
                await replicas.refresh()
                members = list(replicas.replicas.values())
                checks = await asyncio.gather(*(_check(r.health) for r in members))  # at once: one dead
                for replica, (serving, why) in zip(members, checks):  # replica must not delay the others
                    if serving and not replica.fits:
                        serving, why = await self._fits(replicas, replica)
                    if not serving and replica.watch is not None:
                        replica.watch.lost(f"{replicas.service} replica {replica.address} health check: {why}")
                    if serving != replica.serving and len(replicas.replicas) > 1:
                        log.warning("%s replica %s is %s", replicas.service, replica.address,
                                    "SERVING again" if serving else f"down ({why})")
                    replica.serving, replica.why = serving, "" if serving else why
                serving = replicas.serving
                if seen.get(name) != serving:
                    if name in seen:
                        log.warning("%s is %s", name, "SERVING again" if serving else f"down ({replicas.why_none()})")
                    seen[name] = serving
                    await report(name, serving)
                    if name == VERIFY_SERVICE:
                        await report("", serving)
            await asyncio.sleep(HEALTH_EVERY_S)

    async def _fits(self, replicas: Replicas, replica) -> tuple[bool, str]:
        """A replica serves what the gateway connected to (a verify replica the same target weights
        and tokenizer, a draft replica the same drafters), else it is kept out of rotation."""
        try:
            info = await replica.stub.Info(vpb.InfoRequest() if replicas.service == "verify" else dpb.InfoRequest(),
                                           timeout=HEALTH_EVERY_S * 4)
        except grpc.aio.AioRpcError as e:
            return False, f"{e.code().name}: {e.details()}"
        if replicas.service == "verify" and (info.model_fingerprint, info.tokenizer_fingerprint) != \
                (self.target.model_fingerprint, self.target.tokenizer_fingerprint):
            return False, (f"serves {info.model_id} ({info.model_fingerprint}), not the target "
                           f"{self.target.model_id} ({self.target.model_fingerprint})")
        if replicas.service == "draft" and _drafters_signature(info.drafters) != \
                _drafters_signature(self.drafters.values()):
            return False, (f"serves drafters {sorted(d.name for d in info.drafters)} unlike the first replica's "
                           f"{sorted(self.drafters)} (each must serve the same drafters with the same models)")
        replica.fits = True
        return True, ""

    async def close(self) -> None:
        await self.upstream.drain(timeout_s=5)
        self.upstream.close()
        await self.verify.close()
        await self.draft.close()
        if self.segments is not None:
            self.segments.close()

"""The verify replica a session is pinned to, and moving it when that replica dies or restarts: the
session is re-opened on a live replica with everything it committed (PrefillRequest.resume), so the
request goes on where it was (docs/protocol.md#when-a-service-fails)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import grpc

from gateway.replicas import Replica
from gateway.state import Request
from gateway.upstream import Deadline, Upstream
from specsplit.api.common.v1 import common_pb2 as cpb
from specsplit.api.verify.v1 import verify_pb2 as vpb
from specsplit.errors import Failure
from specsplit.serving import wire

# A verify call that failed because its replica died or restarted (its sessions went with it: the
# connection is gone, the session unknown, or the call cut off by a shutdown).
GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.CANCELLED)
POLL_S = 0.1  # while no replica takes a lost session back


class VerifierGone(Exception):
    """A round's verify call failed with one of GONE (`failure`)."""

    def __init__(self, failure: Failure):
        super().__init__(str(failure))
        self.failure = failure


def prefill_request(request: Request, resume: bool = False) -> vpb.PrefillRequest:
    """The session's Prefill: its prompt; to resume it on another replica, the prompt and every
    committed token (PrefillRequest.resume), without the prompt's log-probabilities again."""
    plan = request.plan
    logprobs = cpb.LogprobsRequest()
    logprobs.CopyFrom(plan.logprobs)
    logprobs.prompt = logprobs.prompt and not resume
    return vpb.PrefillRequest(
        session_id=request.session_id, prompt_token_ids=[*plan.prompt_ids, *request.cursor.output] if resume
        else plan.prompt_ids, return_features=plan.needs_features, sampling=wire.sampling_message(plan.sampling),
        shm_segment=request.links.segment.name if request.links.segment else "",
        skip_prefix_cache=plan.skip_prefix_cache and not resume, logprobs=logprobs,
        stop_token_ids=sorted(plan.eos_ids), resume=resume, constraint=plan.constraint,
        output_tokens=len(request.cursor.output) if resume else 0)


async def release(verifier, session_id: str) -> None:
    """A Release on that verify stub, errors ignored (its replica may be gone)."""
    with contextlib.suppress(grpc.RpcError):
        await verifier.Release(vpb.ReleaseRequest(session_id=session_id), timeout=2)


class VerifyPin:
    """`replica` holds the session (it counts it, and its `load` has its rounds); `other(tried)`
    names an available replica other than those addresses, or None; a lost session waits up to
    `wait_s` for one to take it back."""

    def __init__(self, replica: Replica, upstream: Upstream, other: Callable[[set[str]], Replica | None],
                 wait_s: float):
        self.replica, self._up, self._other, self._wait_s = replica, upstream, other, wait_s

    @property
    def stub(self):
        return self.replica.stub

    @property
    def load(self):
        return self.replica.load

    async def reopen(self, request: Request, failure: Failure, deadline: Deadline,
                     resume: bool = False) -> vpb.PrefillResponse:
        """The session's Prefill (resume: with what it committed) on a live replica, another than the
        one that failed where there is one; waits up to wait_s for one to take it, then fails
        UNAVAILABLE saying so. The session is pinned to that replica from then on."""
        lost, message = self.replica.address, prefill_request(request, resume)
        give_up = time.monotonic() + self._wait_s
        while True:
            replica = self._other({lost}) or self._other(set())
            if replica is not None:
                if replica is not self.replica:  # what the old one may still hold, if it did not die
                    self._up.in_background(release(self.stub, request.session_id))
                self._move(request.session_id, replica)
                try:
                    return await self._up.call(self.stub.Prefill, message, "verify",
                                               deadline.for_prefill(len(message.prompt_token_ids)))
                except Failure as e:
                    if e.code == grpc.StatusCode.ALREADY_EXISTS:  # it did not die: it still holds the session
                        await release(self.stub, request.session_id)
                    elif e.code not in GONE:
                        raise
                    failure = e
            if time.monotonic() >= give_up:
                raise Failure(grpc.StatusCode.UNAVAILABLE, f"{failure.message}; no verify replica took the session "
                                                           f"back within {self._wait_s:g} s")
            await asyncio.sleep(POLL_S)

    def _move(self, session_id: str, replica: Replica) -> None:
        if replica is self.replica:
            return
        self.load.leave(session_id)
        self.replica.sessions -= 1
        replica.sessions += 1
        self.replica = replica
        self.load.enter(session_id)

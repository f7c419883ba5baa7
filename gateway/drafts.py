"""A request's drafter side, for the round loop (gateway.rounds): its session on a draft replica
(started beside the verifier's prefill; moved to another replica when one refuses it), what the
drafter is owed (target features; committed tokens go through the request's Cursor), each round's
draft (asked for, pre-drafted, or none) cut to what pays, pre-drafting the next block while a Verify
is in flight, and losing the drafter: the request then goes on target-only, which is spec-off
decoding (the same tokens under greedy and coupled sampling)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from gateway import payloads
from gateway.gate import Gate
from gateway.payloads import Links
from gateway.plan import Plan
from gateway.replicas import Replica
from gateway.upstream import Deadline, Upstream
from specsplit.api.common.v1 import common_pb2 as cpb
from specsplit.api.draft.v1 import draft_pb2 as dpb
from specsplit.api.verify.v1 import verify_pb2 as vpb
from specsplit.errors import Failure
from specsplit.speculation import tokentree
from specsplit.speculation.cursor import Cursor

log = logging.getLogger("specsplit.gateway")
now = time.perf_counter_ns
ROUND_OVERHEAD_MS = 0.5  # a round's link and gateway work beyond compute, co-located (docs/metrics.md#time)
# A draft replica that refused a StartSession outright (down, or its session table full): nothing
# started there, so the session may start on another replica instead.
_START_ELSEWHERE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


class Rounds(Protocol):
    rounds: list  # the request's rounds so far (gateway.state.Measured)


class Drafting(Protocol):
    """What a DraftSide reads of its request (gateway.state.Request, which owns all of it): the
    plan, the round protocol's cursor, the gate's per-round verdict, how many rounds went before and
    the links; DraftSide writes none of it, and closes only the drafter's own link when it loses it."""

    plan: Plan
    session_id: str
    cursor: Cursor
    gate: Gate
    links: Links
    measured: Rounds


@dataclass
class Predraft:
    """What became of a round's pre-draft (DraftSide.take_verdict)."""

    attempted: bool = False
    hit: bool = False  # its assumption held: it is the next round's draft


@dataclass
class Draft:
    """What a round sends the verifier, and where it came from."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # a token tree's parent indices; empty: a chain
    probs: list[cpb.SparseProbs] = field(default_factory=list)  # rejection sampling's q per draft, inline
    probs_ref: cpb.ShmRef | None = None  # or in the session's shared memory
    guess: int | None = None  # the drafter's token after the last draft: what a pre-draft assumes
    source: str = ""
    asked: bool = False  # the round asked the drafter (or used a pre-draft): the gate learns from it
    predrafted: bool = False
    draft_ns: int = 0  # the drafter's compute (server-reported)
    call_ns: int = 0  # the Propose's wall time on the round's critical path (0: none, or pre-drafted)
    expected: float = 0.0  # the drafter's estimate of accepted drafts (sum of kept scores); 0: unscored
    feature_bytes: int = 0  # target features the Propose carried

    @property
    def depth(self) -> int:
        return max(tokentree.depths(self.parents)) if self.parents else len(self.tokens)

    def accepted(self, verdict: vpb.VerifyResponse) -> list[int]:
        """The drafts the verifier accepted, in order."""
        return [self.tokens[i] for i in (verdict.accepted_indices or range(verdict.num_accepted))]


class DraftSide:
    """One request's drafter. `drafting`: it still drafts; else `fallback` says why not from the start
    (drafter-down, drafter-full) and `lost` / `lost_at` why and from which round it stopped."""

    def __init__(self, replica: Replica | None, drafting: bool, upstream: Upstream,
                 other: Callable[[set[str]], Replica | None], forward_ms_by_rows: list[float],
                 others_load: Callable[[str], tuple[int, float]]):
        # `other(tried)`: an available draft replica other than those addresses; `others_load(session)`:
        # the rows and gain the verifier's other sessions put into its forwards (gateway.load).
        self.replica, self.drafting, self._up, self._other = replica, drafting, upstream, other
        self._forward_ms_by_rows, self._others_load = forward_ms_by_rows, others_load
        self.features: cpb.Features | None = None  # target features not yet delivered to the drafter
        self.ready: dpb.ProposeResponse | None = None  # a pre-draft whose assumption held: the next drafts
        self.fallback = ""
        self.lost, self.lost_at = "", 0
        # A StartSession the gateway gave up on may still have run on a draft service that only
        # stalled: the release ends it too.
        self.start_abandoned = False
        self._ahead: asyncio.Future | None = None  # the pre-draft in flight beside a Verify
        self._predraft = None  # its outcome: a ProposeResponse, None (lost drafter) or its exception

    @property
    def stub(self):
        return self.replica.stub

    async def start(self, start: dpb.StartSessionRequest, deadline: Deadline) -> dpb.StartSessionResponse:
        """StartSession under the DraftWatch (a stalled draft replica fails it as DEADLINE_EXCEEDED);
        a replica that refuses it outright (_START_ELSEWHERE) is left for the next available one,
        which the session is then pinned to. Raises the last refusal when none is left."""
        tried: set[str] = set()
        while True:
            try:
                return await self.replica.watch.guard(start.drafter, "start", self._up.call(
                    self.stub.StartSession, start, "draft", deadline))
            except TimeoutError as e:
                raise Failure(grpc.StatusCode.DEADLINE_EXCEEDED, str(e)) from None
            except Failure as e:
                if e.code not in _START_ELSEWHERE:
                    raise
                tried.add(self.replica.address)
                other = self._other(tried)
                if other is None:
                    raise
                if e.code == grpc.StatusCode.UNAVAILABLE:
                    self.replica.watch.lost(str(e))
                log.info("session %s starts on draft replica %s instead of %s: %s", start.session_id,
                         other.address, self.replica.address, e)
                self.replica.sessions -= 1  # the session counts on its new replica from now on
                other.sessions += 1
                self.replica = other

    async def next(self, request: Drafting, gamma: int) -> Draft:
        """This round's draft: the pre-draft that held, or a Propose where the gate asks for one (a
        forced request: every round), cut to what pays; an empty Draft when there is none."""
        plan = request.plan
        proposal, predrafted, self.ready = self.ready, self.ready is not None, None
        self._ahead = self._predraft = None  # a pre-draft beside a Verify that failed assumed its outcome
        draft = Draft(predrafted=predrafted, feature_bytes=payloads.feature_bytes(self.features),
                      asked=predrafted or self.drafting and gamma >= 1 and request.gate.ask())
        if proposal is None and draft.asked:
            t = now()
            proposal = await self._propose(request, self._message(request, gamma + plan.predraft))
            draft.call_ns = now() - t
        if proposal is None:
            return draft
        tokens = proposal.draft_token_ids
        draft.draft_ns, draft.source = proposal.draft_ns, proposal.source
        if proposal.draft_parents:
            keep, draft.parents, draft.expected = self._cut(request, proposal, gamma,
                                                            (draft.call_ns or draft.draft_ns) / 1e6)
        else:
            keep = list(range(min(gamma, len(tokens))))
        draft.tokens = [tokens[i] for i in keep]
        draft.guess = tokens[gamma] if plan.predraft and len(tokens) > gamma else None
        draft.probs, draft.probs_ref = payloads.for_verifier(request.links, proposal, keep)
        return draft

    def predraft(self, request: Drafting, draft: Draft) -> None:
        """Pre-drafting: the next block, drafted while this round's Verify is in flight, assuming
        every draft is accepted and the target's next token is the drafter's own guess."""
        cursor = request.cursor
        if draft.guess is not None and request.plan.max_new_tokens - cursor.generated - len(draft.tokens) - 1 > 0:
            self._ahead = asyncio.ensure_future(self._propose(
                request, self._message(request, request.plan.gamma + 1, ahead=[*draft.tokens, draft.guess])))

    async def wait_predraft(self) -> None:
        """Waits for the pre-draft in flight, if any (whatever became of the Verify)."""
        if self._ahead is not None:
            self._predraft = (await asyncio.gather(self._ahead, return_exceptions=True))[0]

    def take_verdict(self, request: Drafting, draft: Draft, verdict: vpb.VerifyResponse) -> Predraft:
        """After the Verify: a pre-draft whose assumption held becomes the next round's draft, and
        the target features it returned are owed to the drafter. Returns what became of the
        pre-draft, for the round to count."""
        outcome = Predraft()
        if self._ahead is not None:
            predraft, self._ahead, self._predraft = self._predraft, None, None
            outcome.attempted = True
            if isinstance(predraft, BaseException):
                raise predraft
            if (predraft is not None and verdict.num_accepted == len(draft.tokens)
                    and verdict.next_token_id == draft.guess):
                self.ready = predraft
                outcome.hit = True
        if request.plan.needs_features and self.drafting:
            self.owe(verdict.features if verdict.HasField("features") else None, request.links.segment)
        return outcome

    def owe(self, features: cpb.Features | None, segment) -> None:
        """Target features the drafter has not had yet (the prefill's, then each Verify's), after
        those still owed; they go with the next Propose."""
        self.features = payloads.join(self.features, features, segment)

    def start_failed(self, why: str, abandoned: bool) -> None:
        """StartSession failed where the request may go on without drafts: it never drafts (`why`:
        drafter-down, drafter-full), and a start given up on (`abandoned`: it may still have run on
        a stalled replica) is ended at the release too."""
        self.drafting, self.fallback, self.start_abandoned = False, why, abandoned

    def forget_predraft(self) -> None:
        """The round a pre-draft assumed was lost (its verify replica died): the pre-draft is void."""
        self.ready = None

    async def _propose(self, request: Drafting, message: dpb.ProposeRequest) -> dpb.ProposeResponse | None:
        """A Propose within its budget (DraftWatch). None when the draft service failed or overran
        it: the request loses its drafter."""
        kind = "next" if request.measured.rounds else "first"  # a first Propose may carry the prompt's features
        try:
            return await self.replica.watch.guard(request.plan.drafter, kind, request.links.drafter.call(message))
        except (Failure, TimeoutError) as e:
            self.lose(request, str(e))
            return None

    def lose(self, request: Drafting, why: str) -> None:
        if not self.drafting:
            return  # already lost (a pre-draft and a round's Propose can both fail)
        self.lost, self.lost_at, self.fallback = why, len(request.measured.rounds), "drafter-lost"
        self.drafting, self.ready = False, None
        if request.links.drafter is not None:
            request.links.drafter.close()
        self.replica.watch.lost(why)
        log.warning("session %s goes on without drafts: %s", request.session_id, why)

    def _message(self, request: Drafting, gamma: int, ahead: list[int] = ()) -> dpb.ProposeRequest:
        """Tells the drafter what was committed since it last heard (for a pre-draft, also the block
        under verification and the guess after it: `ahead`) and the features it lacks; they count
        as delivered: a Propose that fails fails the request."""
        base, new_tokens = request.cursor.next_propose(ahead)
        message = dpb.ProposeRequest(session_id=request.session_id, base_length=base,
                                     new_token_ids=new_tokens, gamma=gamma, tree_budget=request.plan.tree_budget,
                                     features=payloads.for_drafter(request.links, self.features))
        self.features = None
        return message

    def _cut(self, request: Drafting, proposal: dpb.ProposeResponse, gamma: int,
             draft_ms: float) -> tuple[list[int], list[int], float]:
        """A proposed token tree cut to what pays: its best-first prefix whose expected tokens per
        millisecond are highest at the verifier's measured cost per width (this round's drafting
        and the link's overhead count too; with other sessions on the replica, the whole batch's
        tokens per millisecond at the width they and this round put into the forward), the
        drafter's scores scaled by how far they have held up (the controller's score_scale), and to
        `gamma` deep; an unscored tree (rejection sampling's, whose layout must not depend on the
        drawn values) by depth only. Returns (the kept indices, their parents, the sum of the kept
        tokens' unscaled scores)."""
        scores = list(proposal.draft_scores)
        if len(scores) != len(proposal.draft_token_ids):
            scores = []
        other_rows, other_gain = self._others_load(request.session_id)
        size = tokentree.worth_verifying([s * request.plan.score_scale for s in scores],
                                         list(self._forward_ms_by_rows), draft_ms + ROUND_OVERHEAD_MS,
                                         other_rows, other_gain) if scores else None
        # Every node takes a cache slot while it is verified: near the context's end the tree's size,
        # not only its depth, must fit what is left (kv holds length - 1; rows are 1 + nodes).
        room = request.cursor.max_context - request.cursor.length
        size = room if size is None else min(size, room)
        keep, parents = tokentree.prune(list(proposal.draft_parents)[:len(proposal.draft_token_ids)], gamma, size)
        return keep, parents, sum(scores[i] for i in keep) if scores else 0.0

    def end_session(self, request: Drafting) -> dpb.EndSessionRequest | None:
        """The release's EndSession (the drafter hears the last committed tokens), or None when the
        draft service holds no session of this request."""
        if not (self.drafting or self.lost or self.start_abandoned):  # a stalled drafter may hold it
            return None
        return dpb.EndSessionRequest(session_id=request.session_id, base_length=request.cursor.base,
                                     new_token_ids=request.cursor.unheard)

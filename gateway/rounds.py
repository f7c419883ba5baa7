"""The round loop: prefill, then draft -> verify until a stop condition; the session is released
after the answer, on every exit path. Per-round facts go into `request.measured.rounds`; stats, spans and
metrics are made from them once the request is done (gateway.instruments)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

import grpc

from gateway import payloads
from gateway.gate import Gate, Prior
from gateway.instruments import Instruments
from gateway.replicas import Replica
from gateway.state import Plan, Request, Round
from gateway.textstream import TextAssembler
from gateway.upstream import Deadline, Upstream
from gateway.verifypin import GONE, VerifierGone, VerifyPin, prefill_request
from specsplit.api.draft.v1 import draft_pb2 as dpb
from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.api.verify.v1 import verify_pb2 as vpb
from specsplit.errors import Failure
from specsplit.serving import shm
from specsplit.spec import tokentree
from specsplit.spec.cursor import Cursor

log = logging.getLogger("specsplit.gateway")
now = time.perf_counter_ns
ROUND_OVERHEAD_MS = 0.5  # a round's link and gateway work beyond compute, co-located (docs/metrics.md#time)
DECODE_AHEAD = 16  # most tokens a round without a draft decodes after its own (a streamed chunk's size)
# A draft service that cannot take an AUTO request's session: it goes on without drafts.
_NO_DRAFTER = {grpc.StatusCode.UNAVAILABLE: "drafter-down", grpc.StatusCode.DEADLINE_EXCEEDED: "drafter-down",
               grpc.StatusCode.RESOURCE_EXHAUSTED: "drafter-full"}
_FINISH = {"": pb.FINISH_REASON_UNSPECIFIED, "length": pb.FINISH_REASON_LENGTH, "context": pb.FINISH_REASON_CONTEXT}


# A draft replica that refused a StartSession outright (down, or its session table full): nothing
# started there, so the session may start on another replica instead.
_START_ELSEWHERE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


class RoundLoop:
    def __init__(self, upstream: Upstream, verify: Replica, draft: Replica | None, tokenizer,
                 target: vpb.InfoResponse, rpc_timeout_s: float, instruments: Instruments,
                 segments: shm.Creator | None = None, segment_bytes: int = 4 << 20,
                 other_draft: Callable[[set[str]], Replica | None] = lambda tried: None,
                 other_verify: Callable[[set[str]], Replica | None] = lambda tried: None,
                 resume_wait_s: float = 30.0):
        # `verify`, `draft`: the replicas this loop's session is pinned to (gateway.replicas; no draft
        # replica: the request does not speculate); `verify.load` is what the other sessions there
        # put into its (batched) forwards. `other_draft(tried)`, `other_verify(tried)`: an available
        # replica of that service other than those addresses, or None. `resume_wait_s`: how long a
        # session whose verify replica died waits for one to take it back.
        self._up, self._tokenizer, self._target = upstream, tokenizer, target
        self._pin = VerifyPin(verify, upstream, other_verify, resume_wait_s)
        self._draft_replica, self._other_draft = draft, other_draft
        self._rpc_timeout_s, self._instruments = rpc_timeout_s, instruments
        self._segments, self._segment_bytes = segments, segment_bytes

    @property
    def _drafter(self):
        return self._draft_replica.stub if self._draft_replica is not None else None

    @property
    def _watch(self):
        return self._draft_replica.watch

    def _pinned(self) -> list[Replica]:
        """The replicas that count the session until it is released."""
        return [r for r in (self._pin.replica, self._draft_replica) if r is not None]

    async def generate(self, plan: Plan, time_remaining=lambda: None) -> AsyncIterator[pb.GenerateChunk]:
        """Yields one chunk per round; the last carries the finish reason and stats."""
        request = Request(plan, uuid.uuid4().hex, Cursor(plan.max_new_tokens, self._target.max_context),
                          plan.speculate and self._drafter is not None,
                          gate=Gate(plan.prior or Prior(), always=plan.prior is None))
        request.measured.started = now()
        for replica in self._pinned():
            replica.sessions += 1
        try:
            request.links.segment = self._segment(request)
            deadline = Deadline(time_remaining, self._rpc_timeout_s)
            self._pin.load.enter(request.session_id)
            with self._instruments.prefill(request):
                await self._prefill(request, deadline)
            text = TextAssembler(self._tokenizer, plan.eos_ids, plan.stop_strings)
            delta = text.add(request.cursor.last, _FINISH[request.cursor.finish()])
            mark = request.measured.decode_mark = now()
            emitted = 0  # tokens sent so far: their logprobs are request.logprobs[:emitted]
            prompt_logprobs = request.prompt_logprobs
            while not delta.finish:
                logprobs = request.logprobs[emitted:emitted + len(delta.token_ids)]
                emitted += len(delta.token_ids)
                yield pb.GenerateChunk(text=delta.text, token_ids=delta.token_ids, logprobs=logprobs,
                                       prompt_logprobs=prompt_logprobs)
                prompt_logprobs = []
                mark = await self._next(request, mark, deadline)
                delta = text.add(request.cursor.last, _FINISH[request.cursor.finish()])
            stats = self._instruments.finished(request, len(text.token_ids))
            yield pb.GenerateChunk(text=delta.text, token_ids=delta.token_ids, finish_reason=delta.finish, stats=stats,
                                   logprobs=request.logprobs[emitted:emitted + len(delta.token_ids)],
                                   prompt_logprobs=prompt_logprobs)
        finally:
            self._pin.load.leave(request.session_id)
            self._up.in_background(self._release(request))

    async def _next(self, request: Request, mark: int, deadline: Deadline) -> int:
        """The next round (from `mark`); where its verify replica died under it, the session is
        re-opened on a live one and the round runs again (nothing of it was committed)."""
        while True:
            try:
                return await self._round(request, mark)
            except VerifierGone as gone:
                await self._resume(request, gone.failure, deadline)
                mark = now()

    async def _round(self, request: Request, mark: int) -> int:
        """One draft -> verify round from `mark` (when the previous one ended); returns when it ended.
        With pre-drafting the next block is drafted while the Verify is in flight, assuming every
        draft is accepted and the target's next token is the drafter's own guess."""
        plan = request.plan
        cursor = request.cursor
        gamma = cursor.room(plan.gamma)
        proposal, predrafted, request.ready = request.ready, request.ready is not None, None
        feature_bytes, draft_call = payloads.feature_bytes(request.features), 0
        asked = predrafted or request.drafting and gamma >= 1 and request.gate.ask()
        if proposal is None and asked:
            t = now()
            proposal = await self._draft(request, self._propose(request, gamma + plan.predraft))
            draft_call = now() - t
        drafts, parents, guess, probs, ref, draft_ns, source, expected = [], [], None, [], None, 0, "", 0.0
        if proposal is not None:
            tokens = proposal.draft_token_ids
            draft_ns, source = proposal.draft_ns, proposal.source
            if proposal.draft_parents:
                keep, parents, expected = self._tree(request, proposal, gamma, (draft_call or draft_ns) / 1e6)
            else:
                keep = list(range(min(gamma, len(tokens))))
            drafts = [tokens[i] for i in keep]
            guess = tokens[gamma] if plan.predraft and len(tokens) > gamma else None
            probs, ref = payloads.for_verifier(request.links, proposal, keep)
        # No draft: the verifier decodes on its own until the next ask (AUTO's gate), the budget or
        # DECODE_AHEAD tokens, without a trip back here per token.
        gate = request.gate
        decode = 0 if drafts else cursor.room(min(DECODE_AHEAD, gate.off_run() - 1) if request.drafting
                                              else DECODE_AHEAD)
        # An AUTO request decoding alone drafts from its own context inside the verifier (prompt lookup:
        # no trip to the draft service for a copy).
        lookup = plan.gamma if decode and request.drafting and not gate.always else 0
        check = vpb.VerifyRequest(session_id=request.session_id, length=cursor.length, draft_token_ids=drafts,
                                  draft_probs=probs, draft_probs_shm=ref, draft_parents=parents, decode_ahead=decode,
                                  lookup_gamma=lookup)
        t = now()
        ahead = None
        if guess is not None and plan.max_new_tokens - cursor.generated - len(drafts) - 1 > 0:
            ahead = asyncio.ensure_future(self._draft(
                request, self._propose(request, plan.gamma + 1, ahead=[*drafts, guess])))
        try:
            verdict = await request.links.verifier.call(check)
        except Failure as e:
            if e.code in GONE:
                raise VerifierGone(e) from e
            raise
        finally:
            verify_call = now() - t
            if ahead is not None:
                pre = (await asyncio.gather(ahead, return_exceptions=True))[0]
        if ahead is not None:
            request.measured.predraft_attempts += 1
            if isinstance(pre, BaseException):
                raise pre
            if pre is not None and verdict.num_accepted == len(drafts) and verdict.next_token_id == guess:
                request.ready, request.measured.predraft_hits = pre, request.measured.predraft_hits + 1
        if plan.needs_features and request.drafting:
            request.features = payloads.join(request.features, verdict.features if verdict.HasField("features")
                                             else None, request.links.segment)
        request.logprobs += verdict.logprobs
        path = verdict.accepted_indices or range(verdict.num_accepted)
        cursor.commit([*(drafts[i] for i in path), verdict.next_token_id, *verdict.decoded_token_ids], verdict.length,
                      drafter_holds_them=request.ready is not None)
        self._pin.load.report(request.session_id, 1 + len(drafts), len(cursor.last))
        end = now()
        gate.record(asked, len(cursor.last), (end - mark) / 1e6)
        gate.extend(cursor.last)
        request.measured.rounds.append(Round(
            len(drafts), verdict.num_accepted, draft_ns, draft_call, verdict.forward_ns, verify_call, end - mark,
            source, feature_bytes, payloads.proposal_bytes(probs, ref), predrafted,
            max(tokentree.depths(parents)) if parents else len(drafts), expected, verdict.batch_rows,
            verdict.batch_calls, len(verdict.decoded_token_ids), verdict.lookup_drafted, verdict.lookup_accepted))
        return end

    async def _draft(self, request: Request, message: dpb.ProposeRequest) -> dpb.ProposeResponse | None:
        """A Propose within its budget (DraftWatch). None when the draft service failed or overran
        it: the request loses its drafter and goes on target-only, which is spec-off decoding (the
        same tokens under greedy and coupled sampling; rejection sampling's output distribution)."""
        kind = "next" if request.measured.rounds else "first"  # a first Propose may carry the prompt's features
        try:
            return await self._watch.guard(request.plan.drafter, kind, request.links.drafter.call(message))
        except (Failure, TimeoutError) as e:
            self._lose(request, str(e))
            return None

    def _lose(self, request: Request, why: str) -> None:
        if not request.drafting:
            return  # already lost (a pre-draft and a round's Propose can both fail)
        request.lost, request.lost_at, request.fallback = why, len(request.measured.rounds), "drafter-lost"
        request.drafting, request.ready = False, None
        if request.links.drafter is not None:
            request.links.drafter.close()
        self._watch.lost(why)
        log.warning("session %s goes on without drafts: %s", request.session_id, why)

    def _tree(self, request: Request, proposal: dpb.ProposeResponse, gamma: int,
              draft_ms: float) -> tuple[list[int], list[int], float]:
        """A proposed token tree cut to what pays: its best-first prefix whose expected tokens per
        millisecond are highest at the verifier's measured cost per width (this round's drafting
        and the link's overhead count too; with other sessions on the replica, the whole batch's
        tokens per millisecond at the width they and this round put into the forward), the
        drafter's scores scaled by how far they have held up (the controller's score_scale), and to
        `gamma` deep; an unscored tree (rejection
        sampling's, whose layout must not depend on the drawn values) by depth only. Returns (the
        kept indices, their parents, the sum of the kept tokens' unscaled scores)."""
        scores = list(proposal.draft_scores)
        if len(scores) != len(proposal.draft_token_ids):
            scores = []
        other_rows, other_gain = self._pin.load.others(request.session_id)
        size = tokentree.worth_verifying([s * request.plan.score_scale for s in scores],
                                         list(self._target.forward_ms_by_rows), draft_ms + ROUND_OVERHEAD_MS,
                                         other_rows, other_gain) if scores else None
        # Every node takes a cache slot while it is verified: near the context's end the tree's size,
        # not only its depth, must fit what is left (kv holds length - 1; rows are 1 + nodes).
        room = request.cursor.max_context - request.cursor.length
        size = room if size is None else min(size, room)
        keep, parents = tokentree.prune(list(proposal.draft_parents)[:len(proposal.draft_token_ids)], gamma, size)
        return keep, parents, sum(scores[i] for i in keep) if scores else 0.0

    def _propose(self, request: Request, gamma: int, ahead: list[int] = ()) -> dpb.ProposeRequest:
        """Tells the drafter what was committed since it last heard (for a pre-draft, also the block
        under verification and the guess after it: `ahead`) and the features it lacks; they count
        as delivered: a Propose that fails fails the request."""
        base, new_tokens = request.cursor.tell(ahead)
        message = dpb.ProposeRequest(session_id=request.session_id, base_length=base,
                                     new_token_ids=new_tokens, gamma=gamma, tree_budget=request.plan.tree_budget,
                                     features=payloads.for_drafter(request.links, request.features))
        request.features = None
        return message

    def _segment(self, request: Request) -> shm.Segment | None:
        """The session's shared memory, offered to both services (spec-off too: mapping it is what
        proves a service co-located and opens the fast path); None: everything goes by gRPC."""
        plan = request.plan
        if self._segments is None:
            return None
        row_bytes = 0
        if plan.needs_features:
            row_bytes = self._target.hidden_size * payloads.ELEMENT_BYTES.get(self._target.dtype, 4)
        try:
            return self._segments.create(request.session_id, row_bytes, self._segment_bytes, self._target.max_context)
        except OSError as e:
            log.warning("no shared memory for session %s: %s", request.session_id, e)
            return None

    async def _prefill(self, request: Request, deadline: Deadline) -> None:
        """Prefills the verifier and starts the drafter's session in parallel, then opens the
        session's round links; commits the first token, keeps the prompt's features for drafters
        that read them, and turns drafting off when an AUTO request's draft service is down."""
        plan, up = request.plan, self._up
        name = request.links.segment.name if request.links.segment else ""
        t = request.measured.prefill_mark = now()
        prefill = up.call(self._pin.stub.Prefill, prefill_request(request), "verify",
                          deadline.for_prefill(len(plan.prompt_ids)))
        started = None
        if request.drafting:
            start = dpb.StartSessionRequest(
                session_id=request.session_id, drafter=plan.drafter, prompt_token_ids=plan.prompt_ids,
                target_tokenizer_fingerprint=self._target.tokenizer_fingerprint,
                target_model_fingerprint=self._target.model_fingerprint, sampling=plan.sampling,
                shm_segment=name, target_forward_ms_by_rows=self._target.forward_ms_by_rows,
                task_type=plan.task_type)
            verified, started = await asyncio.gather(prefill, self._start(start, deadline), return_exceptions=True)
        else:
            verified = (await asyncio.gather(prefill, return_exceptions=True))[0]
        if isinstance(verified, Failure) and verified.code in GONE:  # its replica died before answering
            lost = now()
            verified = await self._pin.reopen(request, verified, deadline)
            request.measured.resumes += 1
            request.measured.resume_ns += now() - lost
        elif isinstance(verified, BaseException):
            raise verified
        if isinstance(started, Failure) and plan.may_fall_back and started.code in _NO_DRAFTER:
            if started.code != grpc.StatusCode.RESOURCE_EXHAUSTED:  # busy is not down
                self._watch.lost(str(started))
            request.start_abandoned = started.code == grpc.StatusCode.DEADLINE_EXCEEDED
            request.drafting, started, request.fallback = False, None, _NO_DRAFTER[started.code]
        elif isinstance(started, BaseException):
            raise started
        links = request.links
        if links.segment is not None:
            links.shm_verify = payloads.proves(verified.shm_nonce, links.segment, "verify")
            links.shm_draft = started is not None and payloads.proves(started.shm_nonce, links.segment, "draft")
        links.verifier = await up.verify_link(self._pin.stub, verified.fast_path if links.shm_verify else "", deadline)
        if request.drafting:
            try:
                links.drafter = await up.draft_link(self._drafter, started.fast_path if links.shm_draft else "",
                                                    deadline)
            except Failure as e:
                self._lose(request, str(e))
        request.links.fast_path = bool(request.links.shm_verify and verified.fast_path)
        request.measured.prefill_ns, request.measured.prefill_verify_ns = now() - t, verified.forward_ns
        request.measured.prefix_cached, request.measured.prefill_chunks = verified.cached_tokens, verified.chunks
        request.cursor.start(len(plan.prompt_ids), verified.next_token_id, verified.length)
        request.gate.extend([*plan.prompt_ids, verified.next_token_id])
        request.logprobs, request.prompt_logprobs = list(verified.logprobs), list(verified.prompt_logprobs)
        if plan.needs_features and request.drafting:
            request.features = verified.features

    async def _resume(self, request: Request, failure: Failure, deadline: Deadline) -> None:
        """The session's verify replica died (or restarted) under a round: it is re-opened on a live
        replica with everything it committed, and its round link with it. Greedy and seeded output
        go on exactly (sampling noise follows seed and position; the gateway holds every committed
        token); the stream has sent nothing of the lost round."""
        t = now()
        request.ready = None  # a pre-draft assumed the lost round's outcome
        links = request.links
        links.verifier.close()
        verified = await self._pin.reopen(request, failure, deadline, resume=True)
        if verified.length != request.cursor.length:
            raise Failure(grpc.StatusCode.INTERNAL, f"session {request.session_id} resumed at length "
                                                    f"{verified.length}, not {request.cursor.length}")
        if links.segment is not None:
            links.shm_verify = payloads.proves(verified.shm_nonce, links.segment, "verify")
        links.verifier = await self._up.verify_link(self._pin.stub, verified.fast_path if links.shm_verify else "",
                                                    deadline)
        links.fast_path = bool(links.shm_verify and verified.fast_path)
        request.measured.resumes += 1
        request.measured.resume_ns += now() - t
        log.warning("session %s resumed on verify replica %s after %d tokens (%.0f ms): %s", request.session_id,
                    self._pin.replica.address, request.cursor.generated, (now() - t) / 1e6, failure)

    async def _start(self, start: dpb.StartSessionRequest, deadline: Deadline):
        """StartSession under the DraftWatch (a stalled draft replica fails it as DEADLINE_EXCEEDED);
        a replica that refuses it outright (_START_ELSEWHERE) is left for the next available one,
        which the session is then pinned to. Raises the last refusal when none is left."""
        tried: set[str] = set()
        while True:
            try:
                return await self._watch.guard(start.drafter, "start", self._up.call(
                    self._drafter.StartSession, start, "draft", deadline))
            except TimeoutError as e:
                raise Failure(grpc.StatusCode.DEADLINE_EXCEEDED, str(e)) from None
            except Failure as e:
                if e.code not in _START_ELSEWHERE:
                    raise
                tried.add(self._draft_replica.address)
                other = self._other_draft(tried)
                if other is None:
                    raise
                if e.code == grpc.StatusCode.UNAVAILABLE:
                    self._watch.lost(str(e))
                log.info("session %s starts on draft replica %s instead of %s: %s", start.session_id,
                         other.address, self._draft_replica.address, e)
                self._repin(other)

    def _repin(self, draft: Replica) -> None:
        """The session's draft replica is `draft` from now on (and counts it instead of the old one)."""
        self._draft_replica.sessions -= 1
        draft.sessions += 1
        self._draft_replica = draft

    async def _release(self, request: Request) -> None:
        """Frees the session on both services (the drafter hears the last committed tokens), then
        removes the shared memory; the replicas count the session until then (a replica that left
        DNS closes its channel only once no session needs it)."""
        try:
            for link in (request.links.verifier, request.links.drafter):
                if link is not None:
                    link.close()
            calls = [self._pin.stub.Release(vpb.ReleaseRequest(session_id=request.session_id), timeout=5)]
            if request.drafting or request.lost or request.start_abandoned:  # a stalled drafter may hold it
                calls.append(self._drafter.EndSession(dpb.EndSessionRequest(
                    session_id=request.session_id, base_length=request.cursor.base,
                    new_token_ids=request.cursor.unheard), timeout=5))
            for outcome in await asyncio.gather(*calls, return_exceptions=True):
                if isinstance(outcome, BaseException):
                    log.warning("releasing session %s failed: %s", request.session_id, outcome)
            if request.links.segment is not None:
                self._segments.remove(request.links.segment)
        finally:
            for replica in self._pinned():
                replica.sessions -= 1

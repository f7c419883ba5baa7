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
from gateway.drafts import Draft, DraftSide
from gateway.gate import Gate, Prior
from gateway.instruments import Instruments
from gateway.plan import Plan
from gateway.replicas import Replica
from gateway.state import Request, Round
from gateway.textstream import TextAssembler
from gateway.upstream import Deadline, Upstream
from gateway.verifypin import GONE, VerifierGone, VerifyPin, prefill_request
from specsplit.api.draft.v1 import draft_pb2 as dpb
from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.api.verify.v1 import verify_pb2 as vpb
from specsplit.errors import Failure
from specsplit.serving import hops, shm, wire
from specsplit.speculation.cursor import Cursor

log = logging.getLogger("specsplit.gateway")
now = time.perf_counter_ns
DECODE_AHEAD = 16  # most tokens a round without a draft decodes after its own (a streamed chunk's size)
# A draft service that cannot take an AUTO request's session: it goes on without drafts.
_NO_DRAFTER = {grpc.StatusCode.UNAVAILABLE: "drafter-down", grpc.StatusCode.DEADLINE_EXCEEDED: "drafter-down",
               grpc.StatusCode.RESOURCE_EXHAUSTED: "drafter-full"}
_FINISH = {"": pb.FINISH_REASON_UNSPECIFIED, "length": pb.FINISH_REASON_LENGTH, "context": pb.FINISH_REASON_CONTEXT}



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
        self._draft_replica, self._other_draft = draft, other_draft  # where each new request's drafter starts
        self._rpc_timeout_s, self._instruments = rpc_timeout_s, instruments
        self._segments, self._segment_bytes = segments, segment_bytes

    def _pinned(self, request: Request) -> list[Replica]:
        """The replicas that count the session until it is released."""
        return [r for r in (self._pin.replica, request.drafter.replica) if r is not None]

    async def generate(self, plan: Plan, time_remaining=lambda: None) -> AsyncIterator[pb.GenerateChunk]:
        """Yields one chunk per round; the last carries the finish reason and stats."""
        session_id = uuid.uuid4().hex
        drafting = plan.speculate and not plan.in_verifier and self._draft_replica is not None  # else no draft session
        drafter = DraftSide(self._draft_replica, drafting, self._up, self._other_draft,
                            list(self._target.forward_ms_by_rows), lambda session: self._pin.load.others(session))
        request = Request(plan, session_id, Cursor(plan.max_new_tokens, self._target.max_context), drafter,
                          gate=Gate(plan.prior or Prior(), always=plan.prior is None))
        request.measured.started = now()
        for replica in self._pinned(request):
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
                hops.mark("gateway.yielded")
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
        """One round from `mark` (when the previous one ended): propose -> verify -> commit ->
        record; returns when it ended."""
        drafter, cursor = request.drafter, request.cursor
        hops.mark("gateway.round")
        draft = await drafter.next(request, cursor.draft_room(request.plan.gamma))
        check = self._verify_request(request, draft)
        drafter.predraft(request, draft)  # the next block, while this one is verified
        t = now()
        try:
            verdict = await request.links.verifier.call(check)
        except Failure as e:
            if e.code in GONE:
                raise VerifierGone(e) from e
            raise
        finally:
            verify_call = now() - t
            await drafter.wait_predraft()
        if request.plan.constraint is not None:  # the draft as verified: cut, or carried on with forced tokens
            draft.tokens = list(verdict.verified_draft_ids)
        predraft = drafter.take_verdict(request, draft, verdict)
        request.measured.predraft_attempts += predraft.attempted
        request.measured.predraft_hits += predraft.hit
        request.logprobs += verdict.logprobs
        cursor.commit([*draft.accepted(verdict), verdict.next_token_id, *verdict.decoded_token_ids], verdict.length,
                      drafter_holds_them=drafter.ready is not None)
        self._pin.load.report(request.session_id, 1 + len(draft.tokens), len(cursor.last))
        hops.mark("gateway.committed")
        return self._record(request, mark, draft, verdict, verify_call)

    def _verify_request(self, request: Request, draft: Draft) -> vpb.VerifyRequest:
        """The round's Verify. Without drafts the verifier decodes on its own until the next ask
        (AUTO's gate), the budget or DECODE_AHEAD tokens, without a trip back here per token,
        drafting as it goes (copies from the request's own context, and its feature head where it
        runs the request's: no trip to the draft service) where the request's drafts are made there
        (plan.in_verifier), or is AUTO and drafts."""
        cursor, gate, drafting, plan = request.cursor, request.gate, request.drafter.drafting, request.plan
        decode = 0 if draft.tokens else cursor.draft_room(min(DECODE_AHEAD, gate.off_run() - 1) if drafting
                                                    else DECODE_AHEAD)
        own = decode and (plan.in_verifier or drafting and not gate.always)
        return vpb.VerifyRequest(session_id=request.session_id, length=cursor.length, draft_token_ids=draft.tokens,
                                 draft_probs=draft.probs, draft_probs_shm=draft.probs_ref, draft_parents=draft.parents,
                                 decode_ahead=decode, lookup_gamma=plan.lookup_gamma if own else 0,
                                 head_gamma=plan.head_gamma if own else 0,
                                 forced_room=cursor.draft_room(DECODE_AHEAD) if plan.constraint and request.speculates
                                 else 0)

    def _record(self, request: Request, mark: int, draft: Draft, verdict: vpb.VerifyResponse, verify_call: int) -> int:
        """What the round did, for the gate (now) and the stats (after the answer); returns its end."""
        end = now()
        committed = request.cursor.last
        copy = request.gate.record(draft.asked, len(committed), (end - mark) / 1e6)
        request.gate.extend(committed)
        request.measured.rounds.append(Round(
            drafted=len(draft.tokens), accepted=verdict.num_accepted, draft_ns=draft.draft_ns,
            draft_call_ns=draft.call_ns, verify_ns=verdict.forward_ns, verify_call_ns=verify_call,
            round_ns=end - mark, source=draft.source, feature_bytes=draft.feature_bytes,
            proposal_bytes=payloads.proposal_bytes(draft.probs, draft.probs_ref), predrafted=draft.predrafted,
            depth=draft.depth, expected=draft.expected, batch_rows=verdict.batch_rows,
            batch_calls=verdict.batch_calls, decoded=len(verdict.decoded_token_ids),
            lookup_drafted=verdict.lookup_drafted, lookup_accepted=verdict.lookup_accepted,
            lookup_steps=verdict.lookup_steps, forced=verdict.forced, forced_accepted=verdict.forced_accepted,
            asked=draft.asked, copy=copy, head_drafted=verdict.head_drafted, head_accepted=verdict.head_accepted,
            head_steps=verdict.head_steps, head_ns=verdict.head_ns))
        request.measured.constraint_complete = verdict.constraint_complete
        return end

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
        drafter = request.drafter
        if drafter.drafting:
            start = dpb.StartSessionRequest(
                session_id=request.session_id, drafter=plan.drafter, prompt_token_ids=plan.prompt_ids,
                target_tokenizer_fingerprint=self._target.tokenizer_fingerprint,
                target_model_fingerprint=self._target.model_fingerprint, sampling=wire.sampling_message(plan.sampling),
                shm_segment=name, target_forward_ms_by_rows=self._target.forward_ms_by_rows,
                task_type=plan.task_type)
            verified, started = await asyncio.gather(prefill, drafter.start(start, deadline), return_exceptions=True)
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
                drafter.replica.watch.lost(str(started))
            drafter.start_failed(_NO_DRAFTER[started.code], abandoned=started.code == grpc.StatusCode.DEADLINE_EXCEEDED)
            started = None
        elif isinstance(started, BaseException):
            raise started
        links = request.links
        if links.segment is not None:
            links.shm_verify = payloads.proves(verified.shm_nonce, links.segment, "verify")
            links.shm_draft = started is not None and payloads.proves(started.shm_nonce, links.segment, "draft")
        links.verifier = await up.verify_link(self._pin.stub, verified.fast_path if links.shm_verify else "", deadline)
        if drafter.drafting:
            try:
                links.drafter = await up.draft_link(drafter.stub, started.fast_path if links.shm_draft else "",
                                                    deadline)
            except Failure as e:
                drafter.lose(request, str(e))
        request.links.fast_path = bool(request.links.shm_verify and verified.fast_path)
        request.measured.prefill_ns, request.measured.prefill_verify_ns = now() - t, verified.forward_ns
        request.measured.prefix_cached, request.measured.prefill_chunks = verified.cached_tokens, verified.chunks
        request.cursor.start(len(plan.prompt_ids), verified.next_token_id, verified.length)
        request.gate.extend([*plan.prompt_ids, verified.next_token_id])
        request.logprobs, request.prompt_logprobs = list(verified.logprobs), list(verified.prompt_logprobs)
        if plan.needs_features and drafter.drafting:
            drafter.owe(verified.features, links.segment)

    async def _resume(self, request: Request, failure: Failure, deadline: Deadline) -> None:
        """The session's verify replica died (or restarted) under a round: it is re-opened on a live
        replica with everything it committed, and its round link with it. Greedy and seeded output
        go on exactly (sampling noise follows seed and position; the gateway holds every committed
        token); the stream has sent nothing of the lost round."""
        t = now()
        request.drafter.forget_predraft()
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

    async def _release(self, request: Request) -> None:
        """Frees the session on both services (the drafter hears the last committed tokens), then
        removes the shared memory; the replicas count the session until then (a replica that left
        DNS closes its channel only once no session needs it)."""
        try:
            for link in (request.links.verifier, request.links.drafter):
                if link is not None:
                    link.close()
            calls = [self._pin.stub.Release(vpb.ReleaseRequest(session_id=request.session_id), timeout=5)]
            end = request.drafter.end_session(request)
            if end is not None:
                calls.append(request.drafter.stub.EndSession(end, timeout=5))
            for outcome in await asyncio.gather(*calls, return_exceptions=True):
                if isinstance(outcome, BaseException):
                    log.warning("releasing session %s failed: %s", request.session_id, outcome)
            if request.links.segment is not None:
                self._segments.remove(request.links.segment)
        finally:
            for replica in self._pinned(request):
                replica.sessions -= 1

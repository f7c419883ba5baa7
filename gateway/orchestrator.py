"""The round loop: prefill, then draft -> verify until a stop condition, releasing on every exit."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from array import array
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace

from gateway.controller import Controller, Decision
from gateway.instruments import GatewayMetrics
from gateway.textstream import TextAssembler
from specsplit import shm
from specsplit.common.v1 import common_pb2 as cpb
from specsplit.draft.v1 import draft_pb2 as dpb
from specsplit.draft.v1 import draft_pb2_grpc as dpb_grpc
from specsplit.gateway.v1 import gateway_pb2 as pb
from specsplit.sampling import from_proto
from specsplit.telemetry import tracer
from specsplit.verify.v1 import verify_pb2 as vpb
from specsplit.verify.v1 import verify_pb2_grpc as vpb_grpc

log = logging.getLogger("specsplit.gateway")

# Draft-service failures that let an AUTO request carry on without speculation.
_DRAFTER_DOWN = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


@dataclass(frozen=True)
class Plan:
    """A validated request, in token ids."""

    prompt_ids: list[int]
    max_new_tokens: int
    stop_strings: tuple[str, ...]
    eos_ids: frozenset[int]
    speculate: bool
    may_fall_back: bool  # AUTO: run without speculation if the draft service is down
    gamma: int
    drafter: str
    task_type: str
    needs_features: bool = False  # the drafter reads target features: the verifier returns them
    sampling: cpb.Sampling = field(default_factory=cpb.Sampling)  # temperature 0: greedy
    decision: Decision = Decision(True, 4, "forced")  # the controller's, for this request
    predraft: bool = False  # asynchronous drafting: draft the next block while Verify is in flight


@dataclass
class _Decode:
    """Where a request's decoding stands between rounds."""

    session_id: str
    drafting: bool
    base: int  # position of unsent[0]
    length: int  # committed tokens on the verifier
    unsent: list[int]  # committed tokens the drafter has not heard of
    features: cpb.Features | None  # target features not yet delivered to the drafter
    generated: int
    committed: list[int] = field(default_factory=list)  # tokens the last step committed (for the text)
    segment: shm.Segment | None = None  # the session's shared memory (co-located fast path)
    shm_verify: bool = False  # the verify service mapped it
    shm_draft: bool = False  # the draft service mapped it
    ready: dpb.ProposeResponse | None = None  # a pre-draft whose assumption held: next round's drafts
    predraft_attempts: int = 0
    predraft_hits: int = 0


@dataclass
class Tally:
    rounds: list[pb.RoundRecord] = field(default_factory=list)
    prefill_ms: float = 0.0
    decode_start: float = 0.0


class UpstreamError(Exception):
    """A draft or verify call failed; carries the code to return to the client."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def _join(pending: cpb.Features | None, new: cpb.Features | None, segment: shm.Segment | None) -> cpb.Features | None:
    """Features not delivered yet followed by the new rows (rare: a round without a Propose, or a
    failed pre-draft). Rows in shared memory are read back first, so the result is always valid."""
    if pending is None or not pending.rows:
        return new
    if new is None or not new.rows:
        return pending
    pending, new = shm.fetch_features(segment, pending), shm.fetch_features(segment, new)
    return cpb.Features(start=pending.start, rows=pending.rows + new.rows, dim=new.dim, dtype=new.dtype,
                        data=pending.data + new.data)


_ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def _payload_bytes(features: cpb.Features | None) -> int:
    """Bytes of feature rows carried, inline or in shared memory."""
    return 0 if features is None else features.rows * features.dim * _ELEMENT_BYTES.get(features.dtype, 4)


def _proposal_bytes(inline: list[cpb.SparseProbs], ref: cpb.ShmRef | None) -> int:
    return ref.length if ref is not None else sum(d.ByteSize() for d in inline)


def _ms(ns: int | float) -> float:
    return ns / 1e6


_BACKGROUND: set[asyncio.Task] = set()  # session releases still running after their request answered


async def drain_releases(timeout_s: float) -> None:
    """Lets the releases still running finish (graceful shutdown, before the channels close)."""
    if _BACKGROUND:
        await asyncio.wait(set(_BACKGROUND), timeout=timeout_s)


class Orchestrator:
    def __init__(self, verifier: vpb_grpc.VerifierStub, drafter: dpb_grpc.DrafterStub, tokenizer,
                 target: vpb.InfoResponse, rpc_timeout_s: float, metrics: GatewayMetrics | None = None,
                 transport: dict[str, str] | None = None, controller: Controller | None = None,
                 segments: shm.Creator | None = None, segment_bytes: int = 4 << 20):
        self._verifier = verifier
        self._drafter = drafter
        self._tokenizer = tokenizer
        self._target = target
        self._rpc_timeout_s = rpc_timeout_s
        self._controller = controller or Controller()
        self._metrics = metrics or GatewayMetrics(self._controller)
        # Trace attributes: how each backend is reached ("unix" or "tcp").
        self._transport = {f"specsplit.transport.{k}": v for k, v in (transport or {}).items()}
        self._segments = segments  # None: no shared memory offered
        self._segment_bytes = segment_bytes

    async def generate(self, plan: Plan, time_remaining=lambda: None) -> AsyncIterator[pb.GenerateChunk]:
        """Yields one chunk per verify round; the last carries the finish reason and stats."""
        session_id = uuid.uuid4().hex
        started = time.perf_counter()
        tally = Tally()
        call = _Caller(time_remaining, self._rpc_timeout_s)
        request_span = trace.get_current_span()  # the Generate server span when tracing
        common = {"specsplit.task_type": plan.task_type or "unspecified", **self._transport}
        state = _Decode(session_id, plan.speculate, base=len(plan.prompt_ids), length=len(plan.prompt_ids),
                        unsent=[], features=None, generated=0, segment=self._segment(session_id, plan))
        try:
            prefill_attrs = {**common, "specsplit.prompt_tokens": len(plan.prompt_ids)}
            with tracer().start_as_current_span("prefill", attributes=prefill_attrs):
                await self._prefill(plan, call, state)
            drafting = state.drafting
            tally.prefill_ms = (time.perf_counter() - started) * 1e3
            tally.decode_start = time.perf_counter()
            text = TextAssembler(self._tokenizer, plan.eos_ids, plan.stop_strings)
            delta = text.add(state.committed, self._limit(state.generated, state.length, plan))
            while True:
                if delta.finish:
                    stats = self._stats(plan, tally, started, len(text.token_ids), state)
                    self._metrics.request(stats)
                    self._controller.observe(plan.task_type, plan.drafter, plan.decision, stats, plan.predraft)
                    _describe(request_span, stats, {**common, "specsplit.prompt_digest": _digest(plan.prompt_ids)})
                    yield pb.GenerateChunk(text=delta.text, token_ids=delta.token_ids, finish_reason=delta.finish,
                                           stats=stats)
                    return
                yield pb.GenerateChunk(text=delta.text, token_ids=delta.token_ids)
                # Never draft past max_new_tokens or the context: accepted + 1 must fit.
                gamma = self._room(plan, state)
                position = state.generated
                attrs = {**common, "specsplit.round": len(tally.rounds), "specsplit.position": position,
                         "specsplit.gamma": gamma if drafting else 0}
                with tracer().start_as_current_span("round", attributes=attrs) as span:
                    record = await self._round(plan, call, state, gamma)
                    _describe_round(span, record)
                tally.rounds.append(record)
                self._metrics.round(record, plan.task_type, plan.drafter if drafting else "", position)
                delta = text.add(state.committed, self._limit(state.generated, state.length, plan))
        finally:
            # The answer does not wait for the services to free the session: release in the background.
            task = asyncio.create_task(self._release(state))
            _BACKGROUND.add(task)
            task.add_done_callback(_BACKGROUND.discard)

    def _room(self, plan: Plan, state: _Decode) -> int:
        """Largest gamma whose accepted + 1 tokens fit max_new_tokens and the context."""
        return min(plan.gamma, plan.max_new_tokens - state.generated - 1, self._target.max_context - state.length - 1)

    def _segment(self, session_id: str, plan: Plan) -> shm.Segment | None:
        """The session's shared memory, offered to both services; None: payloads stay inline."""
        if self._segments is None or not plan.speculate:
            return None
        row_bytes = 0
        if plan.needs_features:
            row_bytes = self._target.hidden_size * _ELEMENT_BYTES.get(self._target.dtype, 4)
        try:
            return self._segments.create(session_id, row_bytes, self._segment_bytes, self._target.max_context)
        except OSError as e:
            log.warning("no shared memory for session %s: %s", session_id, e)
            return None

    async def _round(self, plan: Plan, call: _Caller, state: _Decode, gamma: int) -> pb.RoundRecord:
        """One draft -> verify round; advances `state` by the committed tokens. With pre-drafting,
        the next block is drafted while the Verify is in flight, assuming every draft is accepted
        and the target's next token is the drafter's own guess (the one drafted after the block)."""
        round_start = time.perf_counter()
        drafts, guess, draft_probs, probs_ref, draft_ns, draft_rpc_ns, source = [], None, [], None, 0, 0, ""
        feature_bytes = _payload_bytes(state.features)
        proposal, predrafted = state.ready, state.ready is not None
        state.ready = None
        if proposal is None and state.drafting and gamma >= 1:
            t = time.perf_counter_ns()
            proposal = await self._propose(call, state, gamma + plan.predraft)
            draft_rpc_ns = time.perf_counter_ns() - t
        if proposal is not None:
            tokens = list(proposal.draft_token_ids)
            drafts, draft_ns, source = tokens[:gamma], proposal.draft_ns, proposal.source
            guess = tokens[gamma] if plan.predraft and len(tokens) > gamma else None
            draft_probs, probs_ref = self._probs_for_verifier(state, proposal, len(drafts))
        t = time.perf_counter_ns()
        verify = asyncio.ensure_future(call(self._verifier.Verify, vpb.VerifyRequest(
            session_id=state.session_id, length=state.length, draft_token_ids=drafts, draft_probs=draft_probs,
            draft_probs_shm=probs_ref), "verify"))
        ahead = None
        if guess is not None and plan.max_new_tokens - state.generated - len(drafts) - 1 > 0:
            ahead = self._predraft(call, state, [*drafts, guess], plan.gamma + 1)
        try:
            verdict = await verify
        except BaseException:
            verify.cancel()
            if ahead is not None:
                await ahead.settle(hit=False)
            raise
        verify_rpc_ns = time.perf_counter_ns() - t
        if ahead is not None:
            state.predraft_attempts += 1
            hit = verdict.num_accepted == len(drafts) and verdict.next_token_id == guess
            state.ready = await ahead.settle(hit)
            state.predraft_hits += state.ready is not None
        if plan.needs_features and state.drafting:
            state.features = _join(state.features, verdict.features if verdict.HasField("features") else None,
                                   state.segment)
        state.committed = [*drafts[:verdict.num_accepted], verdict.next_token_id]
        if state.ready is not None:  # the drafter already holds these tokens
            state.base, state.unsent = verdict.length, []
        else:
            state.base, state.unsent = state.length, list(state.committed)
        state.length = verdict.length
        state.generated += len(state.committed)
        return pb.RoundRecord(
            drafted=len(drafts), accepted=verdict.num_accepted, draft_ms=_ms(draft_ns),
            verify_ms=_ms(verdict.forward_ns),
            network_ms=_ms(max(0, draft_rpc_ns - draft_ns) + verify_rpc_ns - verdict.forward_ns),
            round_ms=(time.perf_counter() - round_start) * 1e3, draft_source=source,
            feature_bytes=feature_bytes, proposal_bytes=_proposal_bytes(draft_probs, probs_ref),
            predrafted=predrafted)

    async def _propose(self, call: _Caller, state: _Decode, gamma: int) -> dpb.ProposeResponse:
        """Tells the drafter what was committed (and the features it lacks) and asks for gamma tokens."""
        proposal = await call(self._drafter.Propose, dpb.ProposeRequest(
            session_id=state.session_id, base_length=state.base, new_token_ids=state.unsent, gamma=gamma,
            features=self._features_for_drafter(state, state.features)), "draft")
        state.features, state.base, state.unsent = None, state.length, []  # delivered
        return proposal

    def _predraft(self, call: _Caller, state: _Decode, assumed: list[int], gamma: int) -> _Predraft:
        """Starts a Propose that appends `assumed` (the block being verified and the guess after it)
        to the drafter's sequence and drafts on from there."""
        sent = state.features
        request = dpb.ProposeRequest(session_id=state.session_id, base_length=state.base,
                                     new_token_ids=[*state.unsent, *assumed], gamma=gamma,
                                     features=self._features_for_drafter(state, sent))
        state.features = None
        return _Predraft(asyncio.ensure_future(call(self._drafter.Propose, request, "draft")), state, sent)

    def _features_for_drafter(self, state: _Decode, features: cpb.Features | None) -> cpb.Features | None:
        """Features as the draft service can read them: a ring reference only if it mapped the segment."""
        if features is None or state.shm_draft:
            return features
        return shm.fetch_features(state.segment, features)

    def _probs_for_verifier(self, state: _Decode, proposal: dpb.ProposeResponse,
                            count: int) -> tuple[list[cpb.SparseProbs], cpb.ShmRef | None]:
        """The first `count` draft distributions, inline or as a segment reference the verifier can read."""
        if not proposal.HasField("draft_probs_shm"):
            return list(proposal.draft_probs[:count]), None
        ref = proposal.draft_probs_shm
        if state.shm_verify:
            length = state.segment.proposal_prefix(ref.offset, ref.length, count)
            return [], cpb.ShmRef(offset=ref.offset, length=length)
        dists = state.segment.read_proposal(ref.offset, ref.length)[:count]
        return [cpb.SparseProbs(token_ids=ids, probs=probs) for ids, probs in dists], None

    def _limit(self, generated: int, length: int, plan: Plan) -> int:
        if generated >= plan.max_new_tokens:
            return pb.FINISH_REASON_LENGTH
        if length >= self._target.max_context:
            return pb.FINISH_REASON_CONTEXT
        return pb.FINISH_REASON_UNSPECIFIED

    async def _prefill(self, plan: Plan, call: _Caller, state: _Decode) -> None:
        """Prefills the verifier and starts the drafter's session in parallel; commits the first
        token, keeps the prompt's features for drafters that read them, and turns drafting off when
        an AUTO request's draft service is down."""
        name = state.segment.name if state.segment else ""
        prefill = call(self._verifier.Prefill, vpb.PrefillRequest(
            session_id=state.session_id, prompt_token_ids=plan.prompt_ids, return_features=plan.needs_features,
            sampling=plan.sampling, shm_segment=name), "verify")
        if state.drafting:
            start = call(self._drafter.StartSession, dpb.StartSessionRequest(
                session_id=state.session_id, drafter=plan.drafter, prompt_token_ids=plan.prompt_ids,
                target_tokenizer_fingerprint=self._target.tokenizer_fingerprint,
                target_model_fingerprint=self._target.model_fingerprint, sampling=plan.sampling,
                shm_segment=name), "draft")
            verified, started = await asyncio.gather(prefill, start, return_exceptions=True)
        else:
            verified, started = (await asyncio.gather(prefill, return_exceptions=True))[0], None
        if isinstance(verified, BaseException):
            raise verified
        if isinstance(started, UpstreamError) and plan.may_fall_back and started.code in _DRAFTER_DOWN:
            log.warning("draft service unavailable, continuing without speculation: %s", started)
            state.drafting, started = False, None
        elif isinstance(started, BaseException):
            raise started
        if state.segment is not None:
            state.shm_verify = self._proves(verified.shm_nonce, state.segment, "verify")
            state.shm_draft = started is not None and self._proves(started.shm_nonce, state.segment, "draft")
        state.committed = [verified.next_token_id]
        state.unsent = list(state.committed)
        state.length, state.generated = verified.length, 1
        if plan.needs_features and state.drafting:
            state.features = verified.features

    @staticmethod
    def _proves(nonce: bytes, segment: shm.Segment, service: str) -> bool:
        """A service shares our host if it read the segment's nonce; anything else but none is a fault."""
        if not nonce:
            return False
        if nonce != segment.nonce:
            raise UpstreamError(grpc.StatusCode.INTERNAL,
                                f"{service} service mapped a different segment named {segment.name}")
        return True

    def _stats(self, plan: Plan, tally: Tally, started: float, generated: int, state: _Decode) -> pb.GenerationStats:
        rounds, drafting = tally.rounds, state.drafting
        drafted = sum(r.drafted for r in rounds)
        accepted = sum(r.accepted for r in rounds)
        bonus = sum(1 for r in rounds if r.drafted and r.accepted == r.drafted)
        params, method = from_proto(plan.sampling)
        sampled = params.temperature > 0
        return pb.GenerationStats(
            prompt_tokens=len(plan.prompt_ids), generated_tokens=generated,
            prefill_ms=tally.prefill_ms, decode_ms=(time.perf_counter() - tally.decode_start) * 1e3,
            total_ms=(time.perf_counter() - started) * 1e3, rounds=len(rounds),
            drafted_tokens=drafted, accepted_tokens=accepted,
            mean_acceptance_length=(accepted + len(rounds)) / len(rounds) if rounds else 0.0,
            speculation_used=drafting, drafter=plan.drafter if drafting else "", gamma=plan.gamma if drafting else 0,
            draft_ms=sum(r.draft_ms for r in rounds), verify_ms=sum(r.verify_ms for r in rounds),
            network_ms=sum(r.network_ms for r in rounds), exact=self._target.exact, task_type=plan.task_type,
            round_records=rounds, bonus_tokens=bonus, recovered_tokens=sum(1 for r in rounds if r.drafted) - bonus,
            seed=params.seed if sampled else 0, verify_method=method if sampled else "greedy",
            speculation_reason=plan.decision.reason if drafting == plan.speculate else "drafter-down",
            shared_memory=state.shm_verify and state.shm_draft and drafting,
            predraft_attempts=state.predraft_attempts, predraft_hits=state.predraft_hits)

    async def _release(self, state: _Decode) -> None:
        """Frees the session on both services (the drafter hears the last committed tokens), then
        removes the shared memory."""
        calls = [self._verifier.Release(vpb.ReleaseRequest(session_id=state.session_id), timeout=5)]
        if state.drafting:
            calls.append(self._drafter.EndSession(dpb.EndSessionRequest(
                session_id=state.session_id, base_length=state.base, new_token_ids=state.unsent), timeout=5))
        for outcome in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(outcome, BaseException):
                log.warning("releasing session %s failed: %s", state.session_id, outcome)
        if state.segment is not None:
            self._segments.remove(state.segment)


class _Predraft:
    """A Propose in flight that assumed the block under verification is accepted."""

    def __init__(self, task: asyncio.Future, state: _Decode, sent: cpb.Features | None):
        self._task, self._state, self._sent = task, state, sent

    async def settle(self, hit: bool) -> dpb.ProposeResponse | None:
        """The pre-draft if its assumption held and it succeeded; otherwise None, after cancelling
        it. Features it carried go back to the pending ones unless the drafter surely got them."""
        if not hit:
            self._task.cancel()
        outcome = (await asyncio.gather(self._task, return_exceptions=True))[0]
        if isinstance(outcome, BaseException):
            if hit and not isinstance(outcome, (UpstreamError, asyncio.CancelledError)):
                raise outcome
            self._state.features = _join(self._sent, self._state.features, self._state.segment)
            return None
        return outcome if hit else None


def _digest(ids: list[int]) -> str:
    """Pairs a spec-on request with spec-off runs of the same prompt in trace-report, without the text."""
    return hashlib.sha256(array("I", ids).tobytes()).hexdigest()[:16]


def _describe_round(span, record: pb.RoundRecord) -> None:
    if span.is_recording():
        span.set_attributes({
            "specsplit.drafted": record.drafted, "specsplit.accepted": record.accepted,
            "specsplit.next_token": "none" if not record.drafted else
            ("bonus" if record.accepted == record.drafted else "recovered"),
            "specsplit.draft_source": record.draft_source, "specsplit.draft_ms": record.draft_ms,
            "specsplit.verify_ms": record.verify_ms, "specsplit.network_ms": record.network_ms,
            "specsplit.feature_bytes": record.feature_bytes, "specsplit.proposal_bytes": record.proposal_bytes,
            "specsplit.predrafted": record.predrafted})


def _describe(span, stats: pb.GenerationStats, common: dict) -> None:
    """The Generate span's summary of the request (what trace-report groups and compares by)."""
    if span.is_recording():
        span.set_attributes({
            **common, "specsplit.speculation": "on" if stats.speculation_used else "off",
            "specsplit.drafter": stats.drafter, "specsplit.gamma": stats.gamma,
            "specsplit.generated_tokens": stats.generated_tokens, "specsplit.prompt_tokens": stats.prompt_tokens,
            "specsplit.rounds": stats.rounds, "specsplit.drafted": stats.drafted_tokens,
            "specsplit.accepted": stats.accepted_tokens, "specsplit.verify_method": stats.verify_method,
            "specsplit.mean_acceptance_length": stats.mean_acceptance_length,
            "specsplit.speculation_reason": stats.speculation_reason,
            "specsplit.predraft_attempts": stats.predraft_attempts, "specsplit.predraft_hits": stats.predraft_hits,
            "specsplit.shared_memory": stats.shared_memory})


class _Caller:
    """Calls an upstream RPC with a deadline bounded by the client's, mapping failures to
    UpstreamError with the service named in the message."""

    def __init__(self, time_remaining, rpc_timeout_s: float):
        self._time_remaining = time_remaining
        self._rpc_timeout_s = rpc_timeout_s

    async def __call__(self, method, request, service: str):
        remaining = self._time_remaining()
        timeout = self._rpc_timeout_s if remaining is None else max(0.001, min(remaining, self._rpc_timeout_s))
        try:
            return await method(request, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code == grpc.StatusCode.NOT_FOUND:
                # The backend lost our session (restarted, or evicted it as idle): the request,
                # not the client's input, failed, and a retry starts a new session.
                code = grpc.StatusCode.ABORTED
            raise UpstreamError(code, f"{service} service: {e.details()}") from None

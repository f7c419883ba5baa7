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


@dataclass
class _Decode:
    """Where a request's decoding stands between rounds."""

    session_id: str
    drafting: bool
    base: int  # position of new_tokens[0]
    length: int  # committed tokens on the verifier
    new_tokens: list[int]  # committed since the drafter last heard
    features: cpb.Features | None  # target features not yet delivered to the drafter
    generated: int


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


def _join(pending: cpb.Features | None, new: cpb.Features) -> cpb.Features:
    """Features not delivered yet (no Propose ran since) followed by the new rows."""
    if pending is None or not pending.rows:
        return new
    return cpb.Features(start=pending.start, rows=pending.rows + new.rows, dim=new.dim, dtype=new.dtype,
                        data=pending.data + new.data)


def _ms(ns: int | float) -> float:
    return ns / 1e6


class Orchestrator:
    def __init__(self, verifier: vpb_grpc.VerifierStub, drafter: dpb_grpc.DrafterStub, tokenizer,
                 target: vpb.InfoResponse, rpc_timeout_s: float, metrics: GatewayMetrics | None = None,
                 transport: dict[str, str] | None = None, controller: Controller | None = None):
        self._verifier = verifier
        self._drafter = drafter
        self._tokenizer = tokenizer
        self._target = target
        self._rpc_timeout_s = rpc_timeout_s
        self._controller = controller or Controller()
        self._metrics = metrics or GatewayMetrics(self._controller)
        # Trace attributes: how each backend is reached ("unix" or "tcp").
        self._transport = {f"specsplit.transport.{k}": v for k, v in (transport or {}).items()}

    async def generate(self, plan: Plan, time_remaining=lambda: None) -> AsyncIterator[pb.GenerateChunk]:
        """Yields one chunk per verify round; the last carries the finish reason and stats."""
        session_id = uuid.uuid4().hex
        started = time.perf_counter()
        tally = Tally()
        call = _Caller(time_remaining, self._rpc_timeout_s)
        request_span = trace.get_current_span()  # the Generate server span when tracing
        common = {"specsplit.task_type": plan.task_type or "unspecified", **self._transport}
        try:
            prefill_attrs = {**common, "specsplit.prompt_tokens": len(plan.prompt_ids)}
            with tracer().start_as_current_span("prefill", attributes=prefill_attrs):
                first, features, drafting = await self._prefill(session_id, plan, call, plan.speculate)
            tally.prefill_ms = (time.perf_counter() - started) * 1e3
            tally.decode_start = time.perf_counter()
            text = TextAssembler(self._tokenizer, plan.eos_ids, plan.stop_strings)
            state = _Decode(session_id, drafting, base=len(plan.prompt_ids), length=len(plan.prompt_ids) + 1,
                            new_tokens=[first], features=features, generated=1)
            delta = text.add(state.new_tokens, self._limit(state.generated, state.length, plan))
            while True:
                if delta.finish:
                    stats = self._stats(plan, tally, started, len(text.token_ids), drafting)
                    self._metrics.request(stats)
                    self._controller.observe(plan.task_type, plan.drafter, plan.decision, stats)
                    _describe(request_span, stats, {**common, "specsplit.prompt_digest": _digest(plan.prompt_ids)})
                    yield pb.GenerateChunk(text=delta.text, token_ids=delta.token_ids, finish_reason=delta.finish,
                                           stats=stats)
                    return
                yield pb.GenerateChunk(text=delta.text, token_ids=delta.token_ids)
                # Never draft past max_new_tokens or the context: accepted + 1 must fit.
                gamma = min(plan.gamma, plan.max_new_tokens - state.generated - 1,
                            self._target.max_context - state.length - 1)
                position = state.generated
                attrs = {**common, "specsplit.round": len(tally.rounds), "specsplit.position": position,
                         "specsplit.gamma": gamma if drafting else 0}
                with tracer().start_as_current_span("round", attributes=attrs) as span:
                    record = await self._round(plan, call, state, gamma)
                    _describe_round(span, record)
                tally.rounds.append(record)
                self._metrics.round(record, plan.task_type, plan.drafter if drafting else "", position)
                delta = text.add(state.new_tokens, self._limit(state.generated, state.length, plan))
        finally:
            await asyncio.shield(self._release(session_id, plan.speculate))

    async def _round(self, plan: Plan, call: _Caller, state: _Decode, gamma: int) -> pb.RoundRecord:
        """One draft -> verify round; advances `state` by the committed tokens."""
        round_start = time.perf_counter()
        drafts, draft_probs, draft_ns, draft_rpc_ns, source = [], [], 0, 0, ""
        feature_bytes = len(state.features.data) if state.features is not None else 0
        if state.drafting and gamma >= 1:
            t = time.perf_counter_ns()
            proposal = await call(self._drafter.Propose, dpb.ProposeRequest(
                session_id=state.session_id, base_length=state.base, new_token_ids=state.new_tokens, gamma=gamma,
                features=state.features), "draft")
            draft_rpc_ns = time.perf_counter_ns() - t
            drafts, draft_ns, source = list(proposal.draft_token_ids), proposal.draft_ns, proposal.source
            draft_probs = proposal.draft_probs  # rejection sessions: what each draft was sampled from
            state.features = None  # delivered
        t = time.perf_counter_ns()
        verdict = await call(self._verifier.Verify, vpb.VerifyRequest(
            session_id=state.session_id, length=state.length, draft_token_ids=drafts, draft_probs=draft_probs),
            "verify")
        verify_rpc_ns = time.perf_counter_ns() - t
        if plan.needs_features and state.drafting:
            state.features = _join(state.features, verdict.features)
        state.new_tokens = [*drafts[:verdict.num_accepted], verdict.next_token_id]
        state.base, state.length = state.length, verdict.length
        state.generated += len(state.new_tokens)
        return pb.RoundRecord(
            drafted=len(drafts), accepted=verdict.num_accepted, draft_ms=_ms(draft_ns),
            verify_ms=_ms(verdict.forward_ns),
            network_ms=_ms(draft_rpc_ns - draft_ns + verify_rpc_ns - verdict.forward_ns),
            round_ms=(time.perf_counter() - round_start) * 1e3, draft_source=source,
            feature_bytes=feature_bytes, proposal_bytes=sum(d.ByteSize() for d in draft_probs))

    def _limit(self, generated: int, length: int, plan: Plan) -> int:
        if generated >= plan.max_new_tokens:
            return pb.FINISH_REASON_LENGTH
        if length >= self._target.max_context:
            return pb.FINISH_REASON_CONTEXT
        return pb.FINISH_REASON_UNSPECIFIED

    async def _prefill(self, session_id: str, plan: Plan, call: _Caller,
                       drafting: bool) -> tuple[int, cpb.Features | None, bool]:
        """Prefills the verifier and the drafter in parallel; returns the first token, the prompt's
        features (for drafters that read them) and whether drafting goes on."""
        prefill = call(self._verifier.Prefill, vpb.PrefillRequest(
            session_id=session_id, prompt_token_ids=plan.prompt_ids, return_features=plan.needs_features,
            sampling=plan.sampling), "verify")
        if not drafting:
            return (await prefill).next_token_id, None, False
        start = call(self._drafter.StartSession, dpb.StartSessionRequest(
            session_id=session_id, drafter=plan.drafter, prompt_token_ids=plan.prompt_ids,
            target_tokenizer_fingerprint=self._target.tokenizer_fingerprint,
            target_model_fingerprint=self._target.model_fingerprint, sampling=plan.sampling), "draft")
        verified, started = await asyncio.gather(prefill, start, return_exceptions=True)
        if isinstance(verified, BaseException):
            raise verified
        if isinstance(started, UpstreamError) and plan.may_fall_back and started.code in _DRAFTER_DOWN:
            log.warning("draft service unavailable, continuing without speculation: %s", started)
            return verified.next_token_id, None, False
        if isinstance(started, BaseException):
            raise started
        return verified.next_token_id, verified.features if plan.needs_features else None, True

    def _stats(self, plan: Plan, tally: Tally, started: float, generated: int, drafting: bool) -> pb.GenerationStats:
        rounds = tally.rounds
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
            speculation_reason=plan.decision.reason if drafting == plan.speculate else "drafter-down")

    async def _release(self, session_id: str, drafted: bool) -> None:
        calls = [self._verifier.Release(vpb.ReleaseRequest(session_id=session_id), timeout=5)]
        if drafted:
            calls.append(self._drafter.EndSession(dpb.EndSessionRequest(session_id=session_id), timeout=5))
        for outcome in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(outcome, BaseException):
                log.warning("releasing session %s failed: %s", session_id, outcome)


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
            "specsplit.feature_bytes": record.feature_bytes, "specsplit.proposal_bytes": record.proposal_bytes})


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
            "specsplit.speculation_reason": stats.speculation_reason})


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

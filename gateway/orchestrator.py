"""The round loop: prefill, then draft -> verify until a stop condition, releasing on every exit."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from gateway.textstream import TextAssembler
from specsplit.common.v1 import common_pb2 as cpb
from specsplit.draft.v1 import draft_pb2 as dpb
from specsplit.draft.v1 import draft_pb2_grpc as dpb_grpc
from specsplit.gateway.v1 import gateway_pb2 as pb
from specsplit.sampling import from_proto
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
                 target: vpb.InfoResponse, rpc_timeout_s: float):
        self._verifier = verifier
        self._drafter = drafter
        self._tokenizer = tokenizer
        self._target = target
        self._rpc_timeout_s = rpc_timeout_s

    async def generate(self, plan: Plan, time_remaining=lambda: None) -> AsyncIterator[pb.GenerateChunk]:
        """Yields one chunk per verify round; the last carries the finish reason and stats."""
        session_id = uuid.uuid4().hex
        started = time.perf_counter()
        tally = Tally()
        drafting = plan.speculate
        call = _Caller(time_remaining, self._rpc_timeout_s)
        try:
            first, features, drafting = await self._prefill(session_id, plan, call, drafting)
            tally.prefill_ms = (time.perf_counter() - started) * 1e3
            tally.decode_start = time.perf_counter()
            text = TextAssembler(self._tokenizer, plan.eos_ids, plan.stop_strings)
            length = len(plan.prompt_ids) + 1
            generated = 1
            new_tokens, base = [first], len(plan.prompt_ids)
            delta = text.add(new_tokens, self._limit(generated, length, plan))
            while True:
                if delta.finish:
                    yield pb.GenerateChunk(text=delta.text, token_ids=delta.token_ids, finish_reason=delta.finish,
                                           stats=self._stats(plan, tally, started, len(text.token_ids), drafting))
                    return
                yield pb.GenerateChunk(text=delta.text, token_ids=delta.token_ids)
                # Never draft past max_new_tokens or the context: accepted + 1 must fit.
                gamma = min(plan.gamma, plan.max_new_tokens - generated - 1, self._target.max_context - length - 1)
                round_start = time.perf_counter()
                drafts, draft_probs, draft_ns, draft_rpc_ns, source = [], [], 0, 0, ""
                feature_bytes = len(features.data) if features is not None else 0
                if drafting and gamma >= 1:
                    t = time.perf_counter_ns()
                    proposal = await call(self._drafter.Propose, dpb.ProposeRequest(
                        session_id=session_id, base_length=base, new_token_ids=new_tokens, gamma=gamma,
                        features=features), "draft")
                    draft_rpc_ns = time.perf_counter_ns() - t
                    drafts, draft_ns, source = list(proposal.draft_token_ids), proposal.draft_ns, proposal.source
                    draft_probs = proposal.draft_probs  # rejection sessions: what each draft was sampled from
                    features = None  # delivered
                t = time.perf_counter_ns()
                verdict = await call(self._verifier.Verify, vpb.VerifyRequest(
                    session_id=session_id, length=length, draft_token_ids=drafts,
                    draft_probs=draft_probs), "verify")
                verify_rpc_ns = time.perf_counter_ns() - t
                if plan.needs_features and drafting:
                    features = _join(features, verdict.features)
                new_tokens = [*drafts[:verdict.num_accepted], verdict.next_token_id]
                base, length = length, verdict.length
                generated += len(new_tokens)
                tally.rounds.append(pb.RoundRecord(
                    drafted=len(drafts), accepted=verdict.num_accepted, draft_ms=_ms(draft_ns),
                    verify_ms=_ms(verdict.forward_ns),
                    network_ms=_ms(draft_rpc_ns - draft_ns + verify_rpc_ns - verdict.forward_ns),
                    round_ms=(time.perf_counter() - round_start) * 1e3, draft_source=source,
                    feature_bytes=feature_bytes, proposal_bytes=sum(d.ByteSize() for d in draft_probs)))
                delta = text.add(new_tokens, self._limit(generated, length, plan))
        finally:
            await asyncio.shield(self._release(session_id, plan.speculate))

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
            seed=params.seed if sampled else 0, verify_method=method if sampled else "greedy")

    async def _release(self, session_id: str, drafted: bool) -> None:
        calls = [self._verifier.Release(vpb.ReleaseRequest(session_id=session_id), timeout=5)]
        if drafted:
            calls.append(self._drafter.EndSession(dpb.EndSessionRequest(session_id=session_id), timeout=5))
        for outcome in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(outcome, BaseException):
                log.warning("releasing session %s failed: %s", session_id, outcome)


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

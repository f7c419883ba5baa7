"""gRPC front of the verify service: converts messages and maps errors to status codes."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from specsplit.api.common.v1 import common_pb2 as cpb
from specsplit.api.verify.v1 import verify_pb2 as pb
from specsplit.api.verify.v1 import verify_pb2_grpc as pb_grpc
from specsplit.errors import Failure
from specsplit.model.fastllama import CacheFull
from specsplit.model.modeling import LoadedModel
from specsplit.serving import shm, wire
from specsplit.serving.grammar import Language
from specsplit.serving.server import Rounds
from specsplit.serving.sessions import Draining, SessionEnded, SessionExists, SessionTable, TableFull
from specsplit.serving.settings import MAX_DRAFT
from specsplit.serving.telemetry import meter, record_compute
from specsplit.serving.worker import Again, ModelWorker
from specsplit.speculation.lookup import OutputIndex
from specsplit.speculation.params import Logprobs, SamplingParams
from verify_service.decoding import Decoding, decodes
from verify_service.engine import Target
from verify_service.headdraft import VerifierHead
from verify_service.statuses import failure
from verify_service.steps import ContextFull, Prefilling, TargetSession
from verify_service.widths import Widths, first_id, measure_rows

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Verifier"].full_name
# A prompt is fed in chunks: PREFILL_CHUNK tokens while no other session is live (so a Release can
# stop it between chunks); beside other sessions, chunks sized so that a forward takes about
# PREFILL_SLICE times a 1-row step, so their decoding stalls for about a step, not the prefill's time
# (down to one row: late in a long prompt, each row's attention costs about half a step).
PREFILL_CHUNK, PREFILL_SLICE = 512, 1.75


class VerifierServicer(pb_grpc.VerifierServicer):
    forward_ms_by_rows: list[float] = []  # set by warmup
    _warming: asyncio.Future | None = None

    def __init__(self, lm: LoadedModel, sessions: SessionTable[TargetSession], worker: ModelWorker,
                 shared_memory: bool = True, target: Target | None = None, outputs: OutputIndex | None = None,
                 head: VerifierHead | None = None):
        self._lm = lm
        self._head = head  # the target's feature head, drafting for greedy decode-aheads here
        self._outputs = outputs  # earlier sessions' outputs, for decode-ahead lookups (added at Release)
        self._shared_memory = shared_memory  # map the gateway's segments when offered
        self._target = target or Target(lm)
        self._sessions = sessions
        self._worker = worker
        # Prefills that joined the worker's batch and are not finished (both counted on the worker
        # thread): one in progress joins every batch, and a batch waits for it from its arrival.
        self.prefilling = 0
        # Verify calls decoding ahead (VerifyRequest.decode_ahead), by session, between their steps.
        self._ahead: dict[str, Decoding] = {}
        self._widths = Widths()  # a wider forward's cost now, for the decode-ahead's lookup depth
        sessions.when_evicted(lambda session_id, session: worker.submit(self._end, session_id, session))
        self.rounds = Rounds(worker, self.run_calls, pb.VerifyRequest, lambda response: response.forward_ns,
                             rows=lambda request: 1 + len(request.draft_token_ids))
        self._forward = meter().create_histogram(
            "specsplit.verify.forward", unit="s", description="the target's forward (and acceptance) per call, "
            "by call (prefill, verify) and rows (a verify: 1 + draft tokens)",
            explicit_bucket_boundaries_advisory=[0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5])
        self._prefix_tokens = meter().create_counter(
            "specsplit.verify.prefix_cache.tokens", unit="{token}", description="prompt tokens of prefills by "
            "outcome: hit (keys and values loaded from the prefix cache) or miss (computed)")

    async def Info(self, request, context):
        if self._warming is not None:  # the costs by width are known once warmup has measured them
            await asyncio.shield(self._warming)
        lm = self._lm
        return pb.InfoResponse(
            model_id=lm.model_id, vocab_size=lm.vocab_size, tokenizer_fingerprint=lm.fingerprint,
            max_context=lm.max_context, dtype=str(lm.dtype).removeprefix("torch."), device=str(lm.device),
            exact=lm.exact, eos_token_ids=lm.eos_token_ids, active_sessions=len(self._sessions),
            max_sessions=self._sessions.max_sessions, param_bytes=lm.param_bytes,
            model_fingerprint=lm.model_fingerprint, hidden_size=lm.hidden_size,
            tree_verify=self._target.verifies_trees, forward_ms_by_rows=self.forward_ms_by_rows,
            active_prefills=self.prefilling, head_model_id=self._head.model_id if self._head else "")

    async def Prefill(self, request, context):
        if not request.session_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "session_id is empty")
        prompt = list(request.prompt_token_ids)
        if not prompt:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids is empty")
        if max(prompt) >= self._lm.vocab_size:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"prompt token id {max(prompt)} is out of range for vocab size {self._lm.vocab_size}")
        if len(prompt) + 1 > self._lm.max_context:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, f"prompt of {len(prompt)} tokens leaves no room "
                                                              f"in the context of {self._lm.max_context}")
        if request.session_id in self._sessions:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"session {request.session_id} already exists")
        if self._sessions.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "verify service: draining before it stops: start the "
                                                             "session on another replica")
        if request.resume and (len(prompt) < 2 or request.logprobs.prompt):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a resumed session holds its prompt and at least one "
                                                                  "committed token, and asks no prompt logprobs")
        try:
            sampling = wire.sampling(request.sampling)
            logprobs = wire.logprobs(request.logprobs)
            logprobs.check()
            language = await asyncio.to_thread(Language, request.constraint, self._lm.tokenizer, self._lm.vocab_size) \
                if request.HasField("constraint") else None
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        call = _Prefill(request.session_id, prompt, request.return_features, sampling, trace.get_current_span(),
                        request.skip_prefix_cache, logprobs, request.resume, language, request.output_tokens)
        try:
            session, result = await self._worker.run_gathered(self.run_calls, call, min(len(prompt), PREFILL_CHUNK),
                                                              self._company_wait(), self._prefill_joined)
        except SessionEnded:
            await context.abort(grpc.StatusCode.ABORTED, f"session {request.session_id} was released before its "
                                                         "prefill ran (its caller gave up on it)")
        except SessionExists:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"session {request.session_id} already exists")
        except (TableFull, CacheFull) as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except Draining as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"verify service: {e}")
        except ContextFull as e:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, str(e))
        self._prefix_tokens.add(result.cached, {"outcome": "hit"})
        self._prefix_tokens.add(len(prompt) - result.cached, {"outcome": "miss"})
        # Mapped once the session is held, so the Release (or eviction) that drops it unmaps it.
        session.segment = segment = shm.try_attach(request.shm_segment, self._shared_memory)
        session.stop_tokens = frozenset(request.stop_token_ids)
        record_compute(result.forward_ns)
        self._forward.record(result.forward_ns / 1e9, {"call": "prefill", "rows": len(prompt)})
        return pb.PrefillResponse(next_token_id=result.next_token, length=result.length,
                                  forward_ns=result.forward_ns, features=_features(result, 0, session),
                                  shm_nonce=segment.nonce if segment else b"",
                                  fast_path=self.rounds.fast_path if segment else "",
                                  batch_rows=result.batch_rows, batch_calls=result.batch_calls,
                                  cached_tokens=result.cached, chunks=call.chunks,
                                  logprobs=wire.token_logprobs(result.logprobs),
                                  prompt_logprobs=wire.token_logprobs(result.prompt_logprobs))

    def _prefill_joined(self) -> None:
        self.prefilling += 1

    def expected(self) -> int:
        """Calls a batch can expect: a round from every live session and a chunk from every prefill."""
        return len(self._sessions) + self.prefilling

    async def Verify(self, request, context):
        return await self.rounds.unary(request, context)

    async def VerifyStream(self, requests, context):
        async for response in self.rounds.stream(requests, context):
            yield response

    def run_calls(self, calls: list) -> list:
        """A batch of prefills and rounds (on the worker thread) in one forward: per call its answer,
        or the Failure (or exception) for its caller. A call that cannot be planned fails alone."""
        steps, planned, seen = [], [], set()
        outcomes: list = [None] * len(calls)
        for i, call in enumerate(calls):
            try:
                if call.session_id in seen:  # it would write the same cache slots in the same forward
                    raise Failure(grpc.StatusCode.FAILED_PRECONDITION, f"session {call.session_id} already has a "
                                  "call in this forward; send a session's rounds one at a time")
                seen.add(call.session_id)
                steps.append(self._plan_prefill(call, calls) if isinstance(call, _Prefill) else self._plan_verify(call))
                planned.append(i)
            except BaseException as e:  # noqa: BLE001 -- this call's outcome
                outcomes[i] = failure(e) if isinstance(call, pb.VerifyRequest) else e
                self._ahead.pop(call.session_id, None)
        for i, step, result in zip(planned, steps, self._target.run(steps)):
            call = calls[i]
            try:
                if isinstance(result, BaseException):
                    raise result
                if isinstance(call, _Prefill):
                    outcomes[i] = self._prefilled(call, step, result)
                else:
                    outcomes[i] = self._verified(call, result)
            except BaseException as e:  # noqa: BLE001 -- this call's outcome
                outcomes[i] = failure(e) if isinstance(call, pb.VerifyRequest) else e
                self._ahead.pop(call.session_id, None)
        for i, call in enumerate(calls):
            if isinstance(call, _Prefill) and not isinstance(outcomes[i], Again):
                call.state = None  # finished or failed: its cache now lives in the session, or is freed
                self.prefilling -= 1
        return outcomes

    def _plan_prefill(self, call: _Prefill, calls: list):
        """The prefill's next chunk, sized for the batch it runs in; its first also loads what the
        prefix cache holds of the prompt. SessionEnded once its caller released it (gave up)."""
        if call.state is None:
            # The head drafts greedy sessions (a round is one native call there); a resumed one goes on without.
            head = self._head.start(call.prompt) if self._head and call.sampling.temperature == 0 \
                and not call.resume else None
            call.state = self._target.start_prefill(call.prompt, call.with_features, call.sampling,
                                                    use_cache=not call.skip_cache, logprobs=call.logprobs,
                                                    resume=call.resume, language=call.language,
                                                    output_tokens=call.output_tokens, head=head)
        elif self._sessions.ended(call.session_id):
            raise SessionEnded(call.session_id)
        return self._target.plan_prefill(call.state, self._chunk(call, len(calls) > 1))

    def _company_wait(self) -> float | None:
        """How long a prefill's chunk waits for live sessions' rounds (coming back from their
        gateways) to share its forward: a step, rather than run alone and hold up whichever
        arrives meanwhile for the whole chunk. None (the worker's wait) when no session is live."""
        return self._curve()[0] / 1e3 if len(self._sessions) else None

    def _curve(self) -> list[float]:
        """forward_ms_by_rows, or a guess of 10 ms a step before the warm-up measured it."""
        return self.forward_ms_by_rows or [10.0]

    def _chunk(self, call: _Prefill, shared: bool) -> int | None:
        """Tokens in the prefill's next chunk: all of them where the kernels do not batch; PREFILL_CHUNK
        alone; beside other sessions, as many as fit a forward of PREFILL_SLICE 1-row steps (from
        the previous chunk's forward, or the cost curve for the first)."""
        if not self._target.batches:
            return None
        if not (shared or len(self._sessions) or self.prefilling > 1):
            return PREFILL_CHUNK
        curve = self._curve()
        budget_ms = PREFILL_SLICE * curve[0]
        if call.last is None:
            rows = max([w for w, ms in enumerate(curve, 1) if ms <= budget_ms], default=1)
        else:
            rows, ms = call.last
            rows = int(rows * budget_ms / max(ms, 1e-3))
        return max(1, min(PREFILL_CHUNK, rows))

    def _prefilled(self, call: _Prefill, step, result):
        """A chunk done: Again (the next chunk's rows) until the prompt is in; then the session."""
        state = call.state
        call.chunks += 1
        call.forward_ns += result.forward_ns
        call.last = (len(step.ids), result.forward_ns / 1e6)
        if call.span.is_recording():
            call.span.add_event("prefill-chunk", {"specsplit.prefill.done": state.done,
                                                  "specsplit.prefill.tokens": len(call.prompt),
                                                  "specsplit.rows": len(step.ids), "rpc.batch_rows": result.batch_rows})
        if not state.finished:  # the next chunk's rows, about (the worker packs batches by them)
            return Again(min(len(call.prompt) - state.done, len(step.ids)), self._company_wait())
        self._sessions.put(call.session_id, state.session)
        if state.session.head is not None:
            self._head.prefilled(state.session.head, state.session.tokens, result.features)
        return state.session, dataclasses.replace(result, forward_ns=call.forward_ns)

    def _plan_verify(self, request: pb.VerifyRequest):
        """Raises Failure with the status for the caller."""
        if decodes(request):
            return self._plan_decode(request)
        if len(request.draft_token_ids) > MAX_DRAFT:
            raise Failure(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{len(request.draft_token_ids)} draft tokens; at most {MAX_DRAFT}")
        try:
            session = self._sessions.get(request.session_id)
            dists = request.draft_probs
            if request.HasField("draft_probs_shm"):
                if session.segment is None:
                    raise ValueError("draft_probs_shm given but this session has no shared-memory segment")
                ref = request.draft_probs_shm
                dists = [cpb.SparseProbs(token_ids=ids, probs=probs)
                         for ids, probs in session.segment.read_proposal(ref.offset, ref.length)]
            proposals = [wire.sparse(d) for d in dists]
            return self._target.plan_verify(session, request.length, list(request.draft_token_ids), proposals,
                                            list(request.draft_parents) or None,
                                            fill=max(request.forced_room, len(request.draft_token_ids)))
        except Exception as e:  # noqa: BLE001 -- mapped to its status
            raise failure(e) from None

    def _plan_decode(self, request: pb.VerifyRequest):
        """A decode-ahead's next step: the next token after what it committed (its first: at the
        length the caller believes), with a prompt-lookup draft where the context offers one."""
        try:
            session = self._sessions.get(request.session_id)
            decoding = self._ahead.setdefault(request.session_id, Decoding())
            length = len(session.tokens) if decoding.results else request.length
            room = max(0, request.decode_ahead - decoding.committed)
            curve = self._widths.curve(session.step_ms, self._curve(), session.sampling)
            draft, parents = decoding.draft(request, session, curve, self._outputs, self._head)
            return self._target.plan_verify(session, length, draft, parents=parents,
                                            fill=min(request.forced_room, room), copied=True)
        except Exception as e:  # noqa: BLE001 -- mapped to its status
            raise failure(e) from None

    def _verified(self, request: pb.VerifyRequest, result) -> pb.VerifyResponse | Again:
        """The answer; Again while a decode-ahead has tokens to go (its forwards are kept until then)."""
        session = self._sessions.get(request.session_id)
        self._forward.record(result.forward_ns / 1e9, {"call": "verify", "rows": 1 + len(request.draft_token_ids)})
        self._follow(session, result)
        if decodes(request):
            decoding = self._ahead[request.session_id]
            decoding.add(result, session)
            if result.batch_calls == 1:
                self._widths.add(session.step_ms, result.batch_rows, result.forward_ns / 1e6)
            if not decoding.finished(request, session, self._lm.max_context):
                return Again(1)
            del self._ahead[request.session_id]
            committed = session.tokens[request.length:]  # its first token answers as next_token_id
            forced, forced_accepted = decoding.forced
            return pb.VerifyResponse(
                num_accepted=0, next_token_id=committed[0], decoded_token_ids=committed[1:],
                length=result.length, forward_ns=sum(r.forward_ns for r in decoding.results),
                features=_features(decoding.merged(), request.length - 1, session),
                batch_rows=result.batch_rows, batch_calls=result.batch_calls,
                logprobs=wire.token_logprobs([lp for r in decoding.results for lp in r.logprobs]),
                lookup_drafted=decoding.drafted,
                lookup_accepted=decoding.accepted - forced_accepted - decoding.head_accepted,
                lookup_steps=decoding.lookup_steps, head_drafted=decoding.head_drafted,
                head_accepted=decoding.head_accepted, head_steps=decoding.head_steps, head_ns=decoding.head_ns,
                forced=forced, forced_accepted=forced_accepted, constraint_complete=result.complete)
        return pb.VerifyResponse(num_accepted=result.num_accepted, next_token_id=result.next_token,
                                 length=result.length, forward_ns=result.forward_ns,
                                 features=_features(result, request.length - 1, session),
                                 accepted_indices=result.path, batch_rows=result.batch_rows,
                                 batch_calls=result.batch_calls, logprobs=wire.token_logprobs(result.logprobs),
                                 forced=result.forced, forced_accepted=result.forced_accepted,
                                 constraint_complete=result.complete,
                                 verified_draft_ids=result.draft)

    def _follow(self, session: TargetSession, result) -> None:
        """The session's head (drafting here) takes the step's committed tokens and their features."""
        if session.head is not None:
            length = result.length - result.num_accepted - 1
            self._head.follow(session.head, length, session.tokens, result.features,
                              result.num_accepted - result.forced_accepted)

    async def Release(self, request, context):
        return await self._worker.run(self._release, request.session_id)

    def _release(self, session_id: str) -> pb.ReleaseResponse:
        """On the worker thread, so it runs after any round of the session still queued there."""
        session = self._sessions.pop(session_id)
        if session is None:
            return pb.ReleaseResponse(released=False)
        if self._outputs is not None:
            self._outputs.add(session.tokens[session.output_start:])
        self._end(session_id, session)
        return pb.ReleaseResponse(released=True)

    def _end(self, session_id: str, session: TargetSession) -> None:
        """A session out of the table (released, or evicted idle), on the worker thread: its KV
        budget back now, whatever still refers to it, its segment unmapped, its decode-ahead gone."""
        session.kv.free()
        if session.segment is not None:
            session.segment.close()
        self._ahead.pop(session_id, None)

    async def warmup(self) -> None:
        """A prefill and verifies of every width up to WARMUP_ROWS, so the first request does not pay
        for lazy init, and Info can say what each width costs; then the head's price (VerifierHead.measure)."""
        self._warming = asyncio.ensure_future(self._worker.run(measure_rows, self._target, first_id(self._lm)))
        self.forward_ms_by_rows = await self._warming
        if self._head is not None:
            await self._worker.run(self._head.measure, self._target, first_id(self._lm))

def _features(result, start: int, session: TargetSession):
    """The features the caller asked for (a head drafting here reads them too, and sends none)."""
    if result.features is None or not session.with_features:
        return None
    return shm.stash_features(session.segment, wire.encode(result.features, start))


@dataclass(eq=False)
class _Prefill:
    """A Prefill as the worker batches it (validated by the servicer), and its progress."""

    session_id: str
    prompt: list[int]
    with_features: bool
    sampling: SamplingParams
    span: object  # the Prefill's server span: an event per chunk shows the progress
    skip_cache: bool = False  # compute it all (PrefillRequest.skip_prefix_cache)
    logprobs: Logprobs = Logprobs()  # PrefillRequest.logprobs
    resume: bool = False  # PrefillRequest.resume
    language: Language | None = None  # PrefillRequest.constraint, compiled
    output_tokens: int = 0  # PrefillRequest.output_tokens
    state: Prefilling | None = None  # begun: the session and how far its prompt is in
    chunks: int = 0
    forward_ns: int = 0  # over its chunks
    last: tuple[int, float] | None = None  # the previous chunk's (rows, forward ms)


def register(server: grpc.aio.Server, servicer: VerifierServicer) -> None:
    pb_grpc.add_VerifierServicer_to_server(servicer, server)

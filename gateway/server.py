"""gRPC front of the gateway: validates requests into a Plan and streams the round loop's chunks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable

import grpc

from gateway.access import ClientCap, client_of
from gateway.backends import Backends
from gateway.controller import AUTO, OFF, ON, Decision
from gateway.instruments import GatewayMetrics, Instruments
from gateway.load import InFlight
from gateway.plan import Plan
from gateway.replicas import Replica
from gateway.rounds import RoundLoop
from specsplit.api.common.v1 import common_pb2 as cpb
from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc
from specsplit.errors import Failure
from specsplit.model.chat import chat_prompt_ids
from specsplit.serving import wire
from specsplit.serving.server import unix_path
from specsplit.serving.settings import MAX_DRAFT, MAX_GAMMA
from specsplit.speculation.params import SamplingParams

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Gateway"].full_name
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256
ROLES = {"system", "user", "assistant"}

log = logging.getLogger("specsplit.gateway")


MODES = {pb.SPECULATION_AUTO: AUTO, pb.SPECULATION_ON: ON, pb.SPECULATION_OFF: OFF}


LONG_PROMPT_CHARS = 8192


def _long(request: pb.GenerateRequest) -> bool:
    """A prompt worth tokenizing on a thread."""
    if request.WhichOneof("prompt") == "text":
        return len(request.text) > LONG_PROMPT_CHARS
    return sum(len(m.content) for m in request.chat.messages) > LONG_PROMPT_CHARS

class GatewayServicer(pb_grpc.GatewayServicer):
    def __init__(self, backends: Backends):
        self._backends = backends
        self.controller = backends.controller
        self._inflight = InFlight()  # Generate calls running now and recently (the controller's load signal)
        self._cap = ClientCap(backends.settings.max_sessions_per_client)
        self._metrics = GatewayMetrics(self.controller, (backends.verify, backends.draft))
        self._transport = {name: "unix" if unix_path(address) else "tcp" for name, address in
                           (("draft", backends.settings.draft_address), ("verify", backends.settings.verify_address))}

    def _loop(self, verify: Replica, draft: Replica | None) -> RoundLoop:
        b = self._backends
        instruments = Instruments(self.controller, self._metrics, b.target.exact, self._transport)
        return RoundLoop(b.upstream, verify, draft, b.tokenizer, b.target, b.settings.rpc_timeout_s, instruments,
                         b.segments, b.settings.shm_segment_bytes, b.draft.other, b.verify.other,
                         b.settings.resume_wait_s)

    async def Generate(self, request, context):
        text, ids, logprobs, prompt_logprobs, last = [], [], [], [], None
        try:
            async with contextlib.aclosing(self.stream(request, client_of(context), context.time_remaining)) as chunks:
                async for chunk in chunks:
                    text.append(chunk.text)
                    ids += chunk.token_ids
                    logprobs += chunk.logprobs
                    prompt_logprobs += chunk.prompt_logprobs
                    last = chunk
        except Failure as e:
            await context.abort(e.code, e.message)
        return pb.GenerateResponse(text="".join(text), token_ids=ids, finish_reason=last.finish_reason,
                                   stats=last.stats, logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    async def GenerateStream(self, request, context):
        try:
            async with contextlib.aclosing(self.stream(request, client_of(context), context.time_remaining)) as chunks:
                async for chunk in chunks:
                    yield chunk
        except Failure as e:
            await context.abort(e.code, e.message)

    async def stream(self, request: pb.GenerateRequest, client: str,
                     time_remaining: Callable[[], float | None]) -> AsyncIterator[pb.GenerateChunk]:
        """One Generate call's chunks, for any front (gRPC here, HTTP in gateway.openai); raises
        Failure. Admitted within the client's cap, counted in flight while it runs, and counted in
        the metrics when it ends however it ends (finish reason and status, time to first token,
        time per output token)."""
        started, first, tokens, last, status = time.perf_counter(), None, 0, None, "CANCELLED"
        try:
            # A long prompt is tokenized off the event loop (6,000 tokens with the chat template: ~20 ms
            # during which every other stream through this gateway would wait).
            ids = await asyncio.to_thread(self._prompt_ids, request) if _long(request) else None
            plan = self.plan(request, ids)
            # The session's state lives on one replica of each service: all its calls go there. With
            # none serving (restarting), a request waits as a resumed one does, within its deadline.
            remaining = time_remaining()
            wait_s = self._backends.settings.resume_wait_s
            verify = await self._backends.verify.wait_pick(wait_s if remaining is None else min(wait_s, remaining))
            draft = self._backends.draft.pick() if plan.speculate and not plan.in_verifier else None
            self._cap.enter(client)
            self._inflight.enter()
            try:
                async with contextlib.aclosing(self._loop(verify, draft).generate(plan, time_remaining)) as chunks:
                    async for chunk in chunks:
                        if chunk.token_ids and first is None:
                            first = time.perf_counter() - started
                        tokens += len(chunk.token_ids)
                        last = chunk
                        yield chunk
            finally:
                self._inflight.leave()
                self._cap.leave(client)
            status = "OK"
        except Failure as e:
            status = e.code.name
            raise
        finally:
            stats = last.stats if last is not None and last.HasField("stats") else None
            self._metrics.ended(request.task_type, stats.speculation_used if stats else None,
                                last.finish_reason if last else 0, status, first, tokens,
                                time.perf_counter() - started)

    def plan(self, request: pb.GenerateRequest, prompt_ids: list[int] | None = None) -> Plan:
        """The request validated (_validated), its drafter and speculation decided (_decided), and its
        token tree and the verifier's own drafts sized (prompt_ids: its tokens, when already
        tokenized)."""
        b = self._backends
        if b.target is None:  # health says NOT_SERVING until connect() finished; be just as clear here
            raise Failure(grpc.StatusCode.UNAVAILABLE, "the gateway is still connecting to its draft and "
                          "verify services")
        prompt_ids = self._prompt_ids(request) if prompt_ids is None else prompt_ids
        sampling, stops = self._validated(request, prompt_ids)
        mode = MODES.get(request.speculation, AUTO)
        drafter = request.drafter or self._default_drafter(request.task_type, mode, sampling.temperature <= 0)
        decision, own = self._decided(request, drafter, mode, sampling)
        speculate = decision.speculate
        gamma = decision.gamma or request.gamma or b.settings.controller.gamma_start
        eos = frozenset() if request.stop.ignore_eos else frozenset(b.target.eos_token_ids)
        # A request that asks for pre-drafting and no tree gets chains (pre-drafting assumes one).
        tree = request.tree_budget or (0 if request.predraft == pb.PREDRAFT_ON else b.settings.tree_budget)
        own_gamma = max(gamma, tree)  # the deepest draft a step of the verifier's own may make
        if tree <= 1 or not speculate or not b.target.tree_verify or own.in_verifier:
            tree = 0  # trees need a verifier that takes them; the verifier's own drafts are chains
        return Plan(prompt_ids=prompt_ids, max_new_tokens=request.max_new_tokens, stop_strings=stops,
                    eos_ids=eos, speculate=speculate, may_fall_back=mode == AUTO, gamma=gamma,
                    drafter=drafter, task_type=request.task_type,
                    needs_features=speculate and not own.in_verifier and b.drafters[drafter].needs_features,
                    sampling=sampling,
                    decision=decision, tree_budget=tree,
                    score_scale=self.controller.score_scale(request.task_type, drafter) if tree else 1.0,
                    predraft=speculate and not own.in_verifier and not tree and not request.HasField("constraint")
                    and self._predraft(request, drafter),
                    skip_prefix_cache=request.skip_prefix_cache, logprobs=self._check_logprobs(request.logprobs),
                    prior=self.controller.prior(request.task_type, drafter, decision) if speculate else None,
                    constraint=request.constraint if request.HasField("constraint") else None,
                    in_verifier=speculate and own.in_verifier, lookup_gamma=own_gamma if own.lookup else 0,
                    head_gamma=own_gamma if own.head else 0)

    def _validated(self, request: pb.GenerateRequest, prompt_ids: list[int]) -> tuple[SamplingParams, tuple[str, ...]]:
        """The request's limits checked (INVALID_ARGUMENT saying which); its sampling and stop strings."""
        settings, max_context = self._backends.settings, self._backends.target.max_context
        if len(prompt_ids) + 1 > max_context:
            raise Failure(grpc.StatusCode.INVALID_ARGUMENT,
                          f"prompt is {len(prompt_ids)} tokens; the target's context is {max_context}, "
                          "which must also hold at least one generated token")
        if request.max_new_tokens < 1:
            raise Failure(grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens must be at least 1")
        if request.max_new_tokens > settings.max_new_tokens_limit:
            raise Failure(grpc.StatusCode.INVALID_ARGUMENT,
                          f"max_new_tokens {request.max_new_tokens} exceeds this gateway's limit of "
                          f"{settings.max_new_tokens_limit}")
        sampling = self._check_sampling(request.sampling)
        stops = tuple(request.stop.stop_strings)
        if len(stops) > MAX_STOP_STRINGS or any(not 1 <= len(s) <= MAX_STOP_LEN for s in stops):
            raise Failure(grpc.StatusCode.INVALID_ARGUMENT,
                          f"at most {MAX_STOP_STRINGS} stop strings of 1..{MAX_STOP_LEN} characters each")
        if request.gamma > MAX_GAMMA:
            raise Failure(grpc.StatusCode.INVALID_ARGUMENT, f"gamma {request.gamma} is not in 1..{MAX_GAMMA}")
        if request.tree_budget > MAX_DRAFT:
            raise Failure(grpc.StatusCode.INVALID_ARGUMENT,
                          f"tree_budget {request.tree_budget} is not in 1..{MAX_DRAFT} (0: the gateway's default)")
        return sampling, stops

    def _decided(self, request: pb.GenerateRequest, drafter: str, mode: str, sampling: SamplingParams):
        """(the controller's Decision, where the drafts are made: backends.OwnDrafts): speculation
        as measured for the request's type and the load, off (AUTO) or refused (ON) while the draft
        service it needs is down, refused where the drafter cannot serve this target."""
        b = self._backends
        if drafter not in b.drafters:
            raise Failure(grpc.StatusCode.INVALID_ARGUMENT,
                          f"unknown drafter {drafter!r}; the draft service has {sorted(b.drafters)}")
        decision = self.controller.decide(request.task_type, drafter, mode, request.gamma,
                                          self._inflight.others())
        own = b.own_drafts(drafter, sampling.temperature == 0)
        if decision.speculate and not own.in_verifier and not b.draft.serving:
            if mode != AUTO:
                raise Failure(grpc.StatusCode.UNAVAILABLE, f"speculation ON needs the draft service, which is down "
                              f"({b.draft.why_none()}); AUTO runs without it meanwhile")
            decision = Decision(False, 0, "drafter-down")
        problem = b.incompatibility(drafter)
        if decision.speculate and problem:
            raise Failure(grpc.StatusCode.FAILED_PRECONDITION, problem)
        return decision, own

    def _default_drafter(self, task_type: str, mode: str, greedy: bool) -> str:
        """A request that names no drafter gets the draft service's default; an AUTO one, that or the
        service's n-gram drafter, as the controller measured them on its task type (a head that
        costs more than it earns on this target loses to n-gram alone: docs/controller.md), unless
        the verifier drafts the default itself with its head: then the default is n-gram's own
        lookup plus the head where the lookup finds nothing, each head token drafted only where it
        pays at its measured price (verify_service.headdraft), and trying n-gram alone could only
        cost traffic."""
        b = self._backends
        default = b.default_drafter
        if mode != AUTO or not b.copiers or default not in b.drafters or default in b.copiers:
            return default
        own = b.own_drafts(default, greedy)
        if own.in_verifier and own.head:
            return default
        return self.controller.drafter(task_type, default, b.copiers[0])

    @staticmethod
    def _check_logprobs(asked: cpb.LogprobsRequest) -> cpb.LogprobsRequest:
        try:
            wire.logprobs(asked).check()
        except ValueError as e:
            raise Failure(grpc.StatusCode.INVALID_ARGUMENT, f"logprobs: {e}") from None
        return asked

    def _predraft(self, request: pb.GenerateRequest, drafter: str) -> bool:
        """The request's choice, else the gateway's setting; `auto`: the controller's measurement."""
        if request.predraft != pb.PREDRAFT_DEFAULT:
            return request.predraft == pb.PREDRAFT_ON
        setting = self._backends.settings.predraft
        return self.controller.predraft(request.task_type, drafter) if setting == "auto" else setting == "on"

    def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        """Tokenizes the prompt (from any thread: it reads only the request and the tokenizer)."""
        tokenizer = self._backends.tokenizer
        kind = request.WhichOneof("prompt")
        if kind == "text":
            ids = tokenizer.encode(request.text) if request.text.strip() else []
            if not ids:
                raise Failure(grpc.StatusCode.INVALID_ARGUMENT, "prompt text is empty")
            return ids
        if kind != "chat" or not request.chat.messages:
            raise Failure(grpc.StatusCode.INVALID_ARGUMENT, "no prompt: set text or chat.messages")
        messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        bad = [m["role"] for m in messages if m["role"] not in ROLES]
        if bad:
            raise Failure(grpc.StatusCode.INVALID_ARGUMENT, f"unknown chat role {bad[0]!r}; use {sorted(ROLES)}")
        if not getattr(tokenizer, "chat_template", None):
            raise Failure(grpc.StatusCode.FAILED_PRECONDITION, "the target's tokenizer has no chat template")
        return chat_prompt_ids(tokenizer, messages)

    @staticmethod
    def _check_sampling(sampling: pb.SamplingParams) -> SamplingParams:
        """The request's sampling, checked once, here at the edge; a seed is drawn when none is given."""
        try:
            return wire.sampling(sampling, seed=sampling.seed if sampling.HasField("seed") else secrets.randbits(63))
        except ValueError as e:
            raise Failure(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None


def register(server: grpc.aio.Server, servicer: GatewayServicer) -> None:
    pb_grpc.add_GatewayServicer_to_server(servicer, server)

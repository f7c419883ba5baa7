"""gRPC front of the draft service: routes sessions to drafters and maps errors to status codes."""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

import grpc
import torch

from draft_service.drafters.base import Drafter, DraftSession, Steps, drive_all, is_stepped, steps_of
from specsplit.api.common.v1 import common_pb2 as cpb
from specsplit.api.draft.v1 import draft_pb2 as pb
from specsplit.api.draft.v1 import draft_pb2_grpc as pb_grpc
from specsplit.errors import Failure
from specsplit.model.identity import pairing_problem
from specsplit.serving import shm, wire
from specsplit.serving.server import Rounds
from specsplit.serving.sessions import Draining, SessionEnded, SessionExists, SessionNotFound, SessionTable, TableFull
from specsplit.serving.settings import MAX_DRAFT, MAX_GAMMA
from specsplit.serving.worker import ModelWorker
from specsplit.speculation.drafting import Proposal
from specsplit.speculation.params import Method

log = logging.getLogger("specsplit.draft")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Drafter"].full_name


@dataclass
class Entry:
    drafter: Drafter
    session: DraftSession
    segment: shm.Segment | None = None  # the gateway's shared-memory segment, when mapped

    def close(self) -> None:
        """Ended (EndSession, or evicted idle), on the worker thread: the drafter's session and the
        segment go."""
        if self.segment is not None:
            self.segment.close()
        self.drafter.end(self.session)


class DrafterServicer(pb_grpc.DrafterServicer):
    def __init__(self, drafters: dict[str, Drafter], default: str, sessions: SessionTable[Entry],
                 worker: ModelWorker, proposal_top_k: int = 16, shared_memory: bool = True):
        if proposal_top_k < 1:
            raise ValueError(f"proposal_top_k {proposal_top_k} must be >= 1")
        if default not in drafters:
            raise ValueError(f"default drafter {default!r} is not one of {sorted(drafters)}")
        self._drafters = drafters
        self._default = default
        self._sessions = sessions
        self._worker = worker
        self._proposal_top_k = proposal_top_k
        self._shared_memory = shared_memory  # map the gateway's segments when offered
        self._ns_per_token: dict[str, int] = {}  # measured in warmup
        sessions.when_evicted(lambda session_id, entry: worker.submit(entry.close))
        self.rounds = Rounds(worker, self.propose_all, pb.ProposeRequest, lambda response: response.draft_ns)

    async def Info(self, request, context):
        infos = [pb.DrafterInfo(**vars(d.description), memory_bytes=d.memory_bytes,
                                draft_ns_per_token=self._ns_per_token.get(name, 0))
                 for name, d in self._drafters.items()]
        return pb.InfoResponse(drafters=infos, default_drafter=self._default,
                               active_sessions=len(self._sessions), max_sessions=self._sessions.max_sessions)

    async def StartSession(self, request, context):
        if not request.session_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "session_id is empty")
        name = request.drafter or self._default
        drafter = self._drafters.get(name)
        if drafter is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"unknown drafter {name!r}; this service has {sorted(self._drafters)}")
        d = drafter.description
        problem = pairing_problem(f"drafter {name!r}", d.tokenizer_fingerprint, d.target_model_fingerprint,
                                  request.target_tokenizer_fingerprint, request.target_model_fingerprint)
        if problem:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        try:
            params = wire.sampling(request.sampling)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {e}")
        start = time.perf_counter_ns()
        session = await self._worker.run(drafter.start, list(request.prompt_token_ids))
        session.sampling, session.proposal_top_k = params, self._proposal_top_k
        session.verify_ms_by_rows = list(request.target_forward_ms_by_rows)
        session.task_type = request.task_type
        prefill_ns = time.perf_counter_ns() - start
        entry = Entry(drafter, session)
        try:
            self._sessions.put(request.session_id, entry)
        except SessionEnded:
            drafter.end(session)
            await context.abort(grpc.StatusCode.ABORTED, f"session {request.session_id} was ended before it "
                                                         "started (its caller gave up on the start)")
        except SessionExists:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"session {request.session_id} already exists")
        except TableFull as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except Draining as e:
            drafter.end(session)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"draft service: {e}")
        # Mapped once the session is held, so the EndSession (or eviction) that drops it unmaps it.
        entry.segment = shm.try_attach(request.shm_segment, self._shared_memory)
        return pb.StartSessionResponse(drafter=name, prefill_ns=prefill_ns,
                                       shm_nonce=entry.segment.nonce if entry.segment else b"",
                                       fast_path=self.rounds.fast_path if entry.segment else "")

    async def Propose(self, request, context):
        return await self.rounds.unary(request, context)

    async def ProposeStream(self, requests, context):
        async for response in self.rounds.stream(requests, context):
            yield response

    def propose_all(self, requests: list[pb.ProposeRequest]) -> list:
        """A batch of rounds on the worker thread (the one owner of drafter state): each synced on its
        own, then their drafting in lock-step, so that drafters with a batching runner (the self
        head) run every session's step in one call; per round its response or Failure. A round's
        draft_ns is its sync plus the batch's drafting until its proposal was done."""
        outcomes: list = [None] * len(requests)
        work, where, synced = [], [], []
        for i, request in enumerate(requests):
            try:
                entry, sync_ns = self._sync(request)
            except Failure as e:
                outcomes[i] = e
                continue
            drafter, session = entry.drafter, entry.session
            steps = steps_of(drafter, session, request.gamma, request.tree_budget)
            work.append((_timed(steps), drafter.runner if is_stepped(drafter) else None))
            where.append(i)
            synced.append((entry, sync_ns))
        start = time.perf_counter_ns()
        for i, (entry, sync_ns), outcome in zip(where, synced, drive_all(work)):
            if isinstance(outcome, ValueError):
                outcomes[i] = Failure(grpc.StatusCode.FAILED_PRECONDITION, str(outcome))
            elif isinstance(outcome, BaseException):
                outcomes[i] = outcome
            else:
                proposal, done_ns = outcome
                outcomes[i] = self._response(entry, proposal, sync_ns + done_ns - start)
        return outcomes

    def _sync(self, request: pb.ProposeRequest):
        """Validates a round and tells its session what was committed: (entry, ns it took)."""
        if not 1 <= request.gamma <= MAX_GAMMA:
            raise Failure(grpc.StatusCode.INVALID_ARGUMENT, f"gamma {request.gamma} is not in 1..{MAX_GAMMA}")
        if request.tree_budget > MAX_DRAFT:
            raise Failure(grpc.StatusCode.INVALID_ARGUMENT,
                          f"tree_budget {request.tree_budget} is not in 0..{MAX_DRAFT}")
        start = time.perf_counter_ns()
        try:
            entry = self._sessions.get(request.session_id)
            features = None
            if request.HasField("features"):
                inline = shm.fetch_features(entry.segment, request.features)
                features = (inline.start, wire.decode(inline))
                width, name = features[1].shape[1], entry.drafter.description.name
                if width != entry.session.feature_dim:
                    raise ValueError(f"features of width {width}; drafter {name!r} reads "
                                     f"{f'width {entry.session.feature_dim}' if entry.session.feature_dim else 'none'}")
            _sync(entry.session, request.base_length, list(request.new_token_ids), features)
        except SessionNotFound:
            raise Failure(grpc.StatusCode.NOT_FOUND, f"unknown session {request.session_id!r}") from None
        except ValueError as e:
            raise Failure(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
        return entry, time.perf_counter_ns() - start

    def _response(self, entry: Entry, proposal: Proposal, draft_ns: int) -> pb.ProposeResponse:
        response = pb.ProposeResponse(draft_token_ids=proposal.tokens, draft_ns=draft_ns, source=proposal.source,
                                      draft_parents=proposal.parents or [], draft_scores=proposal.scores or [])
        dists = _draft_probs(entry.session, proposal)
        where = entry.segment.write_proposal(dists) if dists and entry.segment is not None else None
        if where is not None:
            response.draft_probs_shm.offset, response.draft_probs_shm.length = where
        elif dists:
            response.draft_probs.extend(cpb.SparseProbs(token_ids=ids, probs=probs) for ids, probs in dists)
        return response

    async def EndSession(self, request, context):
        return await self._worker.run(self._end, request)

    def _end(self, request: pb.EndSessionRequest) -> pb.EndSessionResponse:
        """On the worker thread, after any round of the session still queued there."""
        entry = self._sessions.pop(request.session_id)
        if entry is not None:
            if request.new_token_ids:
                try:  # the final sync: a retrieval store remembers the whole committed output
                    entry.session.sync(request.base_length, list(request.new_token_ids))
                except ValueError as e:
                    log.warning("EndSession %s: final sync skipped: %s", request.session_id, e)
            entry.close()
        return pb.EndSessionResponse(ended=entry is not None)

    async def warmup(self) -> None:
        """Runs every drafter once and measures its cost per drafted token."""
        for name, drafter in self._drafters.items():
            self._ns_per_token[name] = await self._worker.run(_measure, drafter)


def _measure(drafter: Drafter, gamma: int = 4, calls: int = 5) -> int:
    """A drafter's median ns per drafted token over `calls` rounds of one committed token each, on
    an 8-token prompt (a first round warms up lazy init)."""
    session = drafter.start([1] * 8)
    dim = session.feature_dim
    if dim:
        session.add_features(0, torch.zeros(7, dim, dtype=torch.float32))
    times = []
    for i in range(calls + 1):
        start = time.perf_counter_ns()
        if i:  # the features of the last token before the new one
            features = (len(session.tokens) - 1, torch.zeros(1, dim, dtype=torch.float32)) if dim else None
            _sync(session, len(session.tokens), [1], features)
        drafter.propose(session, gamma, 0)
        if i:
            times.append((time.perf_counter_ns() - start) / gamma)
    return int(statistics.median(times))


def _sync(session: DraftSession, base_length: int, new_tokens: list[int], features) -> None:
    """Tells a session what was committed since base_length, and the target features (start, rows) it lacks."""
    session.sync(base_length, new_tokens)
    if features is not None:
        session.add_features(*features)


def _timed(steps: Steps) -> Steps:
    """steps whose result is (the proposal, perf_counter_ns when it was done)."""
    proposal = yield from steps
    return proposal, time.perf_counter_ns()


def _draft_probs(session: DraftSession, proposal: Proposal) -> list[tuple[list[int], list[float]]]:
    """Rejection sessions get the distribution of every draft token: the drafter's sampled q, or a
    point mass for a token it chose deterministically (exact: such a token has q = 1)."""
    if session.sampling.verification is not Method.REJECTION:
        return []
    if proposal.probs is None:
        return [([t], [1.0]) for t in proposal.tokens]
    return [(ids.tolist(), q.tolist()) for ids, q in proposal.probs]


def register(server: grpc.aio.Server, servicer: DrafterServicer) -> None:
    pb_grpc.add_DrafterServicer_to_server(servicer, server)

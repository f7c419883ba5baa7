"""gRPC front of the draft service: routes sessions to drafters and maps errors to status codes."""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from draft_service.drafters.base import Drafter, DraftSession
from specsplit.draft.v1 import draft_pb2 as pb
from specsplit.draft.v1 import draft_pb2_grpc as pb_grpc
from specsplit.serving import ModelWorker
from specsplit.sessions import SessionExists, SessionNotFound, SessionTable, TableFull

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Drafter"].full_name
MAX_GAMMA = 64


@dataclass
class Entry:
    drafter: Drafter
    session: DraftSession


class DrafterServicer(pb_grpc.DrafterServicer):
    def __init__(self, drafters: dict[str, Drafter], default: str, sessions: SessionTable[Entry],
                 worker: ModelWorker):
        if default not in drafters:
            raise ValueError(f"default drafter {default!r} is not one of {sorted(drafters)}")
        self._drafters = drafters
        self._default = default
        self._sessions = sessions
        self._worker = worker

    async def Info(self, request, context):
        infos = [pb.DrafterInfo(**vars(d.description)) for d in self._drafters.values()]
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
        theirs = drafter.description.tokenizer_fingerprint
        if request.target_tokenizer_fingerprint and theirs and theirs != request.target_tokenizer_fingerprint:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"drafter {name!r} uses tokenizer {theirs}, the target uses "
                                f"{request.target_tokenizer_fingerprint}: token ids would not match")
        start = time.perf_counter_ns()
        session = drafter.start(list(request.prompt_token_ids))
        prefill_ns = time.perf_counter_ns() - start
        try:
            self._sessions.put(request.session_id, Entry(drafter, session))
        except SessionExists:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"session {request.session_id} already exists")
        except TableFull as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        return pb.StartSessionResponse(drafter=name, prefill_ns=prefill_ns)

    async def Propose(self, request, context):
        if not 1 <= request.gamma <= MAX_GAMMA:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"gamma {request.gamma} is not in 1..{MAX_GAMMA}")
        try:
            entry = self._sessions.get(request.session_id)
            args = (entry, request.base_length, list(request.new_token_ids), request.gamma)
            # A model-free drafter answers in microseconds: the worker-thread hop (~0.2 ms) would
            # cost more than the drafting.
            drafts, draft_ns = (await self._worker.run(_sync_and_propose, *args) if entry.drafter.runs_model
                                else _sync_and_propose(*args))
        except SessionNotFound:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown session {request.session_id!r}")
        except ValueError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return pb.ProposeResponse(draft_token_ids=drafts, draft_ns=draft_ns)

    async def EndSession(self, request, context):
        return pb.EndSessionResponse(ended=self._sessions.pop(request.session_id) is not None)

    async def warmup(self) -> None:
        for drafter in self._drafters.values():
            await self._worker.run(drafter.propose, drafter.start([0] * 8), 4)


def _sync_and_propose(entry: Entry, base_length: int, new_tokens: list[int], gamma: int) -> tuple[list[int], int]:
    start = time.perf_counter_ns()
    entry.session.sync(base_length, new_tokens)
    drafts = entry.drafter.propose(entry.session, gamma)
    return drafts, time.perf_counter_ns() - start


def register(server: grpc.aio.Server, servicer: DrafterServicer) -> None:
    pb_grpc.add_DrafterServicer_to_server(servicer, server)

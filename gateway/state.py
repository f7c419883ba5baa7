"""A request's state in the gateway: the validated plan, where decoding stands (a
specsplit.speculation.cursor.Cursor), its links, and what each round
did (plain tuples, turned into messages, spans and metrics only after the answer)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from gateway.drafts import DraftSide
from gateway.gate import Gate
from gateway.payloads import Links
from gateway.plan import Plan
from specsplit.api.common.v1 import common_pb2 as cpb
from specsplit.speculation.cursor import Cursor


class Round(NamedTuple):
    """One round's facts as measured (ns), before any accounting (specsplit.serving.roundtime)."""

    drafted: int
    accepted: int
    draft_ns: int  # drafter compute for this round's drafts (server-reported)
    draft_call_ns: int  # Propose wall time on the round's critical path (0: none, or pre-drafted)
    verify_ns: int  # verifier compute (server-reported)
    verify_call_ns: int  # Verify wall time
    round_ns: int  # wall time since the previous round ended (gateway work between rounds included)
    source: str
    feature_bytes: int
    proposal_bytes: int
    predrafted: bool
    depth: int  # the draft's longest path (a chain: drafted)
    expected: float  # the drafter's estimate of accepted drafts (sum of the verified scores); 0: unscored
    batch_rows: int = 0  # the verify forward's rows across the verifier's batch
    batch_calls: int = 0  # and its calls (sessions)
    decoded: int = 0  # tokens the verifier committed on its own after next_token (VerifyRequest.decode_ahead)
    lookup_drafted: int = 0  # of which its own prompt-lookup drafts (VerifyRequest.lookup_gamma)
    lookup_accepted: int = 0
    lookup_steps: int = 0  # the verifier's forwards that verified such drafts
    forced: int = 0  # drafts the verifier made because the constraint forced them
    forced_accepted: int = 0
    asked: bool = False  # the round asked the drafter (or used a pre-draft)
    copy: bool = False  # a copy was in sight as it started (gateway.gate)
    head_drafted: int = 0  # of the decoded tokens, the verifier's own feature-head drafts (where the features are)
    head_accepted: int = 0
    head_steps: int = 0
    head_ns: int = 0  # the verifier's drafting time for them (inside the Verify call, not its forwards)


@dataclass
class Measured:
    """What the request's stats, spans and metrics are made of (gateway.instruments), after the answer."""

    rounds: list[Round] = field(default_factory=list)
    prefill_ns: int = 0  # wall time of Prefill + StartSession
    prefill_verify_ns: int = 0  # the verifier's prefill compute
    prefix_cached: int = 0  # prompt tokens the verifier's prefix cache held
    prefill_chunks: int = 0
    # perf_counter_ns marks: the request's start, its prefill's and its decoding's (the rounds follow
    # on from decode_mark, each round_ns long).
    started: int = 0
    prefill_mark: int = 0
    decode_mark: int = 0
    predraft_attempts: int = 0
    predraft_hits: int = 0
    resumes: int = 0  # times the session was re-opened on a verify replica after its own died
    resume_ns: int = 0  # the time that took: waiting for a replica, and the re-prefill
    constraint_complete: bool = False  # the output is a whole sentence of its constraint's language (last verdict)


@dataclass
class Request:
    """A request between rounds, by owner: its plan; its place in the round protocol (`cursor`, the
    speculation core's); its drafter side (gateway.drafts: whether it drafts, what the drafter is
    owed, its pre-draft); its links; its measurements."""

    plan: Plan
    session_id: str
    cursor: Cursor
    drafter: DraftSide
    links: Links = field(default_factory=Links)
    gate: Gate = field(default_factory=Gate)  # whether each round asks the drafter (AUTO: judged per round)
    measured: Measured = field(default_factory=Measured)
    # With plan.logprobs: one per committed token, in order (the emitted tokens are a prefix), and
    # the prompt's.
    logprobs: list[cpb.TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[cpb.TokenLogprob] = field(default_factory=list)

    @property
    def speculates(self) -> bool:
        """Drafts reach its rounds: the draft service's, or (plan.in_verifier) the verifier's own."""
        return self.drafter.drafting or self.plan.in_verifier

"""A Verify that decodes ahead (VerifyRequest.decode_ahead): the verifier commits its own tokens,
one batched forward a step (the worker's Again brings the call back to the next batch), drafting
copies from the session's context where it can (lookup_gamma), until the budget, a stop token or
the context's end; then one answer for them all (docs/protocol.md#session-life-cycle)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from specsplit.api.verify.v1 import verify_pb2 as pb
from specsplit.speculation.lookup import OutputIndex
from verify_service.steps import TargetSession


def decodes(request: pb.VerifyRequest) -> bool:
    """Whether a Verify decodes ahead: asked to, with no draft of its caller's."""
    return request.decode_ahead > 0 and not request.draft_token_ids


@dataclass(eq=False)
class Decoding:
    """A decode-ahead between its steps (the verify service keeps one per session while it runs)."""

    results: list = field(default_factory=list)  # each step's VerifyResult
    looked: int = 0  # the step in flight's prompt-lookup draft
    drafted: int = 0  # its steps' lookup drafts
    lookup_steps: int = 0  # its steps that verified a lookup draft
    copying: bool = False  # the last lookup was accepted whole
    head_looked: int = 0  # the step in flight's head draft (verify_service.headdraft), where the lookup had none
    head_drafted: int = 0
    head_accepted: int = 0
    head_steps: int = 0
    head_ns: int = 0  # the head's drafting time, over its steps

    @property
    def accepted(self) -> int:  # lookup drafts accepted
        return sum(r.num_accepted for r in self.results)

    @property
    def forced(self) -> tuple[int, int]:  # under a constraint: tokens it forced as drafts, and accepted
        return sum(r.forced for r in self.results), sum(r.forced_accepted for r in self.results)

    @property
    def committed(self) -> int:
        return len(self.results) + self.accepted

    def draft(self, request: pb.VerifyRequest, session: TargetSession, step_ms: list[float],
              outputs: OutputIndex | None = None, head=None) -> tuple[list[int], list[int] | None]:
        """The next step's draft and, for a token tree, its parents (None: a chain). A prompt-lookup
        draft: where the last two tokens occurred before, what followed them (in the session's own
        context, or in earlier outputs where a stored occurrence
        agrees with more of the context), as many tokens as pay at the rate the session's lookups
        have been accepted and the forward's cost by width (`step_ms`, from 1 row up), within
        lookup_gamma (twice that after a lookup accepted whole: a span being copied) and so that
        accepted + 1 fits the budget. (Under rejection sampling each token's q is 1 on it:
        Target.plan_verify's `copied`.) Where it finds nothing, the session's feature head drafts
        up to head_gamma tokens deep if it has one here (`head`: verify_service.headdraft.VerifierHead;
        a chain, or a tree)."""
        want = request.lookup_gamma * (2 if self.copying else 1)
        room = min(want, request.decode_ahead - self.committed)
        room = session.agreement.depth(room, step_ms) if room > 0 else 0
        draft, agree = session.index.match(session.tokens, room)
        if outputs is not None and room > 0:
            stored, longer = outputs.match(session.tokens, room)
            if longer > agree:
                draft = stored
        self.looked, self.head_looked = len(draft), 0
        if not draft and request.head_gamma and head is not None and session.head is not None:
            room = min(request.head_gamma, request.decode_ahead - self.committed)
            drafted = head.draft(session.head, room, step_ms)
            self.head_ns += drafted.ns
            self.head_looked = len(drafted.tokens)
            return drafted.tokens, drafted.parents
        return draft, None

    def add(self, result, session: TargetSession) -> None:
        self.results.append(result)
        if result.constrained:  # the lookup as verified: cut to the language, forced tokens aside
            self.looked = len(result.draft) - result.forced
        own = result.num_accepted - result.forced_accepted  # of the lookup's (or the head's) tokens
        if self.head_looked:
            self.head_drafted += self.head_looked
            self.head_accepted += own
            self.head_steps += 1
            self.copying = False
            return
        self.drafted += self.looked
        self.lookup_steps += self.looked > 0
        self.copying = self.looked > 0 and own == self.looked
        if self.looked:
            session.agreement.add(self.looked, own)

    def finished(self, request: pb.VerifyRequest, session: TargetSession, max_context: int) -> bool:
        """After the step just added: the budget spent, a stop token committed, or the context full."""
        new = session.tokens[len(session.tokens) - 1 - self.results[-1].num_accepted:]
        return (self.committed > request.decode_ahead or bool(session.stop_tokens.intersection(new))
                or self.results[-1].length >= max_context)

    def merged(self):
        """One VerifyResult for its steps: the last one's, with every step's feature rows."""
        features = [r.features for r in self.results]
        return dataclasses.replace(self.results[-1], features=None if features[0] is None else torch.cat(features))

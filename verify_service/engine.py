"""The target side of speculation: prefill, verify k drafted tokens in one forward, roll back."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specsplit.modeling import KVSequence, LoadedModel, Sequence
from specsplit.sampling import SamplingParams, warp
from verify_service.acceptance import coupled_accept, greedy_accept, rejection_accept

METHODS = ("coupled", "rejection")


class ContextFull(ValueError):
    pass


class LengthMismatch(ValueError):
    pass


@dataclass
class TargetSession:
    """Committed tokens of one sequence. The KV cache always holds tokens[:-1]: the last committed
    token (the target's own latest choice) is fed at the head of the next verify call."""

    kv: Sequence
    tokens: list[int] = field(default_factory=list)
    with_features: bool = False  # return the features of newly committed positions
    sampling: SamplingParams = SamplingParams()  # temperature 0: greedy
    method: str = "coupled"  # with temperature > 0: coupled | rejection
    segment: object = None  # the gateway's shared-memory segment, when mapped (specsplit.shm)


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: int
    next_token: int
    length: int
    forward_ns: int
    # With features: [num_accepted + 1, hidden] for positions [length_before - 1, length - 1).
    features: torch.Tensor | None = None


class Target:
    """Runs the target model. Blocking: call from one worker thread at a time."""

    def __init__(self, lm: LoadedModel, new_sequence=None):
        self.lm = lm
        self._new_sequence = new_sequence or (lambda: KVSequence(lm.model))  # a session's cache

    def prefill(self, prompt: list[int], with_features: bool = False, sampling: SamplingParams = SamplingParams(),
                method: str = "coupled") -> tuple[TargetSession, VerifyResult]:
        """Returns the new session and its first generated token (as a result with no drafts;
        features, if asked, cover the prompt)."""
        sampling.check()
        if method not in METHODS:
            raise ValueError(f"unknown verify method {method!r}; use one of {METHODS}")
        self._check_room(len(prompt) + 1)
        start = time.perf_counter_ns()
        session = TargetSession(kv=self._new_sequence(), tokens=list(prompt), with_features=with_features,
                                sampling=sampling, method=method)
        logits, features = self._forward(session, prompt, last_only=True)  # [1, vocab]
        _, first = self._decide(session, logits, [], [], len(prompt))
        session.tokens.append(first)
        return session, VerifyResult(0, first, len(session.tokens), time.perf_counter_ns() - start, features)

    def verify(self, session: TargetSession, length: int, draft: list[int],
               proposals: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> VerifyResult:
        """proposals: for rejection sampling, the sparse distribution (ids, probs) each draft token
        was sampled from."""
        if length != len(session.tokens):
            raise LengthMismatch(f"session has {len(session.tokens)} committed tokens, request says {length}")
        vocab = self.lm.vocab_size
        bad = [t for t in draft if t >= vocab]
        if bad:
            raise ValueError(f"draft token ids {bad[:4]} out of range for vocab size {vocab}")
        proposals = proposals or []
        if self._rejects(session):
            self._check_proposals(draft, proposals)
        self._check_room(length + len(draft) + 1)
        start = time.perf_counter_ns()
        # Feed the last committed token and the draft: row i of the logits predicts draft[i].
        logits, features = self._forward(session, [session.tokens[-1], *draft])  # [k+1, vocab]
        try:
            accepted, next_token = self._decide(session, logits, draft, proposals, length)
        except BaseException:
            session.kv.truncate(length - 1)  # a refused call leaves the session as it was
            raise
        # Roll back by position: keep the cache for the committed prefix plus accepted drafts.
        session.kv.truncate(length + accepted)
        session.tokens += [*draft[:accepted], next_token]
        if features is not None:
            features = features[:accepted + 1]
        return VerifyResult(accepted, next_token, len(session.tokens), time.perf_counter_ns() - start, features)

    @staticmethod
    def _rejects(session: TargetSession) -> bool:
        return session.sampling.temperature > 0 and session.method == "rejection"

    def _decide(self, session: TargetSession, logits: torch.Tensor, draft: list[int],
                proposals: list, start: int) -> tuple[int, int]:
        """logits [k+1, vocab] for absolute positions start..start+k -> (accepted, next token)."""
        params = session.sampling
        if params.temperature == 0:
            return greedy_accept(logits, draft)
        probs = warp(logits, params)
        if session.method == "coupled":
            return coupled_accept(probs, draft, params.seed, start)
        accepted, token, _ = rejection_accept(probs, draft, proposals, params.seed, start)
        return accepted, token

    def _check_proposals(self, draft: list[int], proposals: list) -> None:
        if len(proposals) != len(draft):
            raise ValueError(f"rejection sampling needs one proposal distribution per draft token: "
                             f"{len(proposals)} for {len(draft)} tokens")
        for token, (ids, q) in zip(draft, proposals):
            if len(ids) and int(ids.max()) >= self.lm.vocab_size:
                raise ValueError(f"proposal token id {int(ids.max())} out of range for vocab size {self.lm.vocab_size}")
            if not bool(((ids == token) & (q > 0)).any()):
                raise ValueError(f"draft token {token} has probability 0 in its proposal")

    @staticmethod
    def _forward(session: TargetSession, ids: list[int], last_only: bool = False):
        if session.with_features:
            return session.kv.forward_with_features(ids, last_only=last_only)
        return session.kv.forward(ids, last_only=last_only), None

    def _check_room(self, needed: int) -> None:
        if needed > self.lm.max_context:
            raise ContextFull(f"{needed} tokens exceed the target's context of {self.lm.max_context}")

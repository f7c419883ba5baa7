"""The target side of speculation: prefill, verify k drafted tokens in one forward, roll back."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specsplit.modeling import KVSequence, LoadedModel
from verify_service.acceptance import greedy_accept


class ContextFull(ValueError):
    pass


class LengthMismatch(ValueError):
    pass


@dataclass
class TargetSession:
    """Committed tokens of one sequence. The KV cache always holds tokens[:-1]: the last committed
    token (the target's own latest choice) is fed at the head of the next verify call."""

    kv: KVSequence
    tokens: list[int] = field(default_factory=list)
    with_features: bool = False  # return the features of newly committed positions


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

    def __init__(self, lm: LoadedModel):
        self.lm = lm

    def prefill(self, prompt: list[int], with_features: bool = False) -> tuple[TargetSession, VerifyResult]:
        """Returns the new session and its first generated token (as a result with no drafts;
        features, if asked, cover the prompt)."""
        self._check_room(len(prompt) + 1)
        start = time.perf_counter_ns()
        session = TargetSession(kv=KVSequence(self.lm.model), tokens=list(prompt), with_features=with_features)
        logits, features = self._forward(session, prompt, last_only=True)  # [1, vocab]
        first = int(logits[0].argmax())
        session.tokens.append(first)
        return session, VerifyResult(0, first, len(session.tokens), time.perf_counter_ns() - start, features)

    def verify(self, session: TargetSession, length: int, draft: list[int]) -> VerifyResult:
        if length != len(session.tokens):
            raise LengthMismatch(f"session has {len(session.tokens)} committed tokens, request says {length}")
        vocab = self.lm.vocab_size
        bad = [t for t in draft if t >= vocab]
        if bad:
            raise ValueError(f"draft token ids {bad[:4]} out of range for vocab size {vocab}")
        self._check_room(length + len(draft) + 1)
        start = time.perf_counter_ns()
        # Feed the last committed token and the draft: row i of the logits predicts draft[i].
        logits, features = self._forward(session, [session.tokens[-1], *draft])  # [k+1, vocab]
        accepted, next_token = greedy_accept(logits, draft)
        # Roll back by position: keep the cache for the committed prefix plus accepted drafts.
        session.kv.truncate(length + accepted)
        session.tokens += [*draft[:accepted], next_token]
        if features is not None:
            features = features[:accepted + 1]
        return VerifyResult(accepted, next_token, len(session.tokens), time.perf_counter_ns() - start, features)

    @staticmethod
    def _forward(session: TargetSession, ids: list[int], last_only: bool = False):
        if session.with_features:
            return session.kv.forward_with_features(ids, last_only=last_only)
        return session.kv.forward(ids, last_only=last_only), None

    def _check_room(self, needed: int) -> None:
        if needed > self.lm.max_context:
            raise ContextFull(f"{needed} tokens exceed the target's context of {self.lm.max_context}")

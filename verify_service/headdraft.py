"""The target's feature head run where the features are: the verify service's decode-ahead drafts
with it where its prompt lookup finds nothing, so that a head round crosses no process (the draft
service still serves the head to layouts that place it there, features over the wire).

A self-draft head is part of the target (the design note's "self-drafting from the model's own
layers"): each step's features come out of the verify forward straight into the head's track, and
a greedy round is one native call (specsplit.model.headserving.NativeHead.draft)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specsplit.model.headserving import HeadTrack, NativeHead
from specsplit.speculation.lookup import Agreement

MIN_EXPAND = 0.05  # unused by chains; a HeadRound carries it


@dataclass
class HeadState:
    """One target session's head: its features and cache, how often the target follows its drafts,
    and the size of the step in flight's head draft."""

    track: HeadTrack
    trust: Agreement = field(default_factory=Agreement)
    looked: int = 0


class VerifierHead:
    """A feature head on the native kernels drafting for the verify service's own steps."""

    def __init__(self, runner: NativeHead, model_id: str, gamma: int, min_confidence: float):
        self.runner = runner
        self.model_id = model_id
        self.gamma = gamma  # at most this many tokens a draft
        self.min_confidence = min_confidence  # the chain stops below this probability of being right

    def start(self, prompt: list[int]) -> HeadState:
        return HeadState(HeadTrack(self.runner.head.cfg.hidden, self.runner.new_cache(), len(prompt)))

    def prefilled(self, state: HeadState, tokens: list[int], features: torch.Tensor) -> None:
        """The prompt is in (tokens: it and the first generated token), with its features."""
        state.track.put_features(0, features, len(tokens))

    def follow(self, state: HeadState, length: int, tokens: list[int], features: torch.Tensor,
               accepted: int) -> None:
        """A step committed tokens[length:] (the session's whole list), `accepted` of them from its
        head draft if it verified one; features [n, hidden] of positions [length - 1, len(tokens) - 1)."""
        if state.looked:
            state.trust.add(state.looked, accepted)
            state.looked = 0
        state.track.cut(length)
        state.track.put_features(length - 1, features, len(tokens))

    def draft(self, state: HeadState, tokens: list[int], room: int, step_ms: list[float]) -> list[int]:
        """As many head tokens as pay at the rate the target has followed this session's head drafts
        and the forward's cost by width (Agreement.depth), at most `room` and gamma: a chain, one
        native call."""
        depth = state.trust.depth(min(room, self.gamma), step_ms) if room > 0 else 0
        if not depth:
            return []
        drafted = self.runner.run([state.track.round(tokens, depth, self.min_confidence, 0, MIN_EXPAND)])[0]
        state.track.took(drafted)
        state.looked = len(drafted.chain.tokens)
        return drafted.chain.tokens

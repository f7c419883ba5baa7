"""The target's feature head run where the features are: the verify service's decode-ahead drafts
with it where its prompt lookup finds nothing, so that a head round crosses no process (the draft
service still serves the head to layouts that place it there, features over the wire).

A self-draft head is part of the target (the design note's "self-drafting from the model's own
layers"): each step's features come out of the verify forward straight into the head's track, and
a greedy round is one native call (specsplit.model.headserving.NativeHead.draft)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from specsplit.model.headserving import NativeHead
from specsplit.speculation import tokentree
from specsplit.speculation.ewma import Ewma
from specsplit.speculation.lookup import Agreement

if TYPE_CHECKING:
    from verify_service.engine import Target

DECAY = 0.95  # per round, for the head's price
MAX_WIDTH = 16  # the kernels' widest tree step (DraftHead::draft)
MIN_EXPAND = 0.05  # a tree's node is expanded only if its path probability is at least this
OUTLIER = 4.0  # a round counts at most this many times what its size is priced at (a preempted one)
WARMUP_PASSES = 4  # Price's first rounds at start, each after a 1-row forward (the first pass: cold, dropped)


class Price:
    """What the head's drafting costs this service: a round's wall time as a fixed part plus a part
    per drafted token, fitted by least squares over decayed sums of its rounds (a round the
    confidence stop cut to nothing counts at 0 tokens). The fixed part is mostly the first step
    reading the head's weights back into caches the target's forward flushed (measured on an EPYC
    with AVX-512, a 2.3 ms step: 0.29 ms for a 1-token round right after a forward, 0.41 for 3,
    0.61 for 5; 0.07 ms a step back to back); an average per token would charge it to every token,
    make short rounds look dear, and shorten them further. Until rounds of two sizes are seen, the
    mean round is all fixed (so that a deeper one is tried). A round counts at most OUTLIER times
    its predicted price: one preempted by a neighbour (measured on a busy CI host: tens of ms) would
    otherwise price the head above a step, and the head, silenced but for a probe every 16 steps,
    would hardly ever be timed again to undo it."""

    def __init__(self):
        self.w = self.n = self.nn = self.ms = self.nms = 0.0  # decayed sums of 1, n, n², ms, n·ms

    def add(self, ms: float, tokens: int) -> None:
        fixed, per = self.parts
        if fixed + per > 0:
            ms = min(ms, OUTLIER * (fixed + per * tokens))
        d = DECAY
        self.w, self.n, self.nn = self.w * d + 1, self.n * d + tokens, self.nn * d + tokens * tokens
        self.ms, self.nms = self.ms * d + ms, self.nms * d + tokens * ms

    @property
    def parts(self) -> tuple[float, float]:
        """(ms a round, ms a drafted token); (0, 0) before any round."""
        if not self.w:
            return 0.0, 0.0
        spread = self.w * self.nn - self.n * self.n
        per = (self.w * self.nms - self.n * self.ms) / spread if spread > 1e-6 * self.w * self.w else 0.0
        if per <= 0:  # one round size seen (or noise): all of it a round's, so a deeper round is tried
            return self.ms / self.w, 0.0
        fixed = (self.ms - per * self.n) / self.w
        return (fixed, per) if fixed >= 0 else (0.0, self.ms / self.n)


@dataclass
class HeadState:
    """One target session's head: its tokens, features and cache (a native HeadSequence), how often
    the target follows its drafts, and the size of the step in flight's head draft."""

    sequence: object
    trust: Agreement = field(default_factory=Agreement)
    looked: int = 0  # the depth of the draft in flight (0: none)
    expected: float = 0.0  # a tree in flight: its kept nodes' scores summed, the tokens they promise
    accepted: Ewma = field(default_factory=lambda: Ewma(DECAY))  # by tree round, accepted tokens
    promised: Ewma = field(default_factory=lambda: Ewma(DECAY))  # and the sum of the kept nodes' scores

    @property
    def scale(self) -> float:
        """How far this session's tree scores have held up (tokentree.score_scale)."""
        return tokentree.score_scale(self.accepted.value, self.promised.value)


class HeadDraft(NamedTuple):
    tokens: list[int]
    ns: int  # what drafting them took (0: no round ran)
    parents: list[int] | None = None  # a token tree's (-1: the last committed token); None: a chain


class VerifierHead:
    """A feature head on the native kernels drafting for the verify service's own steps."""

    def __init__(self, runner: NativeHead, model_id: str, gamma: int, min_confidence: float, width: int = 0):
        self.runner = runner
        self.model_id = model_id
        self.gamma = gamma  # at most this many tokens a draft (a tree: this deep)
        self.min_confidence = min_confidence  # a chain stops below this probability of being right
        if not 0 <= width <= MAX_WIDTH:
            raise ValueError(f"head width {width}: 0 (chains) to {MAX_WIDTH} nodes expanded a depth")
        self.width = width  # > 0: EAGLE-2 trees, this many nodes expanded a depth; 0: chains
        self.price = Price()  # every session's rounds: the head and the machine are the service's

    def measure(self, target: Target, token: int) -> None:
        """The head's price before the first request (Price: a request's first round must not learn
        it from a cold call, 1.6 ms against 0.4 warm, measured): rounds of one and gamma tokens,
        each right after a 1-row forward of a 32-token session of `token`, as when serving."""
        session, result = target.prefill([token] * 32, with_features=True)
        sequence = self.runner.sequence()
        sequence.begin(session.tokens, result.features)
        try:
            for n in range(WARMUP_PASSES):
                for depth in (1, self.gamma):
                    length = len(session.tokens)
                    result = target.verify(session, length, [])
                    sequence.follow(length, session.tokens[length:], result.features)
                    started = time.perf_counter_ns()
                    drafted = sequence.draft(depth, 0.0)
                    if n:
                        self.price.add((time.perf_counter_ns() - started) / 1e6, len(drafted))
        finally:
            session.kv.free()

    def start(self, prompt: list[int]) -> HeadState:
        return HeadState(self.runner.sequence())

    def prefilled(self, state: HeadState, tokens: list[int], features: torch.Tensor) -> None:
        """The prompt is in (tokens: it and the first generated token), with its features."""
        state.sequence.begin(tokens, features)

    def follow(self, state: HeadState, length: int, tokens: list[int], features: torch.Tensor,
               accepted: int) -> None:
        """A step committed tokens[length:] (the session's whole list), `accepted` of them from its
        head draft if it verified one; features [n, hidden] of positions [length - 1, len(tokens) - 1)."""
        if state.looked:
            state.trust.add(state.looked, accepted)
            if state.expected:
                state.accepted.add(accepted)
                state.promised.add(state.expected)
            state.looked, state.expected = 0, 0.0
        state.sequence.follow(length, tokens[length:], features)

    def draft(self, state: HeadState, room: int, step_ms: list[float]) -> HeadDraft:
        """As deep as pays at the rate the target has followed this session's head drafts, the
        forward's cost by width and the head's own price a round and a depth (Agreement.depth), at
        most `room` and gamma: a chain, or a tree cut to its nodes whose expected tokens (their
        scores, scaled by how this session's have held up) pay for their rows at that cost
        (tokentree.worth_verifying); one native call, timed once (its price here, and what the
        decode-ahead reports)."""
        depth = state.trust.depth(min(room, self.gamma), step_ms, *self.price.parts) if room > 0 else 0
        if not depth:
            return HeadDraft([], 0)
        return self._tree(state, depth, step_ms) if self.width else self._chain(state, depth)

    def _chain(self, state: HeadState, depth: int) -> HeadDraft:
        started = time.perf_counter_ns()
        drafted = state.sequence.draft(depth, self.min_confidence)
        ns = time.perf_counter_ns() - started
        self.price.add(ns / 1e6, len(drafted))
        state.looked = len(drafted)
        return HeadDraft(drafted, ns)

    def _tree(self, state: HeadState, depth: int, step_ms: list[float]) -> HeadDraft:
        started = time.perf_counter_ns()
        parents, tokens, scores = state.sequence.draft_tree(depth, self.width, MIN_EXPAND)
        ns = time.perf_counter_ns() - started
        self.price.add(ns / 1e6, max(tokentree.depths(parents), default=0))  # a depth is one head step, however wide
        tree, node = tokentree.Tree(), []
        for parent, token, score in zip(parents, tokens, scores):
            node.append(tree.add(node[parent] if parent >= 0 else -1, token, score))
        tokens, parents, scores, _ = tree.select(len(tokens), depth)  # best first: every prefix a tree
        keep, parents = tokentree.prune(parents, depth, tokentree.worth_verifying(
            [x * state.scale for x in scores], step_ms, ns / 1e6))
        state.looked = max(tokentree.depths(parents), default=0)
        state.expected = sum(scores[i] for i in keep)
        return HeadDraft([tokens[i] for i in keep], ns, parents)

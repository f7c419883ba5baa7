"""Per request and per round: whether asking the drafter pays. The controller's per-type state is a
prior, not a verdict: each request is judged on its own evidence, so unlabelled, mixed traffic gets
speculation where its text can be drafted (a document to copy) and loses nothing where it cannot.

The evidence is of two kinds. Before a round: can the text be copied here? The gate keeps the
request's context (prompt and committed tokens) indexed by bigram; when the last two tokens occurred
before, a retrieval draft exists (the drafters' n-gram source matches two tokens or more). After it:
committed tokens per millisecond of rounds that asked the drafter, kept apart for rounds with and
without such a match, against those of rounds that did not ask (the verifier decoding on its own).
A kind of round that does not pay (below 0.97 of the rate without asking, while it asks) is asked
no more, except now and then (a probe: after 4 tokens, then 8, 16, then every 32); meanwhile the
verifier decodes on its own and drafts copies from the context itself (prompt lookup). Plain
Python, no gRPC (docs/controller.md#per-request)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specsplit.spec.ewma import Ewma
from specsplit.spec.lookup import BigramIndex

DECAY = 0.95  # per asked round: acceptance is noisy round to round (a geometric run); bursts are the copy signal's
PRIOR_ROUNDS = 1.0  # the type's prior counts as this many rounds of the request's own
HOLD = 0.97  # asking stops below this share of the rate without asking (an ask that finds nothing costs ~10 %)
ASK_COST = 1.25  # a round that asks, in rounds that do not, until one that does not is timed
# Tokens between probes of a kind of round that does not pay, doubled after each probe that lost: a
# failed ask costs about a third of a step here (chat: 12 asks in 128 tokens cost 4 %).
PROBE_MIN, PROBE_MAX = 4, 32


@dataclass(frozen=True)
class Prior:
    """What the request's type (or load bucket) knows: a round that asks commits `tokens` in
    `on_ms`; a round that does not commits one token in `off_ms`. None fields: unknown.
    `situations`: where the type's earlier requests asked with a copy in sight (True) or without
    (False), what those rounds committed and took, (tokens, on_ms): that situation's prior instead."""

    tokens: float | None = None
    on_ms: float | None = None
    off_ms: float | None = None
    situations: dict[bool, tuple[float, float]] = field(default_factory=dict)


class _Kind:
    """Rounds that asked the drafter in one situation (a copy in sight, or not): what they earned,
    whether asking pays, and when to probe again if it does not."""

    def __init__(self, prior: Prior, copy: bool):
        self.tokens, self.on_ms = Ewma(DECAY), Ewma(DECAY)
        tokens, on_ms = prior.situations.get(copy, (prior.tokens, prior.on_ms))
        if tokens is not None and on_ms is not None:
            self.tokens.add(tokens, PRIOR_ROUNDS)
            self.on_ms.add(on_ms, PRIOR_ROUNDS)
        self.asking = True  # set from the prior by the gate
        self.interval = PROBE_MIN
        self.since_ask = 0  # tokens since this kind last asked: off by its prior, it probes after PROBE_MIN


class Gate:
    """`extend(prompt)`, then `ask()` before a round and `record()` and `extend()` after it.
    `always`: a forced request (speculation ON) asks every round."""

    def __init__(self, prior: Prior = Prior(), always: bool = False):
        self.always = always
        self.off_ms = Ewma(DECAY)
        if prior.off_ms is not None:
            self.off_ms.add(prior.off_ms, PRIOR_ROUNDS)
        self.kinds = {copy: _Kind(prior, copy) for copy in (True, False)}
        for kind in self.kinds.values():
            kind.asking = self._pays(kind.tokens.value, kind.on_ms.value)
        self._context: list[int] = []  # the prompt and the committed tokens
        self._index = BigramIndex()
        self._kind: _Kind | None = None  # the kind of the round under way

    def extend(self, tokens: list[int]) -> None:
        """The prompt, then each round's committed tokens, join the context."""
        self._context += tokens

    @property
    def copyable(self) -> bool:
        """The last two tokens occurred before in the context: a retrieval draft exists."""
        return bool(self._index.follows(self._context, 1))

    def _pays(self, tokens: float | None, on_ms: float | None, share: float = 1.0) -> bool:
        """Whether rounds that ask, committing `tokens` in `on_ms`, beat `share` of the rate of rounds
        that do not (unknown: yes; no round without asking timed yet: ASK_COST of one that asks)."""
        if tokens is None or on_ms is None:
            return True
        off_ms = self.off_ms.value
        return tokens / on_ms >= share / (off_ms if off_ms is not None else on_ms / ASK_COST)

    def ask(self) -> bool:
        kind = self._kind = self.kinds[self.copyable]
        return self.always or kind.asking or kind.since_ask >= kind.interval

    def off_run(self) -> int:
        """Tokens the verifier may decode on its own now, this round's own included (at least 1):
        until rounds without a copy in sight are due a probe (copies meanwhile are the verifier's own
        prompt lookup's). One that is due while a copy is in sight waits for PROBE_MIN more tokens
        rather than for every token."""
        if self.ask():
            return 1
        kind = self.kinds[False]
        due = kind.interval - kind.since_ask
        return due if due > 0 else PROBE_MIN

    def record(self, asked: bool, committed: int, ms: float) -> bool:
        """A round's outcome: it asked the drafter or not, committed `committed` tokens in `ms` wall
        time (everything on its critical path). Returns whether a copy was in sight as it started.
        Call extend() with its tokens after."""
        kind = self._kind if self._kind is not None else self.kinds[self.copyable]
        self._kind = None
        copy = kind is self.kinds[True]
        for other in self.kinds.values():
            other.since_ask += committed
        if not asked:
            self.off_ms.add(ms / max(1, committed))
            return copy
        kind.tokens.add(committed)
        kind.on_ms.add(ms)
        kind.since_ask = 0
        kind.asking = self._pays(kind.tokens.value, kind.on_ms.value, HOLD if kind.asking else 1.0)
        kind.interval = PROBE_MIN if kind.asking else min(PROBE_MAX, 2 * kind.interval)
        return copy

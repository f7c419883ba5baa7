"""Per request and per round: whether asking the drafter pays. The controller's per-type state is a
prior, not a verdict: each request is judged on its own evidence, so unlabelled, mixed traffic gets
speculation where its text can be drafted and loses nothing where it cannot.

Where a copy is in sight (the request's context, prompt and committed tokens, indexed by bigram:
its last two tokens occurred before), an AUTO round does not ask: the verifier drafts the copy
itself as it decodes ahead (prompt lookup, docs/architecture.md#copies), the cheaper source. Where
none is, only the drafter (its head or model) can draft, and the gate weighs committed tokens per
millisecond of the rounds that asked against those of rounds without a copy that did not (the
verifier decoding on its own). Below 0.97 of that rate while asking, it stops asking, except now
and then (a probe: after 4 tokens, then 8, 16, then every 32). Forced requests ask every round.
Plain Python, no gRPC (docs/controller.md#per-request)."""

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
    `situations`: where the type's earlier requests asked with a copy in sight (True: forced
    requests) or without (False), what those rounds committed and took, (tokens, on_ms); an AUTO
    request asks only without one, and starts from False's."""

    tokens: float | None = None
    on_ms: float | None = None
    off_ms: float | None = None
    situations: dict[bool, tuple[float, float]] = field(default_factory=dict)


class Gate:
    """`extend(prompt)`, then `ask()` before a round and `record()` and `extend()` after it.
    `always`: a forced request (speculation ON) asks every round."""

    def __init__(self, prior: Prior = Prior(), always: bool = False):
        self.always = always
        self.off_ms = Ewma(DECAY)  # ms per token of rounds without a copy in sight that did not ask
        if prior.off_ms is not None:
            self.off_ms.add(prior.off_ms, PRIOR_ROUNDS)
        self.tokens, self.on_ms = Ewma(DECAY), Ewma(DECAY)  # of the rounds that asked without a copy in sight
        tokens, on_ms = prior.situations.get(False, (prior.tokens, prior.on_ms))
        if tokens is not None and on_ms is not None:
            self.tokens.add(tokens, PRIOR_ROUNDS)
            self.on_ms.add(on_ms, PRIOR_ROUNDS)
        self.asking = self._pays(self.tokens.value, self.on_ms.value)
        self.interval = PROBE_MIN
        self.since_ask = 0  # tokens since the drafter was last asked: off by the prior, it probes after PROBE_MIN
        self._context: list[int] = []  # the prompt and the committed tokens
        self._index = BigramIndex()
        self._copy: bool | None = None  # whether a copy was in sight as the round under way started

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
        self._copy = self.copyable
        if self.always:
            return True
        return not self._copy and (self.asking or self.since_ask >= self.interval)

    def off_run(self) -> int:
        """Tokens the verifier may decode on its own now, this round's own included (at least 1):
        until the drafter is due a probe, at least PROBE_MIN (copies meanwhile are the verifier's own
        prompt lookup's: while one is in sight and the drafter pays, the gateway looks again after
        PROBE_MIN tokens rather than after every token)."""
        if self.ask():
            return 1
        due = self.interval - self.since_ask
        return due if due > 0 else PROBE_MIN

    def record(self, asked: bool, committed: int, ms: float) -> bool:
        """A round's outcome: it asked the drafter or not, committed `committed` tokens in `ms` wall
        time (everything on its critical path). Returns whether a copy was in sight as it started.
        Call extend() with its tokens after."""
        copy = self._copy if self._copy is not None else self.copyable
        self._copy = None
        self.since_ask += committed
        if copy:  # the verifier's copies (or a forced request's ask): no evidence on asking without one
            return copy
        if not asked:
            self.off_ms.add(ms / max(1, committed))
            return copy
        self.tokens.add(committed)
        self.on_ms.add(ms)
        self.since_ask = 0
        self.asking = self._pays(self.tokens.value, self.on_ms.value, HOLD if self.asking else 1.0)
        self.interval = PROBE_MIN if self.asking else min(PROBE_MAX, 2 * self.interval)
        return copy

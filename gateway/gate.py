"""Per request and per round: whether asking the drafter pays. The controller's per-type state is a
prior, not a verdict: each request is judged on its own evidence, so unlabelled, mixed traffic gets
speculation where its text can be drafted and loses nothing where it cannot.

Rounds come in two situations, judged apart: a copy in sight (the request's context, prompt and
committed tokens, indexed by bigram: its last two tokens occurred before) or not. Where one is,
not asking is not idle: the verifier drafts the copy itself as it decodes ahead (prompt lookup,
docs/architecture.md#drafted-in-the-verifier), so asking must beat copying, which it rarely does with a cheap head
on a small target and often does with a draft model on a large one; a request starts there not
asking (the cheaper source) unless its type's earlier rounds say asking paid. Where none is, only
the drafter can draft, and not asking is the verifier decoding alone. In each, the gate weighs
committed tokens per millisecond of the rounds that asked against those that did not; below 0.97
of that rate while asking it stops asking, except now and then (a probe: after 4 tokens of that
situation, then 8, 16, then every 32). Forced requests ask every round. Plain Python, no gRPC
(docs/controller.md#per-request)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specsplit.speculation.ewma import Ewma
from specsplit.speculation.lookup import SequenceIndex

DECAY = 0.95  # per asked round: acceptance is noisy round to round (a geometric run); bursts are the copy signal's
PRIOR_ROUNDS = 4.0  # the type's prior counts as this many rounds of the request's own
HOLD = 0.97  # asking stops below this share of the rate without asking (an ask that finds nothing costs ~10 %)
ASK_COST = 1.25  # a round that asks, in rounds that do not, until one that does not is timed
# Tokens between probes of a kind of round that does not pay, doubled after each probe that lost: a
# failed ask costs about a third of a step here (chat: 12 asks in 128 tokens cost 4 %).
PROBE_MIN, PROBE_MAX = 4, 32


@dataclass(frozen=True)
class Prior:
    """What the request's type (or load bucket) knows: a round that asks commits `tokens` in
    `on_ms`; a round that does not commits one token in `off_ms`. None fields: unknown.
    By situation (a copy in sight: True), where earlier requests' rounds asked, what they committed
    and took, `situations[copy] = (tokens, on_ms)`, and ms per token of those that did not ask,
    `unasked[copy]`; without a copy in sight they fall back to the fields above."""

    tokens: float | None = None
    on_ms: float | None = None
    off_ms: float | None = None
    situations: dict[bool, tuple[float, float]] = field(default_factory=dict)
    unasked: dict[bool, float] = field(default_factory=dict)


class Situation:
    """One situation's rounds in a request: what asking earned against not asking, whether it asks,
    and when it probes."""

    def __init__(self, asked: tuple[float | None, float | None], off_ms: float | None, unknown_asks: bool):
        self.off_ms = Ewma(DECAY)  # ms per token of the rounds that did not ask
        if off_ms is not None:
            self.off_ms.add(off_ms, PRIOR_ROUNDS)
        self.tokens, self.on_ms = Ewma(DECAY), Ewma(DECAY)  # of the rounds that asked
        tokens, on_ms = asked
        known = tokens is not None and on_ms is not None
        if known:
            self.tokens.add(tokens, PRIOR_ROUNDS)
            self.on_ms.add(on_ms, PRIOR_ROUNDS)
        self.asking = self.pays() if known else unknown_asks
        self.interval = PROBE_MIN
        self.since_ask = 0  # tokens committed in this situation since it last asked

    def pays(self, share: float = 1.0) -> bool:
        """Whether its rounds that ask beat `share` of the rate of those that do not (nothing asked
        yet: yes; nothing unasked timed yet: ASK_COST of a round that asks)."""
        tokens, on_ms, off_ms = self.tokens.value, self.on_ms.value, self.off_ms.value
        if tokens is None or on_ms is None:
            return True
        return tokens / on_ms >= share / (off_ms if off_ms is not None else on_ms / ASK_COST)

    def due(self) -> bool:
        return self.asking or self.since_ask >= self.interval

    def record(self, asked: bool, committed: int, ms: float) -> None:
        self.since_ask += committed
        if not asked:
            self.off_ms.add(ms / max(1, committed))
            return
        self.tokens.add(committed)
        self.on_ms.add(ms)
        self.since_ask = 0
        self.asking = self.pays(HOLD if self.asking else 1.0)
        self.interval = PROBE_MIN if self.asking else min(PROBE_MAX, 2 * self.interval)


class Gate:
    """`extend(prompt)`, then `ask()` before a round and `record()` and `extend()` after it.
    `always`: a forced request (speculation ON) asks every round."""

    def __init__(self, prior: Prior = Prior(), always: bool = False):
        self.always = always
        self.situations = {
            False: Situation(prior.situations.get(False, (prior.tokens, prior.on_ms)),
                             prior.unasked.get(False, prior.off_ms), unknown_asks=True),
            True: Situation(prior.situations.get(True, (None, None)), prior.unasked.get(True), unknown_asks=False)}
        self._context: list[int] = []  # the prompt and the committed tokens
        self._index = SequenceIndex()
        self._copy: bool | None = None  # whether a copy was in sight as the round under way started

    def extend(self, tokens: list[int]) -> None:
        """The prompt, then each round's committed tokens, join the context."""
        self._context += tokens

    @property
    def copyable(self) -> bool:
        """The last two tokens occurred before in the context: a retrieval draft exists."""
        return bool(self._index.follows(self._context, 1))

    def ask(self) -> bool:
        self._copy = self.copyable
        return self.always or self.situations[self._copy].due()

    def off_run(self) -> int:
        """Tokens the verifier may decode on its own now, this round's own included (at least 1):
        until this situation's drafter is due a probe, at least PROBE_MIN; while the other
        situation asks, PROBE_MIN at most (a copy that ends, or one that starts, is where the
        gateway asks again; copies meanwhile are the verifier's own prompt lookup's)."""
        if self.ask():
            return 1
        here, other = self.situations[self._copy], self.situations[not self._copy]
        due = here.interval - here.since_ask
        run = due if due > 0 else PROBE_MIN
        return min(run, PROBE_MIN) if other.asking else run

    def record(self, asked: bool, committed: int, ms: float) -> bool:
        """A round's outcome: it asked the drafter or not, committed `committed` tokens in `ms` wall
        time (everything on its critical path). Returns whether a copy was in sight as it started.
        Call extend() with its tokens after."""
        copy = self._copy if self._copy is not None else self.copyable
        self._copy = None
        self.situations[copy].record(asked, committed, ms)
        return copy

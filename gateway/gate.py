"""Per request and per round: whether asking the drafter pays. The controller's per-type state is a
prior, not a verdict: each request is judged on its own rounds — committed tokens per millisecond of
the rounds that asked the drafter against those of the rounds that did not — so unlabelled, mixed
traffic gets speculation where its text can be drafted (a document to copy) and loses nothing where
it cannot. A request that stops asking probes now and then (a quoted span may start), and one probe
that pays on its own turns it back on. Plain Python, no gRPC (docs/controller.md#per-request)."""

from __future__ import annotations

from dataclasses import dataclass

from specsplit.spec.ewma import Ewma

DECAY = 0.9  # per asked round: acceptance is noisy round to round (a geometric run)
PRIOR_ROUNDS = 1.0  # the type's prior counts as this many rounds of the request's own
HOLD = 0.9  # asking stops below this share of the rate without asking: a few unlucky rounds are not a verdict
ASK_COST = 1.25  # a round that asks, in rounds that do not, until one that does not is timed
# Tokens between probes while off, doubled after each probe that lost. Asking is cheap beside what a
# missed copy costs (a failed ask adds part of a step; a missed one loses tokens), so probes stay frequent.
PROBE_MIN, PROBE_MAX = 4, 16


@dataclass(frozen=True)
class Prior:
    """What the request's type (or load bucket) knows: a round that asks commits `tokens` in
    `on_ms`; a round that does not commits one token in `off_ms`. None fields: unknown."""

    tokens: float | None = None
    on_ms: float | None = None
    off_ms: float | None = None


class Gate:
    """`ask()` before a round, `record()` after it. `always`: a forced request (speculation ON)."""

    def __init__(self, prior: Prior = Prior(), always: bool = False):
        self.always = always
        self.tokens, self.on_ms, self.off_ms = Ewma(DECAY), Ewma(DECAY), Ewma(DECAY)
        if prior.tokens is not None and prior.on_ms is not None:
            self.tokens.add(prior.tokens, PRIOR_ROUNDS)
            self.on_ms.add(prior.on_ms, PRIOR_ROUNDS)
        if prior.off_ms is not None:
            self.off_ms.add(prior.off_ms, PRIOR_ROUNDS)
        self.asking = self._pays(self.tokens.value, self.on_ms.value, 1.0)
        self.interval = PROBE_MIN
        self.since_ask = PROBE_MIN  # tokens committed since the last ask: a request off by its prior probes first
        self.asked = self.skipped = 0  # rounds

    def _pays(self, tokens: float | None, on_ms: float | None, share: float) -> bool:
        """Whether rounds that ask, committing `tokens` in `on_ms`, beat `share` of the rate of rounds
        that do not (unknown: yes; no round without asking timed yet: ASK_COST of one that asks)."""
        if tokens is None or on_ms is None:
            return True
        off_ms = self.off_ms.value
        return tokens / on_ms >= share / (off_ms if off_ms is not None else on_ms / ASK_COST)

    def ask(self) -> bool:
        return self.always or self.asking or self.since_ask >= self.interval

    def off_run(self) -> int:
        """Rounds that will not ask before the next probe, this one included (at least 1): how many
        tokens the verifier may decode on its own now."""
        if self.ask():
            return 1
        return self.interval - self.since_ask

    def record(self, asked: bool, committed: int, ms: float) -> None:
        """A round's outcome: it asked the drafter or not, committed `committed` tokens in `ms` wall
        time (everything on its critical path)."""
        if not asked:
            self.skipped += 1
            self.off_ms.add(ms / max(1, committed))
            self.since_ask += committed
            return
        self.asked += 1
        self.tokens.add(committed)
        self.on_ms.add(ms)
        self.since_ask = 0
        if self.asking:
            self.asking = self._pays(self.tokens.value, self.on_ms.value, HOLD)
        else:  # a probe: back on if it paid on its own, else probe half as often
            self.asking = self._pays(committed, ms, 1.0)
        self.interval = PROBE_MIN if self.asking else min(PROBE_MAX, 2 * self.interval)

"""What the controller knows about one (task type, drafter): decayed means of acceptance, draft,
verify and network cost, requests' ms per token on and off (alone and per load bucket), the
situations the gate asked in, and what it decides from them (gamma, the gain at a load, whether
pre-drafting pays). gateway.controller keeps one per pair and decides per request
(docs/controller.md)."""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Sequence

from specsplit.serving.settings import ControllerSettings
from specsplit.speculation.ewma import Ewma
from specsplit.speculation.tokentree import score_scale, verify_ms

log = logging.getLogger("specsplit")


class Arms:
    """A choice between two ways of serving a type's requests (pre-drafting or not; which drafter),
    made by measurement: each arm keeps the decode ms per token of the requests it served (the last
    `window`). They take turns until each has min_requests (or EARLY each whose times do not overlap:
    every request of one arm faster than every request of the other, which two equal arms do by
    chance one time in ten at 3 + 3; exploring the loser costs traffic), then the one with the lower
    median runs (the first on a tie) and the other every probe_every-th time, so a change (load,
    network, the text) is noticed. `cheaper`: the arm whose turn comes first, and that runs unless
    the other's median is lower by more than `margin` (a share of it): between different prompts'
    requests a few per cent is noise, and the cheaper way (n-gram alone: no draft session, no
    features) should not lose to it.
    A `prior` (the same choice over every type) decides for a type that has not measured both arms
    yet, once it has itself."""

    EARLY = 3

    def __init__(self, settings: ControllerSettings, first, second, cheaper=None, margin: float = 0.0):
        self.settings = settings
        self.times = {arm: deque(maxlen=settings.window) for arm in (first, second)}
        self.turns = 0
        self.cheaper, self.margin = cheaper, margin

    @property
    def decided(self) -> bool:
        a, b = self.times.values()
        if min(len(a), len(b)) >= self.settings.min_requests:
            return True
        return min(len(a), len(b)) >= self.EARLY and (max(a) < min(b) or max(b) < min(a))

    def choose(self, prior: Arms | None = None):
        s = self.settings
        (first, a), (second, b) = self.times.items()
        if not self.decided:
            if prior is not None and prior.decided:
                return prior.choose()
            if len(a) == len(b) and self.cheaper is not None:
                return self.cheaper  # turns start with the cheaper way
            return first if len(a) <= len(b) else second
        median = {first: statistics.median(a), second: statistics.median(b)}
        better, other = (first, second) if median[first] <= median[second] else (second, first)
        if other == self.cheaper and median[better] > (1 - self.margin) * median[other]:
            better, other = other, better  # within the margin: the cheaper way
        self.turns += 1
        return better if self.turns % s.probe_every else other

    def add(self, arm, ms_per_token: float) -> None:
        if arm in self.times:
            self.times[arm].append(ms_per_token)


def load_bucket(clients: int) -> int:
    """Concurrency levels judged together: 1, 2, 3-4, 5-8, 9-16, ... (the next power of two)."""
    return 1 if clients <= 1 else 1 << (clients - 1).bit_length()


SHIFT = 1.6  # the last SHIFT_RECENT requests' median ms per token this far from the earlier ones': rebase
SHIFT_RECENT = 3
REBASE_CONTROL = 5  # after a rebase, one AUTO request in this many is a control until the baseline is back


def shift(times, min_requests: int) -> float | None:
    """How far the latest requests' ms per token moved from the earlier ones' (the ratio of
    medians) when beyond SHIFT either way: a slower or faster machine (one request in
    SHIFT_RECENT could be a long prompt; all of them are not); else None."""
    if len(times) < min_requests + SHIFT_RECENT:
        return None
    values = list(times)
    ratio = statistics.median(values[-SHIFT_RECENT:]) / statistics.median(values[:-SHIFT_RECENT])
    return ratio if ratio > SHIFT or ratio * SHIFT < 1 else None


def expected_length(alpha: float, gamma: int) -> float:
    """Tokens per round when each draft token is accepted with probability alpha (independently):
    1 + alpha + ... + alpha^gamma."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


class TypeState:
    """What the controller knows about one (task type, drafter)."""

    def __init__(self, settings: ControllerSettings):
        d = settings.decay
        self.settings = settings
        self.enabled, self.gamma, self.reason = True, settings.gamma_start, "starting"
        self.accepted = Ewma(d)  # draft tokens accepted per round that drafted
        self.rejected = Ewma(d)  # rounds that ended in a rejection (accepted < drafted)
        self.tokens_per_round = Ewma(d)  # committed per spec-on round: the mean acceptance length
        self.draft_ms_per_token = Ewma(d)
        self.network_on, self.network_off = Ewma(d), Ewma(d)  # per round, spec-on / spec-off
        self.verify_ms: dict[int, Ewma] = {}  # drafted k -> verify compute
        self.on_ms_per_token: deque[float] = deque(maxlen=settings.window)  # per request
        self.off_ms_per_token: deque[float] = deque(maxlen=settings.window)
        self.since_change = 0  # judged requests since the state last changed
        self.auto_requests = 0  # AUTO requests decided alone (the control share counts them)
        self.history: list[tuple[int, bool, str]] = []  # (request number, enabled, reason)
        self.rebasing, self.rebases = False, 0  # times forgotten after the machine changed speed (rebase)
        # Pre-drafting, an A/B within speculation, on spec-on requests.
        self.predraft_arms = Arms(settings, False, True)
        # Token trees: accepted drafts per round and what the drafter's scores expected.
        self.tree_accepted, self.tree_expected = Ewma(d), Ewma(d)
        # Per spec-on round: the rows it verifies and its drafting on the critical path.
        self.rows_on, self.draft_round_ms = Ewma(d), Ewma(d)
        # Rounds of AUTO requests that asked the drafter, by situation (a copy in sight or not): tokens
        # committed and wall time per round, the gate's own measure (gateway.gate)
        self.asked = {copy: (Ewma(d), Ewma(d)) for copy in (True, False)}
        # and wall time per token of rounds that did not ask, by situation (spec-off's: no copy)
        self.unasked = {copy: Ewma(d) for copy in (True, False)}
        # With others in flight: per load bucket, decode ms per token of spec-on and spec-off
        # requests that ran at that concurrency, and the bucket's decisions so far.
        self.loaded: dict[int, tuple[deque[float], deque[float]]] = {}
        self.load_turns: dict[int, int] = {}

    def under_load(self, clients: int, cost_curve: Sequence[float]) -> bool:
        """Whether to speculate with `clients` requests in flight: as measured at this load once
        both modes have enough requests there (median ms per token), else as predicted (gain_at;
        speculate until anything is known)."""
        s = self.settings
        on, off = self.loaded.get(load_bucket(clients), ((), ()))
        need = max(3, s.min_requests // 2)
        if len(on) >= need and len(off) >= need:
            return statistics.median(on) < statistics.median(off)
        gain = self.gain_at(clients, cost_curve)
        return gain is None or gain >= 1.0

    @property
    def score_scale(self) -> float:
        """How far a drafter's scores can be trusted (speculation.tokentree.score_scale), which the gateway
        applies before it cuts a tree by expected gain."""
        return score_scale(self.tree_accepted.value, self.tree_expected.value)

    def predraft(self) -> bool:
        """Whether the next spec-on request pre-drafts (Arms: measured against not)."""
        return self.predraft_arms.choose()

    # -- estimates -----------------------------------------------------------------------------
    @property
    def alpha(self) -> float | None:
        """Per-token acceptance probability (geometric model): accepted / (accepted + rejections)."""
        a, r = self.accepted.value, self.rejected.value
        if a is None or r is None or a + r <= 0:
            return None
        return a / (a + r)

    def verify_cost(self, k: int) -> float | None:
        """Verify compute for k drafts: measured, else a line through the measured points."""
        known = {n: e.value for n, e in self.verify_ms.items() if e.value is not None}
        if k in known:
            return known[k]
        if len(known) >= 2:
            xs, ys = zip(*sorted(known.items()))
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            var = sum((x - mx) ** 2 for x in xs)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
            return my + max(0.0, slope) * (k - mx)
        if known:
            return next(iter(known.values()))  # one point: assume flat (memory-bound verification)
        return None

    def time_per_token(self, gamma: int) -> float | None:
        """Expected spec-on ms per committed token with this gamma."""
        alpha, draft = self.alpha, self.draft_ms_per_token.value
        verify = self.verify_cost(gamma)
        if alpha is None or draft is None or verify is None:
            return None
        per_round = verify + gamma * draft + (self.network_on.value or 0.0)
        return per_round / expected_length(alpha, gamma)

    def asking_pays(self) -> bool | None:
        """Whether rounds that asked the drafter with no copy in sight committed tokens faster than
        rounds that did not (the verifier decoding alone, spec-off's rounds too), in the gate's units;
        None: not both measured."""
        (tokens, ms), alone = self.asked[False], self.unasked[False].value
        if tokens.value is None or ms.value is None or alone is None:
            return None
        return tokens.value / ms.value >= 1.0 / alone

    def off_time_per_token(self) -> float | None:
        verify = self.verify_cost(0)
        return None if verify is None else verify + (self.network_off.value or 0.0)

    def best_gamma(self) -> int:
        s = self.settings
        costs = {g: self.time_per_token(g) for g in range(s.gamma_min, s.gamma_max + 1)}
        if any(c is None for c in costs.values()):
            return self.gamma
        return min(costs, key=lambda g: (costs[g], g))

    def gain_at(self, clients: int, cost_curve: Sequence[float]) -> float | None:
        """Predicted spec-on over spec-off tokens/s per request when `clients` requests of this kind
        share the verifier's forwards (a batching verifier): spec-off rounds batch `clients` rows,
        spec-on rounds `clients` times this type's rows per round, priced by the verifier's measured
        cost per batch width. None until a spec-on round was measured."""
        tokens, rows, draft = self.tokens_per_round.value, self.rows_on.value, self.draft_round_ms.value
        if not cost_curve or tokens is None or rows is None or draft is None:
            return None
        on = verify_ms(cost_curve, max(1, round(clients * rows))) + draft + (self.network_on.value or 0.0)
        off = verify_ms(cost_curve, clients) + (self.network_off.value or 0.0)
        return tokens * off / on

    def rebase(self, why: str) -> None:
        """The machine changed speed (a busy neighbour came or went): times measured before say
        nothing of now, and comparing fresh spec-on times with an old spec-off baseline (controls are
        one request in 20) would judge the neighbour, not speculation. Forget every time, keep what
        the drafter earns (acceptance), and judge again on fresh runs of both (one AUTO request in
        REBASE_CONTROL a control until the baseline is back)."""
        log.info("controller: %s; measuring spec-on and spec-off afresh", why)
        self.on_ms_per_token.clear()
        self.off_ms_per_token.clear()
        self.verify_ms.clear()
        d = self.settings.decay
        self.draft_ms_per_token, self.network_on, self.network_off = Ewma(d), Ewma(d), Ewma(d)
        self.asked = {copy: (Ewma(d), Ewma(d)) for copy in (True, False)}
        self.unasked = {copy: Ewma(d) for copy in (True, False)}
        self.since_change, self.rebasing = 0, True
        self.rebases += 1

    def threshold(self) -> float | None:
        """The acceptance length below which speculation is switched off."""
        if self.settings.min_acceptance > 0:
            return self.settings.min_acceptance
        off, verify, draft = self.off_time_per_token(), self.verify_cost(self.gamma), self.draft_ms_per_token.value
        if off is None or verify is None or draft is None:
            return None
        on_round = verify + self.gamma * draft + (self.network_on.value or 0.0)
        return self.settings.margin * on_round / off  # tokens a round must commit to pay for itself

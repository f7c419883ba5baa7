"""When to speculate and how far: live statistics per (task type, drafter), gamma chosen for the
most tokens per unit time, speculation switched off per task type when it loses (with hysteresis and
periodic re-probing), off under high concurrency, and a small spec-off control share that keeps the
baseline measured. Plain Python, no gRPC: the gateway feeds it each request's stats and asks it per
request (docs/controller.md)."""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.gate import Prior
from gateway.typestate import REBASE_CONTROL, Arms, TypeState, load_bucket, shift
from specsplit.serving.settings import ControllerSettings
from specsplit.speculation.ewma import Ewma
from specsplit.speculation.tokentree import verify_ms

log = logging.getLogger("specsplit")

AUTO, ON, OFF = "auto", "on", "off"  # a request's speculation mode
LOAD_PROBE_FACTOR = 4  # under load, one decision in probe_every x this runs the other mode
# The service's default drafter runs instead of n-gram alone only when its requests' median decode
# time per token (in one-row forwards) is this much lower: different prompts' requests differ by
# tens of per cent, and n-gram alone needs no draft service.
DRAFTER_MARGIN = 0.1


@dataclass(frozen=True)
class RoundFacts:
    drafted: int
    accepted: int
    draft_ms: float
    verify_ms: float
    network_ms: float
    depth: int = 0  # a token tree's longest path; 0: a chain (its depth is drafted)
    expected: float = 0.0  # the drafter's estimate of accepted drafts (sum of scores); 0: unscored
    decoded: int = 0  # a round without a draft that decoded ahead: its times cover 1 + decoded tokens
    round_ms: float = 0.0  # its wall time on the gateway, everything on its critical path
    asked: bool = False  # it asked the drafter
    copy: bool = False  # a copy was in sight as it started (gateway.gate)


@dataclass(frozen=True)
class Outcome:
    """What a finished request tells the controller."""

    rounds: Sequence[RoundFacts]
    generated_tokens: int
    decode_ms: float
    speculation_used: bool
    forward_ms: float = 0.0  # the verifier's compute per forward after prefill, mean (0: unknown)
    forward_rows: float = 1.0  # rows per such forward, mean (drafts widen them)


def in_forwards(per_token: float, stats: Outcome, curve: Sequence[float]) -> float:
    """A request's decode ms per token in one-row forwards at its own context: its forwards' mean
    compute, less what their extra rows cost by the verifier's curve, is what a spec-off step of it
    costs. How the drafter and pre-drafting arms compare requests of different prompts: a long
    document's forwards cost more whichever arm serves it, and in unlabelled mixed traffic each arm
    gets a different few of them. (per_token itself where the forward or the curve is unknown.)"""
    if stats.forward_ms <= 0 or not curve or curve[0] <= 0:
        return per_token
    low = max(1, int(stats.forward_rows))
    part = stats.forward_rows - low
    width = ((1 - part) * verify_ms(curve, low) + part * verify_ms(curve, low + 1)) / curve[0]
    return per_token * width / stats.forward_ms


def p95(values) -> float:
    """Nearest-rank 95th percentile (the controller's and the bench's)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


@dataclass(frozen=True)
class Decision:
    speculate: bool
    gamma: int
    reason: str  # forced | controller-off | concurrency | control | disabled | probe | on
    clients: int = 1  # requests in flight when it was made, this one included


class Controller:
    def __init__(self, settings: ControllerSettings = ControllerSettings()):
        settings.check()
        self.settings = settings
        self._types: dict[tuple[str, str], TypeState] = {}
        self.requests = 0
        self.cost_curve: list[float] = []  # the verifier's forward ms by rows (InfoResponse.forward_ms_by_rows)
        # Per task type, the drafters an AUTO request naming none may get, measured on lone,
        # speculating requests.
        self._drafter_arms: dict[str, Arms] = {}
        self._drafter_all: Arms | None = None  # the same choice over every type: a new type's start

    def state(self, task_type: str, drafter: str) -> TypeState:
        key = (task_type or "unspecified", drafter)
        if key not in self._types:
            self._types[key] = TypeState(self.settings)
        return self._types[key]

    def states(self) -> dict[tuple[str, str], TypeState]:
        return dict(self._types)

    def seed_policy(self, task_type: str, drafter: str, speculate: bool, gamma: int) -> None:
        """Start from a calibrated policy instead of the defaults."""
        st = self.state(task_type, drafter)
        st.enabled, st.reason = speculate, "policy"
        st.gamma = min(max(gamma, self.settings.gamma_min), self.settings.gamma_max)

    def decide(self, task_type: str, drafter: str, mode: str, requested_gamma: int, inflight: int) -> Decision:
        """mode: AUTO, ON or OFF (the request's). requested_gamma 0: the controller's choice.
        inflight: the other requests in flight now."""
        s = self.settings
        st = self.state(task_type, drafter)
        clients = inflight + 1
        if mode == OFF:
            return Decision(False, 0, "forced", clients)
        if mode == ON:
            return Decision(True, requested_gamma or st.gamma, "forced", clients)
        if not s.enabled:
            return Decision(True, requested_gamma or s.gamma_start, "controller-off", clients)
        self.requests += 1
        if s.max_inflight and inflight > s.max_inflight:
            return Decision(False, 0, "concurrency", clients)
        gamma = requested_gamma or st.gamma
        if clients > 1:  # judged at this load, not by the single-stream state below
            bucket = load_bucket(clients)
            turn = st.load_turns[bucket] = st.load_turns.get(bucket, 0) + 1
            speculate = st.under_load(clients, self.cost_curve)
            # The other mode now and then, so that both stay measured; rarer than a lone request's
            # probe: under load a spec-on request slows every session it shares forwards with.
            if turn % (LOAD_PROBE_FACTOR * s.probe_every) == 0:
                return Decision(not speculate, gamma if not speculate else 0,
                                "probe" if not speculate else "control", clients)
            return Decision(True, gamma, "on", clients) if speculate else Decision(False, 0, "concurrency", clients)
        # The type's verdict is a prior, not a verdict: a request of a type that lost starts
        # without drafts and its own probes decide (gateway.gate).
        speculating = Decision(True, gamma, "on" if st.enabled else "disabled", clients)
        st.auto_requests += 1
        st.rebasing = st.rebasing and len(st.off_ms_per_token) < s.min_requests
        if st.rebasing:  # a fresh baseline, beside fresh spec-on runs
            return Decision(False, 0, "control", clients) if st.auto_requests % REBASE_CONTROL == 0 else speculating
        if s.control_share > 0 and st.auto_requests % max(1, round(1 / s.control_share)) == 0:
            return Decision(False, 0, "control", clients)  # every n-th request: deterministic, spread evenly
        return speculating

    def predraft(self, task_type: str, drafter: str) -> bool:
        return self.state(task_type, drafter).predraft()

    def prior(self, task_type: str, drafter: str, decision: Decision) -> Prior | None:
        """The gate's start for an AUTO request that speculates (None: a forced request asks every
        round): what its type measured on lone requests."""
        if decision.reason in ("forced", "controller-off"):
            return None
        st = self.state(task_type, drafter)
        tokens, rows, draft = st.tokens_per_round.value, st.rows_on.value, st.draft_round_ms.value
        verify = st.verify_cost(round(rows) - 1) if rows is not None else None
        on_ms = None if verify is None or draft is None else verify + draft + (st.network_on.value or 0.0)
        off_ms = st.off_time_per_token() or (self.cost_curve[0] if self.cost_curve else None)
        situations = {copy: (t.value, ms.value) for copy, (t, ms) in st.asked.items() if t.value is not None}
        unasked = {copy: ms.value for copy, ms in st.unasked.items() if ms.value is not None}
        if situations and False in unasked:  # the gate's own units: wall time, both sides
            return Prior(tokens, on_ms, unasked[False], situations, unasked)
        # Else rounds without a copy start from the cost model's units on both sides (not its
        # modelled asking against a timed wall); copying's wall time starts the other situation.
        return Prior(tokens, on_ms, off_ms, {}, {True: unasked[True]} if True in unasked else {})

    def drafter(self, task_type: str, default: str, cheaper: str) -> str:
        """The drafter of an AUTO request that names none: the draft service's default or a cheaper
        one (n-gram alone: no head, no features), whichever the type's requests decoded faster with.
        (Arms: they take turns, then the faster runs and the other every probe_every-th request; a
        type that has not timed both yet follows what all types' requests decided, once they have:
        which drafter pays depends on the target and the machine as much as on the text.) Where the
        type's rounds that asked the default's drafter with no copy in sight beat those that did not,
        n-gram alone cannot win (there its rounds are the verifier alone; its copies are the
        default's too): the default runs, and no request is spent finding that out."""
        if self.state(task_type, default).asking_pays():
            return default
        key = task_type or "unspecified"
        arms = self._drafter_arms.get(key)
        if arms is None:
            arms = self._drafter_arms[key] = Arms(self.settings, default, cheaper, cheaper, DRAFTER_MARGIN)
        if self._drafter_all is None:
            self._drafter_all = Arms(self.settings, default, cheaper, cheaper, DRAFTER_MARGIN)
        return arms.choose(self._drafter_all)

    def score_scale(self, task_type: str, drafter: str) -> float:
        return self.state(task_type, drafter).score_scale

    def observe(self, task_type: str, drafter: str, decision: Decision, stats: Outcome,
                predraft: bool = False) -> None:
        """Learns from a finished request (`predraft`: whether it pre-drafted) and re-evaluates its
        task type."""
        st = self.state(task_type, drafter)
        alone = decision.clients <= 1  # timings under load (batched forwards) say nothing of a lone request
        for r in stats.rounds:
            if alone and r.round_ms > 0:
                if r.asked:
                    tokens, ms = st.asked[r.copy]
                    tokens.add(r.accepted + 1 + r.decoded)
                    ms.add(r.round_ms)
                else:
                    st.unasked[r.copy].add(r.round_ms / (1 + r.accepted + r.decoded))
            if r.drafted:
                st.accepted.add(r.accepted)
                st.rejected.add(1.0 if r.accepted < (r.depth or r.drafted) else 0.0)
                st.tokens_per_round.add(r.accepted + 1)
                st.rows_on.add(1 + r.drafted)
                if alone:
                    st.draft_ms_per_token.add(r.draft_ms / r.drafted)
                    st.network_on.add(r.network_ms)
                    st.draft_round_ms.add(r.draft_ms)
            elif alone:
                st.network_off.add(r.network_ms / (1 + r.decoded))
            if alone:  # per forward: a decode-ahead's forwards are 1-row steps
                st.verify_ms.setdefault(r.drafted, Ewma(self.settings.decay)).add(r.verify_ms / (1 + r.decoded))
            if r.expected > 0:
                st.tree_accepted.add(r.accepted)
                st.tree_expected.add(r.expected)
        if stats.generated_tokens <= 1:
            return
        # Decode time per token: prefill depends on the prompt's length, not on speculation, and
        # would make the comparison one of prompt mixes rather than of on vs off.
        per_token = stats.decode_ms / (stats.generated_tokens - 1)
        if not alone:
            window = self.settings.window
            on, off = st.loaded.setdefault(load_bucket(decision.clients), (deque(maxlen=window), deque(maxlen=window)))
            (on if stats.speculation_used else off).append(per_token)
            return
        times = st.on_ms_per_token if stats.speculation_used else st.off_ms_per_token
        times.append(per_token)
        relative = in_forwards(per_token, stats, self.cost_curve)
        arms = self._drafter_arms.get(task_type or "unspecified")
        if arms is not None and decision.reason in ("on", "disabled"):  # an AUTO request that could draft
            arms.add(drafter, relative)
            self._drafter_all.add(drafter, relative)
        moved = shift(times, self.settings.min_requests)
        if moved is not None:
            st.rebase(f"{'spec-on' if stats.speculation_used else 'spec-off'} ms per token moved {moved:.2f}x")
            return
        if stats.speculation_used:
            st.predraft_arms.add(predraft, relative)
        if decision.reason in ("on", "probe", "disabled", "control"):
            self._evaluate(st)

    def _evaluate(self, st: TypeState) -> None:
        s = self.settings
        st.since_change += 1
        if len(st.on_ms_per_token) < s.min_requests:
            return
        acceptance = st.tokens_per_round.value or 1.0
        threshold = st.threshold()
        enough_off = len(st.off_ms_per_token) >= s.min_requests
        on95 = p95(st.on_ms_per_token)
        off95 = p95(st.off_ms_per_token) if enough_off else None
        if st.enabled:
            best = st.best_gamma()
            now, then = st.time_per_token(best), st.time_per_token(st.gamma)
            if now is not None and then is not None and now < (1 - s.gamma_gain) * then:
                st.gamma = best  # only for a real gain: noise in the estimates must not move gamma
            if st.since_change < s.min_requests:
                return  # dwell: a new state is judged on fresh requests only
            if threshold is not None and acceptance < threshold:
                self._switch(st, False, f"acceptance length {acceptance:.2f} < {threshold:.2f}")
            elif off95 is not None and on95 > off95:
                self._switch(st, False, f"P95 {on95:.1f} ms/token with speculation > {off95:.1f} without")
        else:
            recent_on = list(st.on_ms_per_token)[-s.min_requests:]
            if (threshold is None or acceptance >= threshold + 0.1) and off95 is not None \
                    and p95(recent_on) <= off95 * (1 - s.hysteresis):
                self._switch(st, True, f"recovered: acceptance length {acceptance:.2f}, "
                                       f"P95 {p95(recent_on):.1f} <= {off95:.1f} ms/token")

    def _switch(self, st: TypeState, enabled: bool, reason: str) -> None:
        st.enabled, st.reason, st.since_change = enabled, reason, 0
        st.history.append((self.requests, enabled, reason))
        # The new state is judged on requests made in it alone (probes while off, then fresh runs).
        st.on_ms_per_token.clear()

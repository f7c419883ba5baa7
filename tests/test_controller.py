"""The controller driven by recorded statistics: requests simulated from a cost model (verify cost
per drafted token, draft cost, network per round, per-token acceptance probability) with noise."""

from __future__ import annotations

import random
from typing import NamedTuple

from gateway.controller import AUTO, OFF, ON, Controller, Decision, in_forwards
from gateway.gate import Gate, Prior
from gateway.instruments import outcome
from gateway.typestate import Arms, expected_length
from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.serving.settings import ControllerSettings


class Workload:
    """Target step 50 ms, +1.5 ms per drafted token to verify, 3 ms to draft a token, 4 ms of network
    per round: the orders of magnitude measured on the default model (docs/metrics.md)."""

    def __init__(self, alpha: float, noise: float = 0.1, seed: int = 0, tokens: int = 64, slow: float = 1.0,
                 draft_slow: float = 1.0):
        """slow, draft_slow: every time, and drafting's on top, that many times longer (a busy neighbour)."""
        self.alpha, self.noise, self.tokens, self.slow, self.draft_slow = alpha, noise, tokens, slow, draft_slow
        self.rng = random.Random(seed)

    def _jitter(self, ms: float) -> float:
        return self.slow * ms * (1 + self.rng.uniform(-self.noise, self.noise))

    def run(self, speculate: bool, gamma: int, gate: Gate | None = None) -> pb.GenerationStats:
        """`gate`: the request's (gateway.gate), asked before each round; None: every round drafts."""
        rounds, generated, total = [], 1, 60.0 * self.slow  # prefill
        for _ in range(self.tokens):  # a round commits at least one token
            if generated >= self.tokens:
                break
            asked = speculate and (gate is None or gate.ask())
            drafted = min(gamma, self.tokens - generated - 1) if asked else 0
            # geometric acceptance: each draft accepted with probability alpha until one is not
            accepted = next((i for i in range(drafted) if self.rng.random() >= self.alpha), drafted)
            record = pb.RoundRecord(drafted=drafted, accepted=accepted,
                                    draft_ms=self._jitter(3.0 * drafted * self.draft_slow),
                                    verify_ms=self._jitter(50 + 1.5 * drafted),
                                    network_ms=self._jitter(4.0 if drafted else 1.6))
            rounds.append(record)
            total += record.draft_ms + record.verify_ms + record.network_ms
            generated += accepted + 1
            if gate is not None and speculate:
                gate.record(asked, accepted + 1, record.draft_ms + record.verify_ms + record.network_ms)
        return pb.GenerationStats(generated_tokens=generated, total_ms=total, decode_ms=total - 60.0 * self.slow,
                                  round_records=rounds,
                                  rounds=len(rounds), speculation_used=speculate)


def serve(controller: Controller, workload: Workload, requests: int, task: str = "code") -> list:
    """AUTO requests decided by the controller, each run through its gate as the gateway runs it;
    every decision gets `drafted`: the share of its rounds that drafted."""
    decisions = []
    for _ in range(requests):
        d = controller.decide(task, "hybrid", AUTO, 0, inflight=0)
        prior = controller.prior(task, "hybrid", d) if d.speculate else None
        stats = workload.run(d.speculate, d.gamma, Gate(prior or Prior(), always=prior is None))
        controller.observe(task, "hybrid", d, outcome(stats))
        decisions.append(Served(d, sum(1 for r in stats.round_records if r.drafted) / len(stats.round_records),
                                stats.decode_ms / (stats.generated_tokens - 1)))
    return decisions


class Served(NamedTuple):
    decision: Decision
    drafted: float
    ms_per_token: float

    def __getattr__(self, name):
        return getattr(self.decision, name)


def test_gamma_follows_acceptance():
    c = Controller(ControllerSettings(control_share=0.1))
    serve(c, Workload(alpha=0.9), 60)
    high = c.state("code", "hybrid").gamma
    serve(c, Workload(alpha=0.45, seed=1), 150)
    low = c.state("code", "hybrid").gamma
    assert high >= 6 and low <= 3 and c.state("code", "hybrid").enabled, (high, low)
    # The choice is the cost model's optimum: check it against brute force at the final estimates.
    st = c.state("code", "hybrid")
    assert abs(st.alpha - 0.45) < 0.1
    best = min(range(1, 9), key=lambda g: (50 + 1.5 * g + 3 * g + 4) / expected_length(st.alpha, g))
    assert abs(low - best) <= 1


def test_switches_off_when_it_loses_and_back_on_when_it_pays_again():
    c = Controller(ControllerSettings(control_share=0.1))
    serve(c, Workload(alpha=0.05), 60)  # drafts almost never accepted: slower than off
    st = c.state("code", "hybrid")
    assert not st.enabled and st.history[0][1] is False
    assert "acceptance length" in st.reason or "P95" in st.reason
    off_reqs = serve(c, Workload(alpha=0.05, seed=3), 40)
    # The type's verdict is not each request's: each is judged on its own rounds, and its gate keeps
    # it at spec-off's pace where drafts are never right (its probes cost a little).
    assert {d.reason for d in off_reqs} <= {"disabled", "control"}
    assert sum(d.drafted for d in off_reqs) / len(off_reqs) < 0.2, [d.drafted for d in off_reqs]
    off = sum(Workload(alpha=0.05, seed=8).run(False, 0).decode_ms / 63 for _ in range(20)) / 20
    gated = [d.ms_per_token for d in off_reqs if d.reason == "disabled"]
    assert sum(gated) / len(gated) < 1.05 * off, (sum(gated) / len(gated), off)
    assert not st.enabled
    back = serve(c, Workload(alpha=0.85, seed=4), 150)  # the drafter got good again (e.g. new traffic)
    assert st.enabled and st.history[-1][1] is True and "recovered" in st.history[-1][2]
    assert sum(d.drafted > 0.9 for d in back[-30:]) >= 25  # drafting again, apart from the control share


def test_never_flaps_under_noise():
    for alpha, seed in ((0.75, 5), (0.05, 6)):  # clearly winning, clearly losing, 25 % timing noise
        c = Controller(ControllerSettings(control_share=0.1))
        decisions = serve(c, Workload(alpha=alpha, noise=0.25, seed=seed), 300)
        assert len(c.state("code", "hybrid").history) <= 1, c.state("code", "hybrid").history
        gammas = [d.gamma for d in decisions[100:] if d.speculate]  # after learning, gamma holds still
        # at most 3 changes in 200 requests, within 2 of each other: the cost per token is flat near the
        # optimum, and the gates' skipped rounds thin the estimates
        assert sum(a != b for a, b in zip(gammas, gammas[1:])) <= 3, gammas
        assert max(gammas) - min(gammas) <= 2, gammas


def test_forced_modes_concurrency_and_task_types_are_separate():
    c = Controller(ControllerSettings(max_inflight=4))
    serve(c, Workload(alpha=0.05), 60, task="creative")
    assert not c.state("creative", "hybrid").enabled and c.state("code", "hybrid").enabled
    assert c.decide("creative", "hybrid", ON, 0, 1).speculate  # the request's own choice wins (A/B)
    assert not c.decide("code", "hybrid", OFF, 0, 1).speculate
    assert c.decide("code", "hybrid", AUTO, 0, inflight=5).reason == "concurrency"
    assert c.decide("code", "hybrid", AUTO, 3, inflight=1).gamma in (0, 3)  # a requested gamma is kept


class PredraftWorkload(Workload):
    """Pre-drafting hides the Propose (draft + network) of a round on a hit; every pre-drafting round
    pays `extra` ms (the guess drafted on the critical path, CPU contention when co-located)."""

    def __init__(self, alpha: float, network_ms: float, extra_ms: float, seed: int = 0):
        super().__init__(alpha, seed=seed)
        self.network_ms, self.extra_ms = network_ms, extra_ms

    def run_arm(self, gamma: int, predraft: bool) -> pb.GenerationStats:
        stats = self.run(True, gamma)
        total, hit_before = 0.0, False
        for r in stats.round_records:
            r.network_ms = self._jitter(self.network_ms)
            ms = r.verify_ms + (0.0 if hit_before else r.draft_ms + r.network_ms)
            if predraft:
                ms += self.extra_ms
                r.predrafted = hit_before
                hit_before = r.accepted == r.drafted and self.rng.random() < self.alpha  # the guess too
            total += ms
        stats.decode_ms = total
        return stats


def test_predrafting_is_kept_where_it_pays_and_dropped_where_it_does_not():
    # Split (20 ms RTT to the drafter, little extra cost): hiding Proposes wins. Co-located on few
    # cores (4 ms network, drafting alongside the verifier slows it by 8 ms a round): it loses.
    for network, extra, wins in ((20.0, 1.0, True), (4.0, 8.0, False)):
        c = Controller(ControllerSettings(control_share=0.0))
        work = PredraftWorkload(alpha=0.8, network_ms=network, extra_ms=extra, seed=7)
        arms = []
        for _ in range(120):
            d = c.decide("code", "hybrid", AUTO, 0, inflight=0)
            arm = c.predraft("code", "hybrid")
            c.observe("code", "hybrid", d, outcome(work.run_arm(d.gamma, arm)), arm)
            arms.append(arm)
        late = arms[40:]
        assert sum(a == wins for a in late) >= 0.85 * len(late), (network, extra, arms)
        assert any(a != wins for a in late)  # the other arm is still probed now and then


def test_tree_scores_are_calibrated_by_what_they_earned():
    """A drafter whose tree scores promise twice the drafts that get accepted is trusted half as
    much; unscored rounds (chains) leave the calibration alone, and task types keep their own."""
    controller = Controller(ControllerSettings())
    assert controller.score_scale("code", "hybrid") == 1.0
    rounds = [pb.RoundRecord(drafted=6, depth=3, accepted=1, expected=2.0, verify_ms=50.0),
              pb.RoundRecord(drafted=4, accepted=3, verify_ms=50.0)]  # a chain: no expectation
    stats = pb.GenerationStats(generated_tokens=7, decode_ms=100.0, round_records=rounds * 10, rounds=20,
                               speculation_used=True)
    controller.observe("code", "hybrid", controller.decide("code", "hybrid", ON, 4, 1), outcome(stats))
    assert abs(controller.score_scale("code", "hybrid") - 0.5) < 1e-9
    assert controller.score_scale("open", "hybrid") == 1.0


def test_speculation_stops_where_the_batch_width_it_spends_stops_being_free():
    """With a batching verifier, N spec-off requests share one forward of N rows and N spec-on ones
    a forward of N x (rows per round): the cut-off follows the verifier's measured cost per width
    (flat while memory-bound, then linear) and the type's measured rounds."""
    c = Controller(ControllerSettings(control_share=0.0))
    # 10 ms up to 8 rows, then +1.5 ms per row: the shape measured on the default model's CPU.
    c.cost_curve = [10.0] * 8 + [10.0 + 1.5 * (r - 8) for r in range(9, 65)]
    assert c.decide("code", "hybrid", AUTO, 0, inflight=15).reason == "on"  # nothing measured yet
    serve(c, Workload(alpha=0.75), 20)
    st = c.state("code", "hybrid")
    gains = {n: st.gain_at(n, c.cost_curve) for n in (1, 2, 4, 8, 16)}
    assert gains[1] > gains[2] > gains[4] > gains[8] and gains[1] > 1 > max(gains[8], gains[16]), gains
    assert c.decide("code", "hybrid", AUTO, 0, inflight=0).speculate  # alone: the width is free
    assert c.decide("code", "hybrid", AUTO, 0, inflight=7).reason == "concurrency"
    assert c.decide("code", "hybrid", ON, 0, inflight=7).speculate  # a forced request is obeyed
    # A type whose drafts are rarely accepted stops paying at a lower concurrency.
    serve(c, Workload(alpha=0.3, seed=2), 20, task="open")
    weak = c.state("open", "hybrid")
    cut = lambda s: min(n for n in range(1, 65) if s.gain_at(n, c.cost_curve) < 1)  # noqa: E731
    assert cut(weak) < cut(st), (cut(weak), cut(st))


def test_under_load_what_was_measured_at_that_load_decides_over_the_prediction():
    """The prediction misses what the verifier's cost curve does not show (a drafter sharing the
    CPU, the gateway's work per session): once spec-on and spec-off requests have run at a load,
    their decode time per token there decides, and now and then (more rarely than alone: a probe
    slows every session it shares forwards with) a decision at that load runs the other mode so
    that both stay measured. A lone request is judged apart."""
    c = Controller(ControllerSettings(control_share=0.0))
    c.cost_curve = [10.0] * 64  # width looks free: the prediction says speculate at any load
    serve(c, Workload(alpha=0.75), 20)
    assert c.decide("code", "hybrid", AUTO, 0, inflight=3).reason == "on"  # predicted
    for _ in range(4):  # at 4 in flight, spec-on measured 30 % slower per token than spec-off
        for mode, ms in ((ON, 13.0), (OFF, 10.0)):
            d = c.decide("code", "hybrid", mode, 0, inflight=3)
            c.observe("code", "hybrid", d, outcome(pb.GenerationStats(
                generated_tokens=65, decode_ms=64 * ms, speculation_used=mode == ON)))
    decisions = [c.decide("code", "hybrid", AUTO, 0, inflight=2) for _ in range(40)]  # 3 in flight: same bucket
    assert [d.reason for d in decisions].count("concurrency") == 39, decisions
    assert [d.reason for d in decisions].count("probe") == 1 and all(d.clients == 3 for d in decisions)
    assert c.decide("code", "hybrid", AUTO, 0, inflight=7).speculate  # 8 in flight: not measured, predicted
    assert c.decide("code", "hybrid", AUTO, 0, inflight=0).reason == "on"  # alone: its own state
    assert c.state("code", "hybrid").enabled


def test_a_busy_spell_is_followed_while_it_lasts_and_forgotten_after():
    """A neighbour slows everything (x3, noisier): speculation still wins there and stays on, and
    after the spell 8 of 10 requests speculate. A neighbour that slows drafting enough to lose
    turns it off while it lasts, and speculation comes back once it has gone."""
    c = Controller(ControllerSettings(control_share=0.1))
    serve(c, Workload(alpha=0.75, seed=1), 60)
    st = c.state("code", "hybrid")
    assert st.enabled
    spell = serve(c, Workload(alpha=0.75, seed=2, slow=3.0, noise=0.3), 100)
    assert sum(d.speculate for d in spell) >= 80 and st.enabled, st.history
    after = serve(c, Workload(alpha=0.75, seed=3), 10)
    assert sum(d.speculate for d in after) >= 8

    # Drafting 12x slower (3 ms -> 36 ms a token, against a 50 ms step): speculation loses.
    losing = serve(c, Workload(alpha=0.75, seed=4, slow=1.5, draft_slow=12.0, noise=0.3), 150)
    assert not st.enabled, st.history  # by P95 or by the acceptance its costs now need
    # Each request's gate keeps it at spec-off's pace (its probes cost a little) where drafting loses.
    slow = Workload(alpha=0.75, seed=6, slow=1.5, draft_slow=12.0, noise=0.3)
    off = sum(slow.run(False, 0).decode_ms / 63 for _ in range(20)) / 20
    gated = [d.ms_per_token for d in losing[-50:] if d.reason == "disabled"]
    assert sum(gated) / len(gated) < 1.05 * off, (sum(gated) / len(gated), off)
    back = serve(c, Workload(alpha=0.75, seed=5), 200)
    assert st.enabled and "recovered" in st.history[-1][2]
    assert sum(d.drafted > 0.9 for d in back[-10:]) >= 8


def test_the_gate_starts_each_situation_from_the_type_s_own_rounds_in_it():
    """A type whose requests' drafts beat the verifier's own copies where a copy is in sight and lose
    where none is: the next request's gate asks in the first situation and not in the second (the
    type's mean would ask in both). Where copying alone commits faster, it does not ask there."""
    for copy_ms, asks_with_copy in ((1.1, True), (0.5, False)):  # ms per token of copying rounds
        controller = Controller(ControllerSettings())
        off = [pb.RoundRecord(verify_ms=2.0, round_ms=2.2) for _ in range(20)]
        controller.observe("qa", "hybrid", Decision(False, 0, "control", 1),
                           outcome(pb.GenerationStats(generated_tokens=21, decode_ms=44.0, round_records=off)))
        rounds = [pb.RoundRecord(drafted=4, accepted=3, verify_ms=2.6, draft_ms=0.3, network_ms=0.3, round_ms=3.3,
                                 asked=True, copy_in_sight=True) for _ in range(10)]
        rounds += [pb.RoundRecord(drafted=3, accepted=0, verify_ms=2.5, draft_ms=0.4, network_ms=0.3, round_ms=3.3,
                                  asked=True, copy_in_sight=False) for _ in range(10)]
        rounds += [pb.RoundRecord(decoded=3, verify_ms=4 * 2.0, round_ms=4 * copy_ms, copy_in_sight=True)
                   for _ in range(10)]  # the verifier copying on its own, 4 tokens a round
        decision = Decision(True, 4, "on", 1)
        controller.observe("qa", "hybrid", decision,
                           outcome(pb.GenerationStats(generated_tokens=91, decode_ms=110.0, round_records=rounds,
                                                      speculation_used=True)))
        prior = controller.prior("qa", "hybrid", decision)
        assert prior.situations[True] == (4.0, 3.3) and prior.situations[False] == (1.0, 3.3)
        assert abs(prior.off_ms - 2.2) < 1e-9  # the rounds without asking, in the same units: wall time
        assert abs(prior.unasked[True] - copy_ms) < 1e-9
        gate = Gate(prior)
        assert not gate.situations[False].asking  # without a copy, asking earned 1 token per 3.3 ms: a loss
        assert gate.situations[True].asking == asks_with_copy  # 4 per 3.3 ms against copying's rate


def test_a_request_naming_no_drafter_gets_the_one_its_type_decoded_faster_with():
    """AUTO requests naming no drafter alternate between n-gram alone and the service's default until
    each has min_requests, then the faster one runs, and the other every probe_every-th request; a
    type new to it starts from that verdict."""
    s = ControllerSettings()
    controller = Controller(s)
    ms = {"hybrid": 4.4, "ngram": 3.9}  # decode ms per token: the head costs more than it earns

    def serve_one() -> str:
        drafter = controller.drafter("", "hybrid", "ngram")
        decision = controller.decide("", drafter, AUTO, 0, inflight=0)
        rounds = [pb.RoundRecord(drafted=2, accepted=1, verify_ms=ms[drafter], round_ms=ms[drafter], asked=True)]
        stats = pb.GenerationStats(generated_tokens=33, decode_ms=32 * ms[drafter], round_records=rounds,
                                   speculation_used=decision.speculate)
        controller.observe("", drafter, decision, outcome(stats))
        return drafter

    explored = [serve_one() for _ in range(2 * s.min_requests + 4)]  # (some of them are spec-off controls)
    assert explored[:4] == ["ngram", "hybrid", "ngram", "hybrid"]  # turns start with the cheaper way
    chosen = [serve_one() for _ in range(3 * s.probe_every)]
    assert chosen.count("hybrid") == 3 and chosen.count("ngram") == 3 * s.probe_every - 3  # one probe in ten
    # A type that has not timed both yet follows what all types' requests decided, probes included.
    code = [controller.drafter("code", "hybrid", "ngram") for _ in range(s.probe_every)]
    assert code.count("ngram") == s.probe_every - 1, code
    ms["hybrid"], ms["ngram"] = 3.0, 5.0  # the head starts to pay: the probes see it, and it takes over
    later = [serve_one() for _ in range(12 * s.probe_every)]
    assert later[-s.probe_every:].count("hybrid") == s.probe_every - 1


def test_arms_decide_after_three_each_only_when_every_time_of_one_beats_every_time_of_the_other():
    """Exploring the losing arm costs traffic: a lopsided comparison is decided at EARLY (3) requests
    each; one whose times overlap waits for min_requests each."""
    s = ControllerSettings()
    apart, close = Arms(s, "hybrid", "ngram"), Arms(s, "hybrid", "ngram")
    for hybrid, ngram in [(4.4, 3.9), (4.6, 3.7), (4.3, 4.0)]:
        apart.add("hybrid", hybrid)
        apart.add("ngram", ngram)
        close.add("hybrid", hybrid)
        close.add("ngram", ngram + 0.5)  # 4.4, 4.2, 4.5: inside the other arm's times
    assert apart.decided and apart.choose() == "ngram"
    assert not close.decided and close.choose() == "hybrid"  # still taking turns
    for _ in range(s.min_requests - Arms.EARLY):
        close.add("hybrid", 4.4)
        close.add("ngram", 4.3)
    assert close.decided


def test_the_default_drafter_must_beat_n_gram_alone_by_the_margin_to_run():
    """Requests of different prompts differ by tens of per cent: a default drafter that measures a few
    per cent faster than n-gram alone has not shown it pays for its draft service; clearly faster, it
    runs (and n-gram alone is probed)."""
    from gateway.controller import DRAFTER_MARGIN

    s = ControllerSettings()
    for faster, runs in ((0.95, "ngram"), (1 - 2 * DRAFTER_MARGIN, "hybrid")):
        arms = Arms(s, "hybrid", "ngram", "ngram", DRAFTER_MARGIN)
        for i in range(s.min_requests):
            arms.add("hybrid", faster * (4.0 + 0.1 * i))
            arms.add("ngram", 4.0 + 0.1 * i)
        chosen = [arms.choose() for _ in range(s.probe_every)]
        assert chosen.count(runs) == s.probe_every - 1, (faster, chosen)
    plain = Arms(s, "hybrid", "ngram")  # no cheaper arm: the lower median runs, as before
    for i in range(s.min_requests):
        plain.add("hybrid", 0.95 * (4.0 + 0.1 * i))
        plain.add("ngram", 4.0 + 0.1 * i)
    assert plain.choose() == "hybrid"


def test_the_drafter_arms_compare_requests_in_one_row_forwards_of_their_own_context():
    """In unlabelled mixed traffic each arm serves different prompts: the n-gram requests here got the
    long documents, whose forwards cost twice as much. Raw ms per token would crown the head;
    per token in one-row forwards of each request's own context (its forwards' mean compute, less
    what their extra rows cost by the verifier's curve), n-gram alone is the faster."""
    s = ControllerSettings()
    controller = Controller(s)
    controller.cost_curve = [4.0, 4.4, 4.8, 5.2, 5.6]  # ms by rows: a second row costs 10 %
    served = {"hybrid": (3.0, 0, 3.3), "ngram": (6.0, 16, 5.0)}  # forward ms, drafted per 32 forwards, ms/token

    def serve_one() -> str:
        drafter = controller.drafter("", "hybrid", "ngram")
        decision = controller.decide("", drafter, AUTO, 0, inflight=0)
        forward, drafted, per_token = served[drafter]
        stats = pb.GenerationStats(generated_tokens=41, decode_ms=40 * per_token, forwards=32, drafted_tokens=drafted,
                                   verify_ms=32 * forward, speculation_used=decision.speculate)
        controller.observe("", drafter, decision, outcome(stats))
        return drafter

    for _ in range(2 * s.min_requests + 2):
        serve_one()
    chosen = [serve_one() for _ in range(s.probe_every)]
    assert chosen.count("ngram") == s.probe_every - 1, chosen
    # The measure itself: ngram's 5.0 ms/token over its 1-row forward (6.0 / 1.05 at 1.5 rows a forward).
    assert abs(in_forwards(5.0, outcome(pb.GenerationStats(forwards=32, drafted_tokens=16, verify_ms=192.0)),
                           controller.cost_curve) - 5.0 * 1.05 / 6.0) < 1e-9


def test_where_asking_the_drafter_beats_the_verifier_alone_n_gram_alone_is_not_explored():
    """The pair's 0.5B draft commits 4 tokens in 1.6 steps where no copy is in sight: n-gram alone,
    there only the verifier decoding, cannot win, so no AUTO request is spent trying it. Where the
    draft commits less per ms than the verifier alone, the arms take turns as before."""
    for round_ms, expected in ((32.0, ["hybrid"] * 6), (90.0, ["ngram", "hybrid"] * 3)):
        controller = Controller(ControllerSettings())
        off = [pb.RoundRecord(verify_ms=19.0, round_ms=20.0) for _ in range(20)]  # spec-off: 20 ms a token
        controller.observe("code", "hybrid", Decision(False, 0, "forced", 1),
                           outcome(pb.GenerationStats(generated_tokens=21, decode_ms=400.0, round_records=off)))
        asked = [pb.RoundRecord(drafted=4, accepted=3, verify_ms=22.0, draft_ms=round_ms - 23.0, network_ms=1.0,
                                round_ms=round_ms, asked=True, copy_in_sight=False) for _ in range(10)]
        controller.observe("code", "hybrid", Decision(True, 4, "forced", 1),
                           outcome(pb.GenerationStats(generated_tokens=41, decode_ms=10 * round_ms,
                                                      round_records=asked, speculation_used=True)))
        assert controller.state("code", "hybrid").asking_pays() == (round_ms == 32.0)
        chosen = []
        for _ in range(6):
            chosen.append(controller.drafter("code", "hybrid", "ngram"))
            controller.observe("code", chosen[-1], Decision(True, 4, "on", 1),
                               outcome(pb.GenerationStats(generated_tokens=41, decode_ms=400.0, speculation_used=True)))
        assert chosen == expected


def test_without_asked_rounds_the_prior_does_not_weigh_modelled_asking_against_a_timed_wall():
    """Spec-off controls timed (5 ms a token of wall time, 2 ms of it the forward), no round asked
    yet: the gate's start compares the cost model's asking with the cost model's decoding alone,
    both without the gateway's share, rather than a modelled round against a timed one."""
    controller = Controller(ControllerSettings())
    off = [pb.RoundRecord(verify_ms=2.0, round_ms=5.0) for _ in range(20)]
    controller.observe("qa", "hybrid", Decision(False, 0, "control", 1),
                       outcome(pb.GenerationStats(generated_tokens=21, decode_ms=100.0, round_records=off)))
    prior = controller.prior("qa", "hybrid", Decision(True, 4, "on", 1))
    assert abs(prior.off_ms - controller.state("qa", "hybrid").off_time_per_token()) < 1e-9
    assert prior.off_ms < 5.0 and False not in prior.unasked

"""The per-request gate on hand-made rounds: it asks the drafter while asking pays, stops when the
request's own rounds say it loses, probes with a growing interval, and comes back when a probe pays."""

from __future__ import annotations

from gateway.gate import PROBE_MAX, PROBE_MIN, Gate, Prior

STEP = 2.0  # ms of a round that does not ask
ASK = 3.0  # ms of a round that asks (the Propose, wider verify)


def drive(gate: Gate, accepted_if_asked, tokens: int) -> list[bool]:
    """Rounds until `tokens` are committed; accepted_if_asked(i): drafts accepted when round i asks."""
    asks, committed = [], 0
    while committed < tokens:
        asked = gate.ask()
        n = 1 + (accepted_if_asked(len(asks)) if asked else 0)
        gate.record(asked, n, ASK if asked else STEP)
        asks.append(asked)
        committed += n
    return asks


def test_forced_asks_every_round():
    gate = Gate(Prior(tokens=1.0, on_ms=10.0, off_ms=1.0), always=True)
    assert all(drive(gate, lambda i: 0, 50))


def test_stops_asking_when_its_rounds_lose_and_probes_less_and_less():
    gate = Gate()  # nothing known: it asks first
    asks = drive(gate, lambda i: 0, 200)
    assert asks[0] and not all(asks[:3])  # learnt within the first rounds
    gaps, last = [], None
    for i, a in enumerate(asks):
        if a:
            if last is not None:
                gaps.append(i - last)
            last = i
    assert sum(asks) <= 2 + 200 // PROBE_MIN // 2, asks  # far fewer asks than rounds
    assert gaps[-1] == PROBE_MAX + 1 and gaps == sorted(gaps), gaps  # the interval doubles to its cap


def test_a_request_that_pays_keeps_asking():
    gate = Gate(Prior(tokens=1.0, on_ms=ASK, off_ms=STEP))  # the type says asking loses ...
    asks = drive(gate, lambda i: 3, 120)  # ... but this request's drafts are right
    assert not any(asks[:PROBE_MIN]) and all(asks[PROBE_MIN:]), asks  # one probe, then its own rounds decide


def test_comes_back_when_the_text_turns_copyable():
    gate = Gate()
    copyable = {"from": 10_000}

    def accepted(i):
        return 4 if i >= copyable["from"] else 0

    asks = drive(gate, accepted, 60)
    assert sum(asks[-20:]) <= 2
    copyable["from"] = 0  # a quoted span starts: the next probe finds it
    more = drive(gate, accepted, 100)
    assert sum(more) >= len(more) - PROBE_MAX, more


def test_off_run_is_the_tokens_until_the_next_probe():
    gate = Gate(Prior(tokens=1.0, on_ms=ASK, off_ms=STEP))
    assert not gate.ask() and gate.off_run() == PROBE_MIN  # off by the prior: the first probe after PROBE_MIN
    gate.record(False, PROBE_MIN, PROBE_MIN * STEP)  # decoded in one round
    assert gate.ask() and gate.off_run() == 1
    gate.record(True, 1, ASK)  # the probe: nothing accepted
    assert not gate.ask() and gate.off_run() == 2 * PROBE_MIN  # a losing probe doubles the wait
    gate.record(False, 5, 5 * STEP)
    assert gate.off_run() == 2 * PROBE_MIN - 5
    assert Gate().off_run() == 1 and Gate(always=True).off_run() == 1


def test_a_copy_in_sight_is_left_to_the_verifier_and_rounds_without_one_are_judged_alone():
    """A document in the prompt and an answer that quotes it now and then: while a copy is in sight
    an AUTO round never asks the drafter (the verifier drafts the copy itself); the rounds without
    one stop asking after a few losing rounds, whatever the quoting rounds earned; a forced
    request asks every round."""
    document = list(range(100, 160))
    gate = Gate(Prior(tokens=1.5, on_ms=ASK, off_ms=STEP))
    gate.extend(document)
    text = list(document)
    asked_copy, asked_other, copyable_rounds, other_rounds = 0, 0, 0, 0
    fresh = 1000
    for round_ in range(120):
        quoting = (round_ // 10) % 2 == 1  # ten rounds of own words, then ten quoting the document
        if quoting and not gate.copyable:  # the quote starts: the target's own two tokens of the document
            asked = gate.ask()
            new = document[20 + round_ % 20:22 + round_ % 20]
            gate.record(asked, 2, 2 * (ASK if asked else STEP))
        elif quoting:
            at = document.index(text[-1]) + 1
            copyable_rounds += 1
            asked = gate.ask()
            asked_copy += asked
            new = document[at:at + 4]  # the verifier's own lookup, all right, and its token
            assert gate.record(asked, len(new), STEP) is True
        else:  # own words (the first after a quote still sees its last two tokens: a copy in sight)
            asked = gate.ask()
            new = [fresh]
            fresh += 1
            copy = gate.record(asked, 1, ASK if asked else STEP)
            other_rounds += not copy
            asked_other += asked and not copy
            asked_copy += asked and copy
        text += new
        gate.extend(new)
    assert copyable_rounds > 20 and asked_copy == 0
    assert asked_other <= other_rounds // 4, (asked_other, other_rounds)
    forced = Gate(always=True)
    forced.extend([1, 2, 3, 1, 2])
    assert forced.copyable and forced.ask()


def test_while_a_copy_is_in_sight_and_the_drafter_pays_the_gateway_looks_again_every_few_tokens():
    gate = Gate()  # nothing known: asking pays
    gate.extend([1, 2, 3, 1, 2])  # (1, 2) occurred before: a copy is in sight
    assert gate.asking and gate.copyable and not gate.ask()
    assert gate.off_run() == PROBE_MIN  # not one token per trip, and not a whole chunk past the copy
    gate.since_ask = 1
    assert gate.off_run() == PROBE_MIN - 1


def test_rounds_without_a_copy_start_from_what_asking_without_one_earned_in_earlier_requests():
    # The type's earlier requests: asking with a copy in sight committed 4 tokens a 3 ms round,
    # asking without one 1 token a 3 ms round, against a 2 ms token decoded alone.
    prior = Prior(tokens=2.5, on_ms=ASK, off_ms=STEP, situations={True: (4.0, ASK), False: (1.0, ASK)})
    assert not Gate(prior).asking
    # Without situations they start from the type's mean, which pays.
    assert Gate(Prior(tokens=2.5, on_ms=ASK, off_ms=STEP)).asking
    # record() says which situation a round was in.
    gate = Gate(prior, always=True)
    gate.extend([1, 2, 3, 1, 2])  # "1 2" occurred before: a copy in sight
    assert gate.ask() and gate.record(True, 3, ASK) is True
    gate.extend([9, 8])
    assert gate.ask() and gate.record(True, 1, ASK) is False

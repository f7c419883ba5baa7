"""The per-request gate on hand-made rounds: it asks the drafter while asking pays, stops when the
request's own rounds say it loses, probes with a growing interval, and comes back when a probe pays."""

from __future__ import annotations

from gateway.gate import PROBE_MAX, PROBE_MIN, Gate, Prior

STEP = 2.0  # ms of a round that does not ask
ASK = 3.0  # ms of a round that asks (the Propose, wider verify)


def drive(gate: Gate, accepted_if_asked, tokens: int) -> list[bool]:
    """Rounds until `tokens` are committed; accepted_if_asked(i): drafts accepted when round i asks."""
    asks, committed = [], 0
    for _ in range(tokens):  # a round commits at least one token
        if committed >= tokens:
            break
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


def quoting(gate: Gate, copied: tuple[int, float], asked_copy: tuple[int, float], rounds: int = 120) -> dict:
    """A document in the prompt and an answer that quotes it now and then (ten rounds of own words,
    then ten quoting). A quoting round that does not ask is the verifier copying (`copied`: tokens
    and ms a round); one that asks commits and takes `asked_copy`. Own words: asking finds nothing."""
    document = list(range(100, 160))
    gate.extend(document)
    text = list(document)
    seen = {"copy rounds": 0, "asked copy": 0, "other rounds": 0, "asked other": 0}
    fresh = 1000
    for round_ in range(rounds):
        if (round_ // 10) % 2 == 1 and not gate.copyable:  # the quote starts: its first two tokens
            asked = gate.ask()
            new = document[20 + round_ % 20:22 + round_ % 20]
            gate.record(asked, 2, 2 * (ASK if asked else STEP))
        elif (round_ // 10) % 2 == 1:
            at = document.index(text[-1]) + 1
            asked = gate.ask()
            n, ms = asked_copy if asked else copied
            new = document[at:at + n]
            seen["copy rounds"] += 1
            seen["asked copy"] += asked
            assert gate.record(asked, len(new), ms) is True
        else:  # own words (the first after a quote still sees its last two tokens: a copy in sight)
            asked = gate.ask()
            new = [fresh]
            fresh += 1
            copy = gate.record(asked, 1, ASK if asked else STEP)
            seen["copy rounds" if copy else "other rounds"] += 1
            seen["asked copy" if copy else "asked other"] += asked
        text += new
        gate.extend(new)
    return seen


def test_with_a_copy_in_sight_the_drafter_is_asked_only_where_it_beats_the_verifier_copying():
    """While a copy is in sight, not asking is the verifier drafting the copy itself: a request
    starts there not asking (the cheaper source), probes, and asks on only if asking commits faster
    than copying (a draft model on a large target) — not if copying does (a cheap head on a small
    one). Rounds without a copy are judged alone either way: asking finds nothing there."""
    head = quoting(Gate(Prior(tokens=1.5, on_ms=ASK, off_ms=STEP)), copied=(4, STEP), asked_copy=(2, ASK))
    assert head["copy rounds"] > 20 and head["asked copy"] <= 6, head  # probes only
    assert head["asked other"] <= head["other rounds"] // 4, head
    model = quoting(Gate(Prior(tokens=1.5, on_ms=ASK, off_ms=STEP)), copied=(2, STEP), asked_copy=(5, ASK))
    assert model["asked copy"] >= model["copy rounds"] // 2, model  # after its first probe, it asks (mostly)
    assert model["asked other"] <= model["other rounds"] // 4, model
    forced = Gate(always=True)
    forced.extend([1, 2, 3, 1, 2])
    assert forced.copyable and forced.ask()


def test_while_a_copy_is_in_sight_and_the_drafter_pays_the_gateway_looks_again_every_few_tokens():
    gate = Gate()  # nothing known: asking pays without a copy; with one, copying first
    gate.extend([1, 2, 3, 1, 2])  # (1, 2) occurred before: a copy is in sight
    assert gate.situations[False].asking and gate.copyable and not gate.ask()
    assert gate.off_run() == PROBE_MIN  # not one token per trip, and not a whole chunk past the copy
    gate.situations[True].since_ask = 1
    assert gate.off_run() == PROBE_MIN - 1


def test_rounds_without_a_copy_start_from_what_asking_without_one_earned_in_earlier_requests():
    # The type's earlier requests: asking with a copy in sight committed 4 tokens a 3 ms round,
    # asking without one 1 token a 3 ms round, against a 2 ms token decoded alone.
    prior = Prior(tokens=2.5, on_ms=ASK, off_ms=STEP, situations={True: (4.0, ASK), False: (1.0, ASK)})
    assert not Gate(prior).situations[False].asking
    assert Gate(prior).situations[True].asking  # no copying timed yet: a round that asks costs ASK_COST of one
    # Without situations they start from the type's mean, which pays; with a copy in sight, copying first.
    assert Gate(Prior(tokens=2.5, on_ms=ASK, off_ms=STEP)).situations[False].asking
    assert not Gate(Prior(tokens=2.5, on_ms=ASK, off_ms=STEP)).situations[True].asking
    # record() says which situation a round was in.
    gate = Gate(prior, always=True)
    gate.extend([1, 2, 3, 1, 2])  # "1 2" occurred before: a copy in sight
    assert gate.ask() and gate.record(True, 3, ASK) is True
    gate.extend([9, 8])
    assert gate.ask() and gate.record(True, 1, ASK) is False


def test_a_few_unlucky_rounds_do_not_overturn_what_the_type_measured_but_a_run_of_them_does():
    """The real pair's draft: its type's rounds committed 3.5 tokens in 80 ms against 37.5 ms a token
    decoded alone. A request whose asked rounds commit 2 tokens in 100 ms (acceptance is geometric:
    short runs like that are common) keeps asking through three of them; a longer run stops it, its
    own evidence outweighing the type's."""
    gate = Gate(Prior(situations={False: (3.5, 80.0)}, unasked={False: 37.5}))
    asked = 0
    for _ in range(30):
        if not gate.ask():
            break
        gate.record(True, 2, 100.0)
        asked += 1
    assert 3 < asked < 30, asked

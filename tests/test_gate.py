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
    assert all(asks), asks  # its first round probes, and its own rounds outweigh the prior


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
    assert gate.ask()  # the first round probes: a request is judged on its own rounds
    gate.record(True, 1, ASK)  # nothing accepted
    assert gate.off_run() == 2 * PROBE_MIN and not gate.ask()  # a losing probe doubles the interval
    gate.record(False, 5, 5 * STEP)  # five tokens decoded in one round
    assert gate.off_run() == 2 * PROBE_MIN - 5
    assert Gate().off_run() == 1 and Gate(always=True).off_run() == 1

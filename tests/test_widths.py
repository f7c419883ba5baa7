"""The verifier's own lookup depth prices a wider forward at what it costs now: each session's
one-row steps and the service's cost of one more row, from lone decode-ahead forwards."""

from __future__ import annotations

from specsplit.speculation.ewma import Ewma
from specsplit.speculation.lookup import Agreement
from verify_service.widths import Widths


def test_the_curve_is_the_start_one_until_a_step_and_a_wider_forward_are_timed():
    widths, step = Widths(), Ewma(0.9)
    start = [3.0, 3.1, 3.2, 3.3, 3.4]
    assert widths.curve(step, start) == start
    widths.add(step, 1, 2.0)
    assert widths.curve(step, start) == start  # no wider forward yet
    widths.add(step, 3, 3.6)  # two more rows: 0.8 ms each
    assert widths.curve(step, start) == [2.0, 2.8, 3.6, 4.4, 5.2]
    widths.add(step, 2, 60.0)  # a preempted forward, not a wide one
    assert widths.curve(step, start) == [2.0, 2.8, 3.6, 4.4, 5.2]


def test_rows_that_got_dear_shorten_the_lookup():
    """At an even chance per token, the start curve (rows nearly free) drafts deep; once rows cost
    a third of a step each, one token."""
    agreement, start = Agreement(), [2.3, 2.35, 2.4, 2.45, 2.5, 2.55, 2.6, 2.65, 2.7]
    assert agreement.depth(8, start) >= 3
    widths, step = Widths(), Ewma(0.9)
    for _ in range(5):
        widths.add(step, 1, 2.3)
        widths.add(step, 2, 3.05)
    assert agreement.depth(8, widths.curve(step, start)) == 1


def test_a_session_under_rejection_sampling_keeps_the_start_curve():
    """Its text for a seed depends on what was drafted: a depth that followed the machine's moment
    would make a repeated request's text differ. Greedy and coupled sampling do not depend on the
    drafts, and follow the live costs."""
    from specsplit.speculation.params import Method, SamplingParams

    widths, step = Widths(), Ewma(0.9)
    start = [3.0, 3.1, 3.2]
    widths.add(step, 1, 2.0)
    widths.add(step, 3, 3.6)
    live = [2.0, 2.8, 3.6]
    assert widths.curve(step, start, SamplingParams(temperature=0.7, method=Method.REJECTION)) == start
    assert widths.curve(step, start, SamplingParams(temperature=0.7, method=Method.COUPLED)) == live
    assert widths.curve(step, start, SamplingParams(method=Method.REJECTION)) == live  # greedy

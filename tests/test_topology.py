"""The topology bench's arithmetic on hand-made points: speedups per mode and where the sweep crosses spec-off."""

from __future__ import annotations

import pytest

from specsplit.tools.topology import Point, Tally, fitted, measured_break_even, pooled_off


def _point(rtt, off_s, on_s, async_s, tokens=100, rounds=50) -> Point:
    p = Point("split", rtt)
    p.modes["off"] = Tally(seconds=off_s, tokens=tokens, rounds=tokens)
    p.modes["on"] = Tally(seconds=on_s, tokens=tokens, rounds=rounds)
    p.modes["async"] = Tally(seconds=async_s, tokens=tokens, rounds=rounds)
    return p


def test_break_even_from_a_line_fitted_to_the_sweep_per_mode():
    # spec-on loses 1 s per 10 ms of RTT, pre-drafting half as much.
    points = [_point(rtt, 5.0, 4.0 + rtt / 10, 4.0 + rtt / 20) for rtt in (0.0, 5.0, 10.0, 20.0, 40.0)]
    assert points[0].speedup("on") == 1.25
    assert measured_break_even(points, "on") == pytest.approx(10.0)
    assert measured_break_even(points, "async") == pytest.approx(20.0)
    # Predicted from the RTT-0 point: (T_off - T_on) / rounds-per-token = (50 - 40) ms / 0.5.
    assert points[0].predicted_break_even() == 20.0
    assert measured_break_even(points[:2], "async") is None  # never crosses within the sweep
    assert measured_break_even([_point(0.0, 4.0, 5.0, 5.0)], "on") == 0.0  # loses already at RTT 0
    # Spec-off never reaches the drafter: its noise is pooled over the sweep, not read point by point.
    noisy = [_point(rtt, off, 4.0 + rtt / 10, 4.0 + rtt / 20)
             for rtt, off in ((0.0, 4.5), (5.0, 5.5), (10.0, 4.6), (20.0, 5.4), (40.0, 5.0))]
    assert pooled_off(noisy).seconds == 25.0
    assert measured_break_even(noisy, "on") == pytest.approx(10.0)
    # One noisy spec-on point (6 ms/token slow at RTT 5, a speedup below 1 there) cannot decide the
    # crossing, which point-to-point interpolation would put below 5 ms: the line uses every point.
    bumpy = [_point(rtt, 5.0, 4.0 + rtt / 10 + (0.6 if rtt == 5.0 else 0.0), 4.0)
             for rtt in (0.0, 5.0, 10.0, 20.0, 40.0)]
    assert bumpy[1].speedup("on") < 1 and 8.0 < measured_break_even(bumpy, "on") < 10.0
    assert fitted(points, "on") == pytest.approx((40.0, 1.0))
    assert noisy[0].predicted_break_even(pooled_off(noisy)) == 20.0

"""The topology bench's arithmetic on hand-made points: speedups per mode and where the sweep crosses spec-off."""

from __future__ import annotations

import pytest

from specsplit.bench.topology import Point, Tally, fitted, measured_break_even, pooled_off


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



async def test_measure_through_a_delaying_proxy_pays_the_rtt_on_every_asked_round(models, tmp_path, capsys):
    """The sweep's measuring step on real services (tiny models), the drafter behind the delaying
    proxy as `bench --topology` puts it: every mode answers the same tokens, every round that asked
    the drafter pays at least the RTT set (and none does at RTT 0), and the report reads the points."""
    import asyncio
    import statistics

    import grpc
    from conftest import running_stack

    from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc
    from specsplit.bench.netem import DelayProxy
    from specsplit.bench.topology import measure, report
    from specsplit.bench.workload import Prompt

    proxies = []

    def via(address: str) -> str:
        proxies.append(DelayProxy(address))
        return proxies[-1].start()

    prompts = [Prompt("code", "def add(a, b):")]
    try:
        async with running_stack(tmp_path, "tcp", models["target"], models["draft"], "float32",
                                 default_drafter="model", shared_memory=False, draft_via=via) as stack:
            with grpc.insecure_channel(stack.gateway) as channel:
                stub = pb_grpc.GatewayStub(channel)
                points = []
                for rtt in (0.0, 30.0):
                    proxies[0].set_rtt(rtt)
                    point = await asyncio.to_thread(measure, stub, prompts, 12, 1, Point("split", rtt))
                    points.append(point)
    finally:
        for proxy in proxies:
            proxy.stop()
    for p in points:
        assert all(t.requests == 1 and t.tokens == 12 for t in p.modes.values())
        assert p.modes["on"].rounds < 12 and p.modes["on"].accepted > 0  # drafts were asked and accepted
    near, far = (statistics.median(p.modes["on"].overhead_ms) for p in points)
    assert near < 30.0 <= far, (near, far)
    report(points, None)
    printed = capsys.readouterr().out
    assert printed.count("split") >= 2 and "break-even RTT (on): measured" in printed

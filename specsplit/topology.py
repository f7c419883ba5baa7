"""`specsplit bench --topology`: the same workload co-located (UNIX socket, TCP loopback) and split
with an emulated network between the gateway (next to the verifier) and the drafter, over a sweep of
round-trip times; speedup vs spec-off, per-round overhead, and the break-even RTT measured (where the
speedup crosses 1) next to the one predicted from the RTT-0 run (docs/metrics.md)."""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, replace

import grpc

from specsplit.bench import Prompt, _request, _warmup
from specsplit.gateway.v1 import gateway_pb2 as pb
from specsplit.gateway.v1 import gateway_pb2_grpc as pb_grpc
from specsplit.launcher import Stack, StackConfig
from specsplit.netem import DelayProxy

RTTS_MS = (0.0, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0)  # 40: past the break-even on this CPU


@dataclass
class Point:
    label: str
    rtt_ms: float | None
    off_s: float = 0.0
    on_s: float = 0.0
    off_tokens: int = 0
    on_tokens: int = 0
    on_rounds: int = 0
    accepted: int = 0
    overhead_ms: list = None  # per spec-on round: round wall time - draft compute - verify compute

    @property
    def speedup(self) -> float:
        return (self.on_tokens / self.on_s) / (self.off_tokens / self.off_s)

    def predicted_break_even(self) -> float:
        """RTT at which a split drafter's round trips eat the gain (trace-report's formula), from
        this run: each round's Propose pays the RTT on top of what was measured."""
        t_on, t_off = 1e3 * self.on_s / self.on_tokens, 1e3 * self.off_s / self.off_tokens
        return max(0.0, (t_off - t_on) / (self.on_rounds / self.on_tokens))


def measure(stub, prompts: list[Prompt], max_new_tokens: int, repeats: int, point: Point) -> Point:
    point.overhead_ms = []
    for r in range(repeats):
        for i, p in enumerate(prompts):
            for mode in ((pb.SPECULATION_OFF, pb.SPECULATION_ON) if (i + r) % 2 else
                         (pb.SPECULATION_ON, pb.SPECULATION_OFF)):
                start = time.perf_counter()
                out = stub.Generate(_request(p, mode, max_new_tokens), timeout=600)
                wall = time.perf_counter() - start
                s = out.stats
                if mode == pb.SPECULATION_ON:
                    point.on_s += wall
                    point.on_tokens += len(out.token_ids)
                    point.on_rounds += s.rounds
                    point.accepted += s.accepted_tokens
                    point.overhead_ms += [x.round_ms - x.draft_ms - x.verify_ms for x in s.round_records]
                else:
                    point.off_s += wall
                    point.off_tokens += len(out.token_ids)
    return point


def run(prompts: list[Prompt], config: StackConfig, max_new_tokens: int, repeats: int,
        rtts: tuple[float, ...] = RTTS_MS, plot: str | None = None) -> list[Point]:
    points = []
    for transport in ("unix", "tcp"):
        with Stack(replace(config, transport=transport)) as stack:
            print(f"co-located, {transport} ...", file=sys.stderr, flush=True)
            with grpc.insecure_channel(stack.start()) as channel:
                stub = pb_grpc.GatewayStub(channel)
                stub.Generate(_request(_warmup(prompts), pb.SPECULATION_ON, 16), timeout=600)
                points.append(measure(stub, prompts, max_new_tokens, repeats, Point(f"co-located {transport}", None)))
    proxy: DelayProxy | None = None

    def via(address: str) -> str:
        nonlocal proxy
        proxy = DelayProxy(address)
        return proxy.start()

    stack = Stack(replace(config, transport="tcp"))
    try:
        with grpc.insecure_channel(stack.start(draft_via=via)) as channel:
            stub = pb_grpc.GatewayStub(channel)
            stub.Generate(_request(_warmup(prompts), pb.SPECULATION_ON, 16), timeout=600)
            for rtt in rtts:
                proxy.set_rtt(rtt)
                print(f"split, drafter RTT {rtt} ms ...", file=sys.stderr, flush=True)
                points.append(measure(stub, prompts, max_new_tokens, repeats, Point("split", rtt)))
    finally:
        stack.stop()
        if proxy is not None:
            proxy.stop()
    report(points, plot)
    return points


def measured_break_even(points: list[Point]) -> float | None:
    """Where the split sweep's speedup crosses 1, by linear interpolation; None if it never does."""
    split = [p for p in points if p.rtt_ms is not None]
    for a, b in zip(split, split[1:]):
        if a.speedup >= 1 > b.speedup:
            return a.rtt_ms + (a.speedup - 1) / (a.speedup - b.speedup) * (b.rtt_ms - a.rtt_ms)
    return 0.0 if split and split[0].speedup < 1 else None


def report(points: list[Point], plot: str | None) -> None:
    print(f"{'topology':<18}{'RTT ms':>7}{'on/off':>8}{'acc.len':>8}{'overhead/round ms':>19}")
    for p in points:
        rtt = "-" if p.rtt_ms is None else f"{p.rtt_ms:g}"
        print(f"{p.label:<18}{rtt:>7}{p.speedup:>7.2f}x{(p.accepted + p.on_rounds) / p.on_rounds:>8.2f}"
              f"{statistics.median(p.overhead_ms):>19.2f}")
    base = next((p for p in points if p.rtt_ms == 0), None)
    measured = measured_break_even(points)
    predicted = base.predicted_break_even() if base else None
    print(f"break-even RTT: measured {'beyond the sweep' if measured is None else f'{measured:.1f} ms'}, "
          f"predicted from the RTT-0 run {predicted:.1f} ms" if predicted is not None else "")
    print("overhead/round = round wall time - draft compute - verify compute (median); the split drafter sits "
          "behind a userspace delaying proxy (specsplit/netem.py), the gateway next to the verifier")
    if plot:
        _plot(points, predicted, measured, plot)
        print(f"plot: {plot}")


def _plot(points: list[Point], predicted: float | None, measured: float | None, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    split = [p for p in points if p.rtt_ms is not None]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([p.rtt_ms for p in split], [p.speedup for p in split], "o-", label="split (drafter behind RTT)")
    for p, style in zip([p for p in points if p.rtt_ms is None], ("--", ":")):
        ax.axhline(p.speedup, linestyle=style, color="gray", label=f"{p.label}: {p.speedup:.2f}x")
    ax.axhline(1.0, color="black", linewidth=0.8)
    if predicted is not None:
        ax.axvline(predicted, color="tab:red", linestyle="--", label=f"predicted break-even {predicted:.1f} ms")
    if measured:
        ax.axvline(measured, color="tab:green", linestyle=":", label=f"measured break-even {measured:.1f} ms")
    ax.set_xlabel("drafter round-trip time (ms)")
    ax.set_ylabel("speedup vs spec-off (tok/s)")
    ax.set_title("specsplit: speculation vs network RTT")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

"""`specsplit bench --topology`: the same workload co-located (shared memory, UNIX socket only, TCP
loopback) and split with an emulated network between the gateway (next to the verifier) and the
drafter, over a sweep of round-trip times, each with and without pre-drafting; speedup vs spec-off,
per-round overhead, pre-draft hit rate, and the break-even RTT measured (where a line fitted to the
sweep's spec-on ms per token meets spec-off's) next to the one predicted from the RTT-0 run
(docs/metrics.md)."""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
from dataclasses import dataclass, field, replace

import grpc

from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc
from specsplit.bench.netem import DelayProxy
from specsplit.bench.workload import Prompt, request, warmup
from specsplit.launcher import Stack, StackConfig

RTTS_MS = (0.0, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0)  # 40: past the break-even on this CPU


MODES = {"off": (pb.SPECULATION_OFF, pb.PREDRAFT_OFF), "on": (pb.SPECULATION_ON, pb.PREDRAFT_OFF),
         "async": (pb.SPECULATION_ON, pb.PREDRAFT_ON)}


@dataclass
class Tally:
    seconds: float = 0.0
    tokens: int = 0
    rounds: int = 0  # round trips (a decode-ahead round is one, whatever its forwards)
    forwards: int = 0  # the verifier's forwards after the prefill
    accepted: int = 0
    attempts: int = 0  # pre-drafts started
    hits: int = 0  # pre-drafts used
    shared_memory: int = 0  # requests whose payloads went through shared memory
    requests: int = 0
    overhead_ms: list = field(default_factory=list)  # per round: network + gateway (wall time - compute)
    first_ms: list = field(default_factory=list)  # the same, first round only (it carries the prompt's features)

    @property
    def ms_per_token(self) -> float:
        return 1e3 * self.seconds / self.tokens

    def add(self, wall: float, out: pb.GenerateResponse) -> None:
        s = out.stats
        self.seconds += wall
        self.tokens += len(out.token_ids)
        self.rounds += s.rounds
        self.forwards += s.forwards or s.rounds
        self.accepted += s.accepted_tokens
        self.attempts += s.predraft_attempts
        self.hits += s.predraft_hits
        self.shared_memory += s.shared_memory
        self.requests += 1
        overhead = [r.network_ms + r.gateway_ms for r in s.round_records]  # specsplit.serving.roundtime
        self.overhead_ms += overhead
        self.first_ms += overhead[:1]


@dataclass
class Point:
    label: str
    rtt_ms: float | None
    modes: dict = field(default_factory=lambda: {m: Tally() for m in MODES})

    def speedup(self, mode: str = "on", off: Tally | None = None) -> float:
        on, off = self.modes[mode], off or self.modes["off"]
        return (on.tokens / on.seconds) / (off.tokens / off.seconds)

    def predicted_break_even(self, off: Tally | None = None) -> float:
        """RTT at which a split drafter's round trips eat the gain (trace-report's formula), from
        this run: each round's Propose pays the RTT on top of what was measured."""
        on, off = self.modes["on"], off or self.modes["off"]
        return max(0.0, (off.ms_per_token - on.ms_per_token) / (on.rounds / on.tokens))


def measure(stub, prompts: list[Prompt], max_new_tokens: int, repeats: int, point: Point) -> Point:
    """Every prompt in every mode, back to back, the order rotating so that drift hits all alike."""
    names = list(MODES)
    for r in range(repeats):
        for i, p in enumerate(prompts):
            k = (i + r) % len(names)
            for mode in names[k:] + names[:k]:
                speculation, predraft = MODES[mode]
                message = request(p, speculation, max_new_tokens)
                message.predraft = predraft
                start = time.perf_counter()
                out = stub.Generate(message, timeout=600)
                point.modes[mode].add(time.perf_counter() - start, out)
    return point


COLOCATED = (("shared memory", "unix", True), ("unix socket", "unix", False), ("tcp loopback", "tcp", False))


def run(prompts: list[Prompt], config: StackConfig, max_new_tokens: int, repeats: int,
        rtts: tuple[float, ...] = RTTS_MS, plot: str | None = None) -> list[Point]:
    points = []
    for label, transport, shared in COLOCATED:
        with Stack(replace(config, transport=transport, shared_memory=shared)) as stack:
            print(f"co-located, {label} ...", file=sys.stderr, flush=True)
            with grpc.insecure_channel(stack.start()) as channel:
                stub = pb_grpc.GatewayStub(channel)
                stub.Generate(request(warmup(prompts), pb.SPECULATION_ON, 16), timeout=600)
                points.append(measure(stub, prompts, max_new_tokens, repeats, Point(label, None)))
    proxy: DelayProxy | None = None

    def via(address: str) -> str:
        nonlocal proxy
        proxy = DelayProxy(address)
        return proxy.start()

    stack = Stack(replace(config, transport="tcp", shared_memory=False))
    try:
        with grpc.insecure_channel(stack.start(draft_via=via)) as channel:
            stub = pb_grpc.GatewayStub(channel)
            stub.Generate(request(warmup(prompts), pb.SPECULATION_ON, 16), timeout=600)
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


def pooled_off(points: list[Point]) -> Tally | None:
    """Spec-off over the whole split sweep: it never reaches the drafter, so every RTT measures the
    same thing, and pooling takes the noise of one point's spec-off out of every comparison."""
    split = [p.modes["off"] for p in points if p.rtt_ms is not None]
    if not split:
        return None
    return Tally(seconds=sum(t.seconds for t in split), tokens=sum(t.tokens for t in split))


def fitted(points: list[Point], mode: str = "on") -> tuple[float, float] | None:
    """Least-squares line through the split sweep's spec-on ms per token against the RTT:
    (intercept ms/token, slope ms/token per ms of RTT); None with fewer than two points."""
    split = [p for p in points if p.rtt_ms is not None]
    if len(split) < 2:
        return None
    line = statistics.linear_regression([p.rtt_ms for p in split], [p.modes[mode].ms_per_token for p in split])
    return line.intercept, line.slope


def measured_break_even(points: list[Point], mode: str = "on") -> float | None:
    """Where the sweep's spec-on ms per token (a line fitted to every RTT, so one noisy point cannot
    decide it) reaches spec-off's (pooled over the sweep); 0 if it loses at RTT 0, None if it does
    not cross within the sweep."""
    off = pooled_off(points)
    split = [p for p in points if p.rtt_ms is not None]
    if off is None or not split:
        return None
    t_off = off.ms_per_token
    line = fitted(points, mode)
    if line is None:
        return 0.0 if split[0].speedup(mode, off) < 1 else None
    intercept, slope = line
    if intercept >= t_off:
        return 0.0
    if slope <= 0 or (t_off - intercept) / slope > max(p.rtt_ms for p in split):
        return None
    return (t_off - intercept) / slope


def report(points: list[Point], plot: str | None) -> None:
    print(f"{'topology':<15}{'RTT ms':>7}{'on/off':>8}{'async/off':>10}{'hit rate':>9}{'acc.len':>8}"
          f"{'overhead/round ms (on, async)':>31}{'1st round':>10}{'shm':>6}")
    off = pooled_off(points)
    for p in points:
        on, ahead = p.modes["on"], p.modes["async"]
        baseline = off if p.rtt_ms is not None else None
        rtt = "-" if p.rtt_ms is None else f"{p.rtt_ms:g}"
        hit = f"{ahead.hits / ahead.attempts:.0%}" if ahead.attempts else "-"
        shm = f"{on.shared_memory}/{on.requests}"
        on_off, async_off = p.speedup("on", baseline), p.speedup("async", baseline)
        print(f"{p.label:<15}{rtt:>7}{on_off:>7.2f}x{async_off:>9.2f}x{hit:>9}"
              f"{(on.accepted + on.forwards) / on.forwards:>8.2f}"
              f"{statistics.median(on.overhead_ms):>19.2f}{statistics.median(ahead.overhead_ms):>12.2f}"
              f"{statistics.median(on.first_ms):>10.2f}{shm:>6}")
    base = next((p for p in points if p.rtt_ms == 0), None)
    predicted = base.predicted_break_even(off) if base else None
    for mode in ("on", "async"):
        measured = measured_break_even(points, mode)
        said = "beyond the sweep" if measured is None else f"{measured:.1f} ms"
        also = ""
        if predicted is not None and mode == "on":
            on = base.modes["on"]
            line = fitted(points, mode)
            slope = f"; fitted slope {line[1]:.2f} ms/token per ms of RTT" if line else ""
            also = (f", predicted from the RTT-0 run {predicted:.1f} ms (rounds per token {on.rounds / on.tokens:.2f}"
                    f"{slope})")
        print(f"break-even RTT ({mode}): measured {said}{also}")
    print("on: speculation; async: speculation with pre-drafting (the next block drafted while Verify is in "
          "flight); hit rate: pre-drafts used / started. overhead/round = round wall time - compute on the "
          "critical path = network + gateway (docs/metrics.md#time, median); 1st round: the same for each "
          "spec-on request's first round, which carries the prompt's features to a drafter that reads them "
          "(median). shm: spec-on requests whose payloads went through shared memory. The split drafter sits "
          "behind a userspace delaying proxy (specsplit/bench/netem.py), the gateway next to the verifier; "
          "split rows compare with spec-off pooled over the sweep (spec-off never reaches the drafter); the "
          "measured break-even is where a line fitted to the sweep's spec-on ms/token meets spec-off's, and "
          "the formula predicts that line's slope to be the rounds per token.")
    if plot and importlib.util.find_spec("matplotlib") is None:
        print(f"plot: not drawn ({plot}): matplotlib is not installed: pip install 'specsplit[plot]'")
    elif plot:
        _plot(points, predicted, measured_break_even(points, "on"), measured_break_even(points, "async"), plot)
        print(f"plot: {plot}")


def _plot(points: list[Point], predicted: float | None, measured: float | None, measured_async: float | None,
          path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    split = [p for p in points if p.rtt_ms is not None]
    fig, ax = plt.subplots(figsize=(7, 4))
    off = pooled_off(points)
    ax.plot([p.rtt_ms for p in split], [p.speedup("on", off) for p in split], "o-", label="split (drafter behind RTT)")
    ax.plot([p.rtt_ms for p in split], [p.speedup("async", off) for p in split], "s-", label="split, pre-drafting")
    for p, style in zip([p for p in points if p.rtt_ms is None], ("--", ":", "-.")):
        ax.axhline(p.speedup(), linestyle=style, color="gray", label=f"co-located, {p.label}: {p.speedup():.2f}x")
    ax.axhline(1.0, color="black", linewidth=0.8)
    if predicted is not None:
        ax.axvline(predicted, color="tab:red", linestyle="--", label=f"predicted break-even {predicted:.1f} ms")
    if measured:
        ax.axvline(measured, color="tab:green", linestyle=":", label=f"measured break-even {measured:.1f} ms")
    if measured_async:
        ax.axvline(measured_async, color="tab:orange", linestyle=":",
                   label=f"measured break-even, pre-drafting {measured_async:.1f} ms")
    ax.set_xlabel("drafter round-trip time (ms)")
    ax.set_ylabel("speedup vs spec-off (tok/s)")
    ax.set_title("specsplit: speculation vs network RTT")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

"""`specsplit soak`: N clients for M minutes against a stack started here (bounded; stops by itself),
optionally with chaos (the draft service SIGKILLed or SIGSTOPped now and then, or the verify service
SIGKILLed, each restarted by the same supervision as `specsplit up`). Every greedy answer is checked
against its spec-off reference; at the end it prints requests, errors (requests lost), latency, the
services' memory at start and end, and what was left behind (sessions, shared-memory segments).
Exit code 0 only if nothing went wrong."""

from __future__ import annotations

import asyncio
import random
import signal
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specsplit.api.draft.v1 import draft_pb2 as dpb
from specsplit.api.draft.v1 import draft_pb2_grpc as dpb_grpc
from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc
from specsplit.api.verify.v1 import verify_pb2 as vpb
from specsplit.api.verify.v1 import verify_pb2_grpc as vpb_grpc
from specsplit.bench.workload import Prompt, Variant, request
from specsplit.launcher import Stack, StackConfig, wait_serving
from specsplit.serving import shm

STALL_S = 2.0  # --chaos stop: how long the draft service stays stopped
CHAOS = {"kill": ("draft", signal.SIGKILL), "stop": ("draft", signal.SIGSTOP),
         "kill-verify": ("verify", signal.SIGKILL),  # --chaos: which service gets which signal
         "term-verify": ("verify", signal.SIGTERM)}  # a rolling restart: it drains, exits, is restarted


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)
    tokens: int = 0
    errors: Counter = field(default_factory=Counter)  # by status code
    mismatches: int = 0  # greedy answers that differ from the spec-off reference
    reasons: Counter = field(default_factory=Counter)  # speculation_reason of the answers
    faults: int = 0  # chaos events
    resumed: int = 0  # answers whose session was re-opened on a verify replica after its own died


def segments() -> set[str]:
    """The shared-memory segments present now (specsplit's naming)."""
    return {p.name for p in shm.shm_dir().glob(f"{shm.PREFIX}*") if shm.is_segment_name(p.name)}


async def _client(stub, prompts: list[Prompt], references: dict[str, list[int]], max_new_tokens: int,
                  deadline: float, tally: Tally, offset: int, drafter: str = "",
                  done: asyncio.Event | None = None) -> None:
    """Requests one after another until the deadline, or (`done`) until one that started after the
    chaos had done its count and the services served again has been answered."""
    i = offset
    while time.monotonic() < deadline:
        last = done is not None and done.is_set()
        p = prompts[i % len(prompts)]
        i += 1
        start = time.monotonic()
        try:
            out = await stub.Generate(request(p, pb.SPECULATION_AUTO, max_new_tokens, Variant(drafter)), timeout=120)
        except grpc.aio.AioRpcError as e:
            tally.errors[e.code().name] += 1
            print(f"soak: {e.code().name}: {e.details()}", file=sys.stderr, flush=True)
            continue
        tally.latencies.append(time.monotonic() - start)
        tally.tokens += len(out.token_ids)
        tally.reasons[out.stats.speculation_reason] += 1
        tally.resumed += out.stats.resumes > 0
        if list(out.token_ids) != references[p.prompt]:
            tally.mismatches += 1
        if last:
            return


async def _chaos(stack: Stack, kind: str, every_s: float, deadline: float, tally: Tally, faults: int = 0,
                 done: asyncio.Event | None = None) -> None:
    """Every ~every_s: SIGKILL the draft service (kill) or a verify replica (kill-verify), SIGTERM a
    verify replica (term-verify: it drains and exits, and is restarted), or SIGSTOP the draft
    service for STALL_S (stop). With `faults`, that many events, then `done` once every service
    serves again."""
    rng = random.Random(0)
    service, sig = CHAOS[kind]
    names = stack.verify_names if service == "verify" else [service]
    while time.monotonic() + every_s < deadline and not (faults and tally.faults >= faults):
        await asyncio.sleep(every_s * rng.uniform(0.5, 1.5))
        if not all([await _serving(stack.addresses[name]) for name in names]):
            continue  # one is still being restarted: one at a time, as a rolling restart goes
        proc = stack.procs[rng.choice(names)]
        tally.faults += 1
        proc.send_signal(sig)
        if sig == signal.SIGSTOP:
            await asyncio.sleep(STALL_S)
            proc.send_signal(signal.SIGCONT)
    if done is not None:
        for name in names:
            await asyncio.to_thread(wait_serving, stack.addresses[name], max(1.0, deadline - time.monotonic()))
        done.set()


async def _serving(address: str) -> bool:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            answer = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.aio.AioRpcError:
            return False
    return answer.status == health_pb2.HealthCheckResponse.SERVING


async def _supervise(stack: Stack, stop: asyncio.Event) -> None:
    while not stop.is_set():
        for event in stack.supervise():
            print(f"soak: {event.splitlines()[0]}", file=sys.stderr, flush=True)
        await asyncio.sleep(0.2)


async def _left(stack: Stack, before: set[str]) -> tuple[tuple[int, int], int]:
    """((sessions still open on the verify replicas, on the draft service), shared-memory segments
    made since `before` still present) once the releases have run: the gateway unlinks a session's
    segment in its release, after both services' (bounded: 5 s)."""
    verifiers = [grpc.aio.insecure_channel(stack.addresses[name]) for name in stack.verify_names]
    async with grpc.aio.insecure_channel(stack.addresses["draft"]) as d:
        counts, extra = (-1, -1), -1
        for _ in range(50):
            held = [(await vpb_grpc.VerifierStub(v).Info(vpb.InfoRequest(), timeout=10)).active_sessions
                    for v in verifiers]
            counts = (sum(held), (await dpb_grpc.DrafterStub(d).Info(dpb.InfoRequest(), timeout=10)).active_sessions)
            extra = len(segments() - before)
            if counts == (0, 0) and not extra:
                break
            await asyncio.sleep(0.1)
    for v in verifiers:
        await v.close()
    return counts, extra


async def soak(stack: Stack, prompts: list[Prompt], clients: int, minutes: float, max_new_tokens: int,
               chaos: str = "", chaos_every_s: float = 10.0, drafter: str = "", faults: int = 0) -> dict:
    """`clients` clients for `minutes`; with `chaos` and `faults`, until that many chaos events have
    happened and every client has been answered after the services recovered (minutes: the bound)."""
    before = segments()
    tally = Tally()
    async with grpc.aio.insecure_channel(stack.addresses["gateway"]) as channel:
        stub = pb_grpc.GatewayStub(channel)
        references = {}
        for p in prompts:  # the spec-off answers (greedy: speculation must reproduce them)
            out = await stub.Generate(request(p, pb.SPECULATION_OFF, max_new_tokens), timeout=300)
            references[p.prompt] = list(out.token_ids)
        rss_start = {name: stack.rss_mib(name) for name in stack.procs}
        stop = asyncio.Event()
        supervisor = asyncio.ensure_future(_supervise(stack, stop))
        deadline = time.monotonic() + minutes * 60
        started = time.monotonic()
        counted = asyncio.Event() if chaos and faults else None
        work = [_client(stub, prompts, references, max_new_tokens, deadline, tally, k, drafter, counted)
                for k in range(clients)]
        if chaos:
            work.append(_chaos(stack, chaos, chaos_every_s, deadline, tally, faults, counted))
        await asyncio.gather(*work)
        elapsed = time.monotonic() - started
        # A kill just before the end: the supervisor goes on until every service serves again (a
        # process just SIGKILLed may not have exited yet, so being alive is not enough).
        for name in ("draft", *stack.verify_names):
            await asyncio.to_thread(wait_serving, stack.addresses[name], 120)
        stop.set()
        await supervisor
    rss_end = {name: stack.rss_mib(name) for name in stack.procs}
    sessions, segments_left = await _left(stack, before)
    lat = sorted(tally.latencies)
    return {"clients": clients, "seconds": elapsed, "requests": len(lat), "errors": dict(tally.errors),
            "mismatches": tally.mismatches, "faults": tally.faults, "reasons": dict(tally.reasons),
            "resumed": tally.resumed,
            "p50_s": statistics.median(lat) if lat else 0.0,
            "p95_s": lat[int(0.95 * (len(lat) - 1))] if lat else 0.0,
            "tokens_per_s": tally.tokens / elapsed if elapsed else 0.0,
            "rss_mib": {n: (rss_start[n], rss_end[n]) for n in rss_start},
            "sessions_left": {"verify": sessions[0], "draft": sessions[1]},
            "segments_left": segments_left}


def report(r: dict, chaos: str) -> str:
    lines = [f"soak: {r['clients']} clients for {r['seconds']:.0f} s" + (f", chaos: {chaos} x{r['faults']}"
                                                                          if chaos else ""),
             f"requests {r['requests']}, errors (requests lost) {sum(r['errors'].values())} {r['errors'] or ''}, "
             f"answers differing from spec-off {r['mismatches']}; resumed {r['resumed']} request(s) whose verify "
             "replica died",
             f"latency P50 {r['p50_s']:.2f} s, P95 {r['p95_s']:.2f} s; {r['tokens_per_s']:.1f} tok/s in all",
             "speculation_reason: " + ", ".join(f"{k} {v}" for k, v in sorted(r["reasons"].items())),
             f"{'RSS MiB':<10}{'start':>8}{'end':>8}{'drift':>8}"]
    for name, (start, end) in r["rss_mib"].items():
        lines.append(f"{name:<10}{start:>8.0f}{end:>8.0f}{(end - start) / start:>+8.1%}")
    lines.append(f"left at the end: sessions verify {r['sessions_left']['verify']}, draft "
                 f"{r['sessions_left']['draft']}; shared-memory segments {r['segments_left']}")
    return "\n".join(lines)


def healthy(r: dict) -> bool:
    return (r["requests"] > 0 and not r["errors"] and not r["mismatches"] and r["segments_left"] == 0
            and not any(r["sessions_left"].values()))


def main(args, config: StackConfig, prompts: list[Prompt]) -> int:
    if args.clients < 1 or args.minutes <= 0:
        raise ValueError("--clients must be at least 1 and --minutes above 0")
    with Stack(config) as stack:
        print(f"starting verify, draft and gateway over {config.transport} ...", file=sys.stderr, flush=True)
        stack.start()
        result = asyncio.run(soak(stack, prompts, args.clients, args.minutes, args.max_new_tokens, args.chaos,
                                  args.chaos_every, args.request_drafter, args.faults))
    print(report(result, args.chaos), flush=True)
    return 0 if healthy(result) else 1

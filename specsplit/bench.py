"""`specsplit bench`: every prompt with speculation off and on, back to back through the real
services, summarised per task type."""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

import grpc

from specsplit.gateway.v1 import gateway_pb2 as pb
from specsplit.gateway.v1 import gateway_pb2_grpc as pb_grpc
from specsplit.launcher import Stack, StackConfig


@dataclass(frozen=True)
class Prompt:
    task_type: str
    prompt: str


@dataclass
class Record:
    task_type: str
    prompt: str
    off_s: float  # median client wall time, speculation off
    on_s: float
    off_tokens: int
    on_tokens: int
    rounds: int
    drafted: int
    accepted: int
    draft_ms: float
    verify_ms: float
    network_ms: float
    identical: bool
    first_divergence: int  # index of the first differing token, -1 when identical
    off_runs: list[float]  # every client wall time (s), speculation off
    on_runs: list[float]


def load_prompts(path: str | None, limit: int = 0) -> list[Prompt]:
    text = Path(path).read_text() if path else \
        resources.files("specsplit.data").joinpath("starter_prompts.jsonl").read_text()
    prompts = [Prompt(**json.loads(line)) for line in text.splitlines() if line.strip()]
    if limit:
        seen: dict[str, int] = defaultdict(int)
        kept = []
        for p in prompts:
            seen[p.task_type] += 1
            if seen[p.task_type] <= limit:
                kept.append(p)
        prompts = kept
    return prompts


def first_divergence(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


def _request(p: Prompt, speculation: int, max_new_tokens: int) -> pb.GenerateRequest:
    req = pb.GenerateRequest(max_new_tokens=max_new_tokens, speculation=speculation, task_type=p.task_type)
    req.chat.messages.add(role="user", content=p.prompt)
    return req


def run_prompt(stub, p: Prompt, max_new_tokens: int, repeats: int) -> Record:
    times: dict[int, list[float]] = {pb.SPECULATION_OFF: [], pb.SPECULATION_ON: []}
    last: dict[int, pb.GenerateResponse] = {}
    for _ in range(repeats):
        for mode in (pb.SPECULATION_OFF, pb.SPECULATION_ON):  # back to back: noise hits both alike
            start = time.perf_counter()
            last[mode] = stub.Generate(_request(p, mode, max_new_tokens), timeout=600)
            times[mode].append(time.perf_counter() - start)
    off, on = last[pb.SPECULATION_OFF], last[pb.SPECULATION_ON]
    s = on.stats
    div = first_divergence(list(off.token_ids), list(on.token_ids))
    return Record(p.task_type, p.prompt, statistics.median(times[pb.SPECULATION_OFF]),
                  statistics.median(times[pb.SPECULATION_ON]), len(off.token_ids), len(on.token_ids),
                  s.rounds, s.drafted_tokens, s.accepted_tokens, s.draft_ms, s.verify_ms, s.network_ms,
                  div < 0, div, times[pb.SPECULATION_OFF], times[pb.SPECULATION_ON])


def p95(values: list[float]) -> float:
    """Nearest-rank 95th percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def summarise(records: list[Record]) -> list[dict]:
    groups: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        groups[r.task_type].append(r)
    groups["ALL"] = list(records)
    rows = []
    for task, rs in groups.items():
        off_rate = sum(r.off_tokens for r in rs) / sum(r.off_s for r in rs)
        on_rate = sum(r.on_tokens for r in rs) / sum(r.on_s for r in rs)
        rounds = sum(r.rounds for r in rs)
        on_ms = sum(r.on_s for r in rs) * 1e3
        rows.append({
            "task_type": task, "prompts": len(rs), "tok_s_off": off_rate, "tok_s_on": on_rate,
            "speedup": on_rate / off_rate,
            "acceptance_length": (sum(r.accepted for r in rs) + rounds) / rounds if rounds else 0.0,
            "drafted_per_round": sum(r.drafted for r in rs) / rounds if rounds else 0.0,
            "identical": sum(r.identical for r in rs),
            "first_divergence": [r.first_divergence for r in rs if not r.identical],
            "draft_share": sum(r.draft_ms for r in rs) / on_ms,
            "verify_share": sum(r.verify_ms for r in rs) / on_ms,
            "network_share": sum(r.network_ms for r in rs) / on_ms,
            "p95_off_s": p95([t for r in rs for t in r.off_runs]),
            "p95_on_s": p95([t for r in rs for t in r.on_runs]),
        })
    return rows


def print_table(rows: list[dict], header: str, out=sys.stdout) -> None:
    print(header, file=out)
    cols = (f"{'task type':<11}{'n':>3}{'tok/s off':>11}{'tok/s on':>10}{'on/off':>8}{'acc.len':>9}{'drafted':>9}"
            f"{'identical':>11}{'draft%':>8}{'verify%':>9}{'net%':>6}{'p95 off/on s':>14}  first divergence")
    print(cols, file=out)
    for r in rows:
        print(f"{r['task_type']:<11}{r['prompts']:>3}{r['tok_s_off']:>11.1f}{r['tok_s_on']:>10.1f}"
              f"{r['speedup']:>7.2f}x{r['acceptance_length']:>9.2f}{r['drafted_per_round']:>9.2f}"
              f"{r['identical']:>7}/{r['prompts']:<3}{100 * r['draft_share']:>8.1f}{100 * r['verify_share']:>9.1f}"
              f"{100 * r['network_share']:>6.1f}{r['p95_off_s']:>8.2f}/{r['p95_on_s']:<5.2f}"
              f"  {r['first_divergence'] or '-'}", file=out)


def main(args, config: StackConfig) -> int:
    prompts = load_prompts(args.prompts, args.limit)
    stack = None
    try:
        if args.gateway:
            address = args.gateway
        else:
            stack = Stack(config)
            print(f"starting verify, draft and gateway over {config.transport} ...", file=sys.stderr, flush=True)
            address = stack.start()
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.GatewayStub(channel)
            warm = _request(prompts[0], pb.SPECULATION_ON, 16)
            stub.Generate(warm, timeout=600)
            records = []
            for i, p in enumerate(prompts, 1):
                records.append(run_prompt(stub, p, args.max_new_tokens, args.repeats))
                r = records[-1]
                print(f"[{i}/{len(prompts)}] {p.task_type:<10} off {r.off_tokens / r.off_s:5.1f} tok/s  "
                      f"on {r.on_tokens / r.on_s:5.1f} tok/s  acc.len {(r.accepted + r.rounds) / max(1, r.rounds):.2f}"
                      f"  {'identical' if r.identical else f'DIVERGES at {r.first_divergence}'}",
                      file=sys.stderr, flush=True)
            info = stub.Generate(_request(prompts[0], pb.SPECULATION_ON, 1), timeout=600).stats
    finally:
        if stack is not None:
            stack.stop()
    rows = summarise(records)
    exact = "exact numerics" if info.exact else "INEXACT numerics (spec on may differ from off)"
    where = f"transport={config.transport}, target dtype={config.dtype}" if stack else f"gateway={address}"
    header = (f"specsplit bench: {len(prompts)} prompts, max_new_tokens={args.max_new_tokens}, "
              f"repeats={args.repeats}, drafter={info.drafter}, gamma={info.gamma}, {where}, {exact}")
    print_table(rows, header)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"header": header, "summary": rows,
                                                   "records": [asdict(r) for r in records]}, indent=1))
    return 0

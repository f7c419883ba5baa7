"""`specsplit bench`: every prompt with speculation off and on, back to back through the real
services, summarised per task type."""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import grpc

from gateway.controller import p95
from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc
from specsplit.serving import roundtime
from specsplit.tools.launcher import Stack, StackConfig
from specsplit.tools.workload import REQUEST, Prompt, Variant, load_prompts, request, warmup


@dataclass
class Record:
    task_type: str
    prompt: str
    drafter: str
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
    target_step_ms: float = 0.0  # verify forward per token with speculation off (one target step)
    by_source: dict = None  # draft source -> [rounds, drafted, accepted] (which part of a hybrid drafted)
    proposal_bytes: int = 0  # draft distributions sent (rejection sampling), all rounds
    predraft: tuple[int, int] = (0, 0)  # pre-drafts started, used (--predraft on)
    off_ids: list[int] = None  # the spec-off output's token ids
    parts: dict = None  # the last spec-on run's time by part (specsplit.serving.roundtime.request_split), ms
    by_depth: list = None  # per draft depth d (1, 2, ...): [rounds that drafted that deep, rounds that accepted d]


def depth_counts(rounds) -> list[list[int]]:
    """Per-position acceptance from round records: at depth d (1-based), the rounds whose draft
    (chain or tree) reached d and those whose accepted path did."""
    counts: list[list[int]] = []
    for r in rounds:
        depth = r.depth or r.drafted
        while len(counts) < depth:
            counts.append([0, 0])
        for d in range(depth):
            counts[d][0] += 1
            counts[d][1] += r.accepted > d
    return counts


def first_divergence(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


def run_prompt(stub, p: Prompt, max_new_tokens: int, repeats: int, drafters: list[Variant],
               also=lambda: None) -> list[Record]:
    """Speculation off, then on with each variant, then `also()` (the anchor), back to back (noise
    hits all alike); one record per variant, all compared with the same spec-off runs (coupled
    sampler at temperature > 0)."""
    off_times: list[float] = []
    on_times: dict[Variant, list[float]] = {d: [] for d in drafters}
    last: dict[Variant, pb.GenerateResponse] = {}
    for _ in range(repeats):
        start = time.perf_counter()
        off = stub.Generate(request(p, pb.SPECULATION_OFF, max_new_tokens), timeout=600)
        off_times.append(time.perf_counter() - start)
        for d in drafters:
            start = time.perf_counter()
            last[d] = stub.Generate(request(p, pb.SPECULATION_ON, max_new_tokens, d), timeout=600)
            on_times[d].append(time.perf_counter() - start)
        also()
    step_ms = off.stats.verify_ms / off.stats.rounds if off.stats.rounds else 0.0
    records = []
    for d in drafters:
        on, s = last[d], last[d].stats
        by_source: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        for r in s.round_records:
            counts = by_source[r.draft_source or "none"]
            counts[0] += 1
            counts[1] += r.drafted
            counts[2] += r.accepted
        div = first_divergence(list(off.token_ids), list(on.token_ids))
        label = f"{s.drafter}/{d.method}" if d.method else s.drafter
        label += f"+tree{s.tree_budget}" if s.tree_budget else ""
        records.append(Record(p.task_type, p.prompt, label,
                              statistics.median(off_times),
                              statistics.median(on_times[d]), len(off.token_ids), len(on.token_ids),
                              s.rounds, s.drafted_tokens, s.accepted_tokens, s.draft_ms, s.verify_ms, s.network_ms,
                              div < 0, div, off_times, on_times[d], step_ms, dict(by_source),
                              sum(r.proposal_bytes for r in s.round_records),
                              (s.predraft_attempts, s.predraft_hits), list(off.token_ids),
                              {"total": s.total_ms, **roundtime.request_split(
                                  s.total_ms, s.prefill_compute_ms, s.prefill_ms - s.prefill_compute_ms,
                                  s.round_records)}, depth_counts(s.round_records)))
    return records


def summarise(records: list[Record]) -> list[dict]:
    """One row per (drafter, task type), plus ALL per drafter."""
    groups: dict[tuple[str, str], list[Record]] = defaultdict(list)
    for r in records:
        groups[(r.drafter, r.task_type)].append(r)
        groups[(r.drafter, "ALL")].append(r)
    rows = []
    # Drafters and task types in the order met, ALL last per drafter.
    order = {key: i for i, key in enumerate(groups)}
    drafters = {d: i for i, (d, _) in reversed(list(enumerate(groups)))}
    for (drafter, task), rs in sorted(groups.items(), key=lambda g: (drafters[g[0][0]], g[0][1] == "ALL", order[g[0]])):
        off_rate = sum(r.off_tokens for r in rs) / sum(r.off_s for r in rs)
        on_rate = sum(r.on_tokens for r in rs) / sum(r.on_s for r in rs)
        rounds = sum(r.rounds for r in rs)
        drafted = sum(r.drafted for r in rs)
        steps = [r.target_step_ms for r in rs if r.target_step_ms > 0]
        draft_ms_per_token = sum(r.draft_ms for r in rs) / drafted if drafted else 0.0
        rows.append({
            "drafter": drafter, "task_type": task, "prompts": len(rs), "tok_s_off": off_rate, "tok_s_on": on_rate,
            "speedup": on_rate / off_rate,
            "acceptance_length": (sum(r.accepted for r in rs) + rounds) / rounds if rounds else 0.0,
            "drafted_per_round": sum(r.drafted for r in rs) / rounds if rounds else 0.0,
            "identical": sum(r.identical for r in rs),
            "first_divergence": [r.first_divergence for r in rs if not r.identical],
            **{f"{k}_share": sum(r.parts[k] for r in rs) / sum(r.parts["total"] for r in rs)
               for k in ("draft", "verify", "network", "gateway")},
            "p95_off_s": p95([t for r in rs for t in r.off_runs]),
            "p95_on_s": p95([t for r in rs for t in r.on_runs]),
            "draft_ms_per_token": draft_ms_per_token,
            "target_step_ms": statistics.median(steps) if steps else 0.0,
            "draft_cost_ratio": draft_ms_per_token / statistics.median(steps) if steps else 0.0,
            "by_source": _merge_sources(rs),
            "by_depth": _merge_depths(rs),
            "proposal_bytes_per_round": sum(r.proposal_bytes for r in rs) / rounds if rounds else 0.0,
            "predraft_attempts": sum(r.predraft[0] for r in rs), "predraft_hits": sum(r.predraft[1] for r in rs),
        })
    return rows


def _merge_depths(records: list[Record]) -> list[list[int]]:
    merged: list[list[int]] = []
    for r in records:
        for d, (n, hit) in enumerate(r.by_depth or []):
            if d == len(merged):
                merged.append([0, 0])
            merged[d][0] += n
            merged[d][1] += hit
    return merged


def _merge_sources(records: list[Record]) -> dict[str, list[int]]:
    merged: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for r in records:
        for source, counts in (r.by_source or {}).items():
            merged[source] = [a + b for a, b in zip(merged[source], counts)]
    return dict(merged)


def print_table(rows: list[dict], header: str, memory: dict[str, int] | None = None, out=sys.stdout) -> None:
    print(header, file=out)
    width = max(8, *(len(r["drafter"]) + 1 for r in rows))
    cols = (f"{'drafter':<{width}}{'task type':<11}{'n':>3}{'tok/s off':>10}{'tok/s on':>9}{'on/off':>8}{'acc.len':>8}"
            f"{'drafted':>8}{'cost':>7}{'identical':>10}{'draft%':>7}{'verify%':>8}{'net%':>6}{'gw%':>5}"
            f"{'p95 off/on s':>14}"
            "  first divergence")
    print(cols, file=out)
    for r in rows:
        print(f"{r['drafter']:<{width}}{r['task_type']:<11}{r['prompts']:>3}{r['tok_s_off']:>10.1f}{r['tok_s_on']:>9.1f}"
              f"{r['speedup']:>7.2f}x{r['acceptance_length']:>8.2f}{r['drafted_per_round']:>8.2f}"
              f"{r['draft_cost_ratio']:>7.3f}{r['identical']:>6}/{r['prompts']:<3}{100 * r['draft_share']:>7.1f}"
              f"{100 * r['verify_share']:>8.1f}{100 * r['network_share']:>6.1f}{100 * r['gateway_share']:>5.1f}"
              f"{r['p95_off_s']:>8.2f}/{r['p95_on_s']:<5.2f}  {r['first_divergence'] or '-'}", file=out)
    print("cost = draft time per drafted token / one target step (spec-off verify per token)", file=out)
    mixes = [(r["drafter"], r["by_source"]) for r in rows if r["task_type"] == "ALL" and len(r["by_source"]) > 1]
    for drafter, mix in mixes:
        parts = [f"{src} {n} rounds acc.len {(acc + n) / n:.2f}" for src, (n, _, acc) in sorted(mix.items()) if n]
        print(f"{drafter} rounds by source: " + "; ".join(parts), file=out)
    for r in rows:
        if r["task_type"] == "ALL" and r["by_depth"]:
            print(f"{r['drafter']} acceptance by draft position (accepted / drafted that deep): " + " ".join(
                f"{d}:{hit / n:.0%}" for d, (n, hit) in enumerate(r["by_depth"], 1) if n), file=out)
    for r in rows:
        if r["task_type"] == "ALL" and r["proposal_bytes_per_round"]:
            print(f"{r['drafter']}: draft distributions sent {r['proposal_bytes_per_round']:.0f} bytes per round",
                  file=out)
    hits = [f"{r['task_type']} {r['predraft_hits']}/{r['predraft_attempts']} "
            f"({r['predraft_hits'] / r['predraft_attempts']:.0%})" for r in rows if r["predraft_attempts"]]
    if hits:
        print("pre-drafts used/started per round that could pre-draft: " + ", ".join(hits), file=out)
    if any(r["drafter"].endswith("/rejection") for r in rows):
        print("rejection verification samples a different (equally distributed) text: 'identical' "
              "applies to greedy and coupled", file=out)
    if memory:
        print("draft memory: " + ", ".join(f"{name} {mb / 2**20:.1f} MiB" for name, mb in memory.items()), file=out)


def _draft_memory(address: str) -> dict[str, int]:
    from specsplit.api.draft.v1 import draft_pb2 as dpb
    from specsplit.api.draft.v1 import draft_pb2_grpc as dpb_grpc

    with grpc.insecure_channel(address) as channel:
        info = dpb_grpc.DrafterStub(channel).Info(dpb.InfoRequest(), timeout=10)
    return {d.name: d.memory_bytes for d in info.drafters}


def tracing_overhead(prompts: list[Prompt], config: StackConfig, max_new_tokens: int, repeats: int) -> int:
    """The same spec-on requests against two stacks, tracing off and on (OTLP-JSON file export),
    alternating request by request so that machine noise hits both alike."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="specsplit-trace-overhead-") as tmp:
        configs = {"off": replace(config, trace_file=None),
                   "on": replace(config, trace_file=str(Path(tmp) / "traces.jsonl"))}
        stacks = {k: Stack(c) for k, c in configs.items()}
        times: dict[str, list[float]] = {"off": [], "on": []}
        tokens = 0
        try:
            print("starting two stacks (tracing off, tracing on) ...", file=sys.stderr, flush=True)
            channels = {k: grpc.insecure_channel(s.start()) for k, s in stacks.items()}
            stubs = {k: pb_grpc.GatewayStub(c) for k, c in channels.items()}
            for stub in stubs.values():
                stub.Generate(request(warmup(prompts), pb.SPECULATION_ON, 16), timeout=600)
            for i, p in enumerate(prompts, 1):
                for r in range(repeats):
                    for mode in (("off", "on") if (i + r) % 2 else ("on", "off")):
                        start = time.perf_counter()
                        out = stubs[mode].Generate(request(p, pb.SPECULATION_ON, max_new_tokens), timeout=600)
                        times[mode].append((time.perf_counter() - start) / max(1, len(out.token_ids)))
                        tokens += len(out.token_ids)
                print(f"[{i}/{len(prompts)}] {p.task_type}", file=sys.stderr, flush=True)
            for c in channels.values():
                c.close()
        finally:
            for s in stacks.values():
                s.stop()
        spans = sum(1 for _ in open(configs["on"].trace_file)) if Path(configs["on"].trace_file).exists() else 0
    ratios = [b / a for a, b in zip(times["off"], times["on"])]
    print(f"tracing overhead: {len(ratios)} request pairs, {tokens} tokens; median ms/token tracing off "
          f"{1e3 * statistics.median(times['off']):.2f}, on {1e3 * statistics.median(times['on']):.2f}; "
          f"median per-request ratio on/off {statistics.median(ratios):.3f} "
          f"(p25 {statistics.quantiles(ratios, n=4)[0]:.3f}, p75 {statistics.quantiles(ratios, n=4)[2]:.3f}); "
          f"{spans} export batches written")
    return 0


def controlled(stub, prompts: list[Prompt], max_new_tokens: int, repeats: int, learn: int) -> int:
    """The controller at work: `learn` passes of AUTO requests over the workload (it measures and
    decides per task type), then per prompt spec-off, forced spec-on and AUTO back to back."""
    for n in range(learn):
        for i, p in enumerate(prompts, 1):
            out = stub.Generate(request(p, pb.SPECULATION_AUTO, max_new_tokens), timeout=600)
            print(f"learn {n + 1}/{learn} [{i}/{len(prompts)}] {p.task_type:<10} "
                  f"{out.stats.speculation_reason:<9} gamma {out.stats.gamma}", file=sys.stderr, flush=True)
    modes = {"off": pb.SPECULATION_OFF, "on": pb.SPECULATION_ON, "auto": pb.SPECULATION_AUTO}
    totals: dict[str, dict[str, list[float]]] = defaultdict(lambda: {m: [0.0, 0] for m in modes})
    reasons: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in range(repeats):
        for i, p in enumerate(prompts, 1):
            order = list(modes) if (i + r) % 2 else list(reversed(modes))
            for mode in order:
                start = time.perf_counter()
                out = stub.Generate(request(p, modes[mode], max_new_tokens), timeout=600)
                for key in (p.task_type, "ALL"):
                    totals[key][mode][0] += time.perf_counter() - start
                    totals[key][mode][1] += len(out.token_ids)
                if mode == "auto":
                    reasons[p.task_type][f"{out.stats.speculation_reason}/g{out.stats.gamma}"] += 1
            print(f"measure [{i}/{len(prompts)}] {p.task_type}", file=sys.stderr, flush=True)
    print(f"specsplit bench --controlled: {len(prompts)} prompts, max_new_tokens={max_new_tokens}, "
          f"learn passes={learn}, measured repeats={repeats}")
    print(f"{'task type':<12}{'tok/s off':>10}{'forced on':>10}{'auto':>8}{'on/off':>8}{'auto/off':>9}  auto decisions")
    for task, t in sorted(totals.items(), key=lambda kv: (kv[0] == "ALL", kv[0])):
        rate = {m: n / s for m, (s, n) in t.items()}
        print(f"{task:<12}{rate['off']:>10.1f}{rate['on']:>10.1f}{rate['auto']:>8.1f}{rate['on'] / rate['off']:>7.2f}x"
              f"{rate['auto'] / rate['off']:>8.2f}x  {dict(reasons.get(task, {})) or ''}")
    return 0


@contextlib.contextmanager
def gateway_stub(address: str | None, config: StackConfig, token_file: str | None = None):
    """(stub, stack): a stub for the gateway at `address` (sending the bearer token in `token_file`,
    if any), or for a stack started here from `config` (stack None otherwise); the stack is
    stopped on exit."""
    from gateway.access import with_token

    stack = None
    try:
        if not address:
            stack = Stack(config)
            print(f"starting verify, draft and gateway over {config.transport} ...", file=sys.stderr, flush=True)
            address = stack.start()
        with grpc.insecure_channel(address) as channel:
            yield pb_grpc.GatewayStub(with_token(channel, token_file if not stack else None)), stack
    finally:
        if stack is not None:
            stack.stop()


def main(args, config: StackConfig) -> int:
    prompts = load_prompts(args.prompts, args.limit)
    REQUEST.update(temperature=args.temperature, seed=args.seed,
                   predraft={"off": pb.PREDRAFT_OFF, "on": pb.PREDRAFT_ON, "auto": pb.PREDRAFT_DEFAULT}[args.predraft])
    if args.round_overhead:
        from specsplit.tools import roundoverhead

        roundoverhead.run()
        return 0
    if args.tracing_overhead:
        return tracing_overhead(prompts, config, args.max_new_tokens, args.repeats)
    if args.topology:
        from specsplit.tools import topology

        rtts = args.rtts or topology.RTTS_MS
        topology.run(prompts, config, args.max_new_tokens, args.repeats, rtts, args.plot)
        return 0
    if args.controlled:
        with gateway_stub(args.gateway, config, args.auth_token_file) as (stub, _):
            return controlled(stub, prompts, args.max_new_tokens, args.repeats, args.controlled)
    if args.long_context:
        from specsplit.model import catalog
        from specsplit.model.fastllama import kernel_name
        from specsplit.model.modeling import parse_dtype
        from specsplit.tools import longcontext

        with gateway_stub(args.gateway, config, args.auth_token_file) as (stub, _):
            return longcontext.run(stub, str(catalog.resolve(config.target_model)), config.dtype, args.max_new_tokens,
                                   kernel_name(config.quantize, parse_dtype(config.dtype)))
    if args.concurrency:
        from specsplit.tools import concurrency

        with gateway_stub(args.gateway, config, args.auth_token_file) as (stub, _):
            variant = Variant(args.drafters[0] if args.drafters else "")
            stub.Generate(request(warmup(prompts), pb.SPECULATION_ON, 16, variant), timeout=600)
            return concurrency.run(stub, prompts, list(args.concurrency), args.max_new_tokens, variant,
                                   args.requests)
    anchor, anchored, profile, llama = None, [], None, None
    if args.anchor_llama_cpp or args.anchor and args.temperature <= 0:
        from specsplit.model import catalog
        from specsplit.tools import anchor as anchoring

        model_dir = str(catalog.resolve(config.target_model))
        print("measuring the target step ...", file=sys.stderr, flush=True)
        profile = anchoring.step_profile(model_dir, config.dtype, config.quantize)
    if args.anchor_llama_cpp:
        from specsplit.tools import llamacpp

        print("running llama.cpp's llama-bench on the same GGUF file ...", file=sys.stderr, flush=True)
        llama = llamacpp.decode_tok_s(args.anchor_llama_cpp, Path(model_dir) / "model.gguf")
    if args.anchor and args.temperature > 0:
        print("--anchor compares greedy decoding: not run at temperature > 0", file=sys.stderr)
    elif args.anchor:
        print("loading transformers' own model ...", file=sys.stderr, flush=True)
        draft_dir = str(catalog.resolve(config.draft_model)) if config.draft_model else None
        anchor = anchoring.Anchor(model_dir, config.dtype, draft_dir)
        anchor.warmup(prompts[0].prompt)
    with gateway_stub(args.gateway, config, args.auth_token_file) as (stub, stack):
        names = list(args.drafters)
        if not names:  # every drafter the stack's draft service hosts; else the gateway's default
            names = list(_draft_memory(stack.addresses["draft"])) if stack else [""]
        methods = list(args.methods) if args.temperature > 0 else [""]
        trees = list(args.tree_budgets) or [0]
        drafters = [Variant(n, m, t) for n in names for m in methods for t in trees]
        for d in drafters:
            stub.Generate(request(warmup(prompts), pb.SPECULATION_ON, 16, d), timeout=600)
        records = []
        for i, p in enumerate(prompts, 1):
            also = lambda: None  # noqa: E731
            if anchor is not None:
                anchored.append(anchoring.AnchorRecord(p.task_type))
                also = lambda: anchor.run(anchored[-1], p.prompt, args.max_new_tokens)  # noqa: E731
            for r in run_prompt(stub, p, args.max_new_tokens, args.repeats, drafters, also):
                records.append(r)
                print(f"[{i}/{len(prompts)}] {p.task_type:<10} {r.drafter:<16} off {r.off_tokens / r.off_s:5.1f} "
                      f"tok/s  on {r.on_tokens / r.on_s:5.1f} tok/s  "
                      f"acc.len {(r.accepted + r.rounds) / max(1, r.rounds):.2f}"
                      f"  {'identical' if r.identical else f'DIVERGES at {r.first_divergence}'}",
                      file=sys.stderr, flush=True)
        info = stub.Generate(request(warmup(prompts), pb.SPECULATION_ON, 1, drafters[0]), timeout=600).stats
        memory = _draft_memory(stack.addresses["draft"]) if stack else None
    rows = summarise(records)
    exact = "exact numerics" if info.exact else "INEXACT numerics (spec on may differ from off)"
    weights = f"{config.dtype} with {config.quantize} weights" if config.quantize else config.dtype
    where = (f"transport={config.transport}, target {weights}, output store={config.store_tokens} tokens"
             if stack else f"gateway={args.gateway}")
    sampling = f"temperature={args.temperature}, seed={args.seed}" if args.temperature > 0 else "greedy"
    header = (f"specsplit bench: {len(prompts)} prompts, max_new_tokens={args.max_new_tokens}, "
              f"repeats={args.repeats}, gamma={info.gamma}, {sampling}, {where}, {exact}")
    if profile:
        header += (f"\ntarget forward ({profile['kernels']}): 1-row step {profile['rows1_ms']:.2f} ms, "
                   f"5-row verify {profile['rows5_ms']:.2f} ms ({profile['rows5_ms'] / profile['rows1_ms']:.2f}x), "
                   "128-token context")
    if llama:
        ours = 1e3 / profile["rows1_ms"]
        header += (f"\nllama.cpp (llama-bench -t 2 -p 0 -n 96, the same GGUF file, run before the stack): decode "
                   f"{llama:.1f} tok/s; ours {ours:.1f} tok/s from the 1-row step ({ours / llama:.2f}x); "
                   f"end-to-end rows below include prefill")
    print_table(rows, header, memory)
    if anchor is not None:
        anchoring.print_table(anchor, anchored, rows, records)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"header": header, "summary": rows,
                                                   "records": [asdict(r) for r in records]}, indent=1))
    return 0

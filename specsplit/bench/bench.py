"""`specsplit bench`: every prompt with speculation off and on, back to back through the real
services, summarised per task type."""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import grpc

from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc
from specsplit.bench.controlled import BUSY, Neighbours, busy_spell, controlled, print_neighbour
from specsplit.bench.records import Record, depth_counts, first_divergence, print_table, summarise
from specsplit.bench.workload import DEFAULT_REQUEST, REQUEST, Prompt, Variant, load_prompts, request, warmup
from specsplit.launcher import Stack, StackConfig, gateway_stub
from specsplit.serving import roundtime


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
    forwards = sum(1 + r.decoded for r in off.stats.round_records)  # a decode-ahead round runs 1 + decoded
    step_ms = off.stats.verify_ms / forwards if forwards else 0.0
    records = []
    for d in drafters:
        on, s = last[d], last[d].stats
        by_source: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        for r in s.round_records:
            counts = by_source[r.draft_source or "none"]
            counts[0] += 1
            counts[1] += r.drafted
            counts[2] += r.accepted
            # the verifier's own drafts, per step, by where they were drafted (no process crossed)
            for source, steps, drafted, accepted in (("verify:lookup", r.lookup_steps, r.lookup_drafted,
                                                       r.lookup_accepted),
                                                      ("verify:head", r.head_steps, r.head_drafted, r.head_accepted)):
                if steps:
                    counts = by_source[source]
                    counts[0] += steps
                    counts[1] += drafted
                    counts[2] += accepted
        div = first_divergence(list(off.token_ids), list(on.token_ids))
        if d.drafter == DEFAULT_REQUEST:
            label = d.label  # whatever AUTO chose, round by round
        else:
            label = f"{s.drafter}/{d.method}" if d.method else s.drafter
            label += f"+tree{s.tree_budget}" if s.tree_budget else ""
        records.append(Record(p.task_type, p.prompt, label,
                              statistics.median(off_times),
                              statistics.median(on_times[d]), len(off.token_ids), len(on.token_ids),
                              s.forwards or s.rounds, s.drafted_tokens, s.accepted_tokens, s.draft_ms, s.verify_ms,
                              s.network_ms,
                              div < 0, div, off_times, on_times[d], step_ms, dict(by_source),
                              sum(r.proposal_bytes for r in s.round_records),
                              (s.predraft_attempts, s.predraft_hits), list(off.token_ids),
                              {"total": s.total_ms, **roundtime.request_split(
                                  s.total_ms, s.prefill_compute_ms, s.prefill_ms - s.prefill_compute_ms,
                                  s.round_records)}, depth_counts(s.round_records), off.stats.prefill_ms,
                              s.drafter if s.speculation_used else ""))
    return records


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


def main(args, config: StackConfig) -> int:
    if not args.gateway:  # a stack started here: its target's weights named and measured as served
        config = config.resolved()
    if args.ceiling:  # no services: the verifier's own code in this process
        from specsplit.bench import ceiling

        return ceiling.main(args, config)
    if args.structured:  # its own workload: prompts with schemas
        from specsplit.bench import structured

        return structured.main(args, config)
    prompts = load_prompts(args.prompts, args.limit)
    REQUEST.update(temperature=args.temperature, seed=args.seed,
                   predraft={"off": pb.PREDRAFT_OFF, "on": pb.PREDRAFT_ON, "auto": pb.PREDRAFT_DEFAULT}[args.predraft])
    code = _other_mode(args, config, prompts)
    if code is not None:
        return code
    anchors = _anchors(args, config, prompts)
    run = _run(args, config, prompts, anchors.anchor)
    _report(args, config, prompts, anchors, run)
    return 0


def _other_mode(args, config: StackConfig, prompts: list[Prompt]) -> int | None:
    """The modes with drivers of their own; None: the side-by-side bench."""
    if args.round_overhead:
        from specsplit.bench import roundoverhead

        roundoverhead.run()
        roundoverhead.hop_by_hop(config, load_prompts(args.prompts or "general", args.limit or 1),
                                 args.max_new_tokens, (args.drafters or ["hybrid"])[0])
        return 0
    if args.tracing_overhead:
        return tracing_overhead(prompts, config, args.max_new_tokens, args.repeats)
    if args.topology:
        from specsplit.bench import topology

        topology.run(prompts, config, args.max_new_tokens, args.repeats, args.rtts or topology.RTTS_MS, args.plot)
        return 0
    if args.traffic:
        from specsplit.bench import traffic

        return traffic.main(args, config)
    if args.controlled or args.long_context or args.concurrency:
        with gateway_stub(args.gateway, config, args.auth_token_file) as (stub, _):
            return _against_gateway(args, config, prompts, stub)
    return None


def _against_gateway(args, config: StackConfig, prompts: list[Prompt], stub) -> int:
    """--controlled, --long-context, --concurrency: drivers of one gateway."""
    if args.controlled:
        code = controlled(stub, prompts, args.max_new_tokens, args.repeats, args.controlled)
        if args.neighbour:
            busy_spell(stub, prompts, args.max_new_tokens, args.neighbour)
        return code
    if args.long_context:
        from specsplit.bench import longcontext
        from specsplit.model import catalog
        from specsplit.model.fastllama import kernel_name
        from specsplit.model.modeling import parse_dtype

        return longcontext.run(stub, str(catalog.resolve(config.target_model)), config.dtype, args.max_new_tokens,
                               kernel_name(config.quantize, parse_dtype(config.dtype)))
    from specsplit.bench import concurrency

    variant = Variant(args.drafters[0] if args.drafters else "")
    stub.Generate(request(warmup(prompts), pb.SPECULATION_ON, 16, variant), timeout=600)
    return concurrency.run(stub, prompts, list(args.concurrency), args.max_new_tokens, variant, args.requests)


@dataclass
class Anchors:
    """What the bench compares against, measured before the stack starts: the target's bare step,
    llama.cpp's decode, llama-lookup and llama-server on the same GGUF file (where built), and
    transformers' own model run beside each prompt (--anchor)."""

    profile: dict | None = None
    llama: float | None = None
    lookups: dict | None = None
    served: list | None = None
    anchor: object = None


def _anchors(args, config: StackConfig, prompts: list[Prompt]) -> Anchors:
    found = Anchors()
    if not (args.anchor_llama_cpp or args.anchor):
        return found
    from specsplit.bench import anchor as anchoring
    from specsplit.model import catalog

    model_dir = str(catalog.resolve(config.target_model))
    if args.anchor_llama_cpp or args.temperature <= 0:
        print("measuring the target step ...", file=sys.stderr, flush=True)
        found.profile = anchoring.step_profile(model_dir, config.dtype, config.quantize)
    if args.anchor_llama_cpp:
        _llama_cpp(args, config, prompts, model_dir, found)
    if args.anchor and args.temperature > 0:
        print("--anchor compares greedy decoding: not run at temperature > 0", file=sys.stderr)
    elif args.anchor:
        print("loading transformers' own model ...", file=sys.stderr, flush=True)
        draft_dir = str(catalog.resolve(config.draft_model)) if config.draft_model else None
        found.anchor = anchoring.Anchor(model_dir, config.dtype, draft_dir)
        found.anchor.warmup(prompts[0].prompt)
    return found


def _llama_cpp(args, config: StackConfig, prompts: list[Prompt], model_dir: str, found: Anchors) -> None:
    from transformers import AutoTokenizer

    from specsplit.bench import llamacpp, llamaserver
    from specsplit.model import catalog
    from specsplit.model.chat import chat_prompt_ids

    gguf = Path(model_dir) / "model.gguf"
    print("running llama.cpp's llama-bench (and llama-lookup, llama-server where built) on the same GGUF file ...",
          file=sys.stderr, flush=True)
    found.llama = llamacpp.decode_tok_s(args.anchor_llama_cpp, gguf)
    built = Path(args.anchor_llama_cpp) / "bin"
    if (built / "llama-lookup").is_file():
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        chat = lambda text: tokenizer.decode(chat_prompt_ids(tokenizer, [{"role": "user", "content": text}]))  # noqa: E731
        found.lookups = llamacpp.lookup_by_task(args.anchor_llama_cpp, gguf, prompts, chat, args.max_new_tokens)
    if (built / "llama-server").is_file():
        draft_gguf = Path(catalog.resolve(config.draft_model)) / "model.gguf" if config.draft_model else None
        found.served = llamaserver.run(args.anchor_llama_cpp, gguf,
                                       draft_gguf if draft_gguf is not None and draft_gguf.is_file() else None,
                                       prompts, args.max_new_tokens)


@dataclass
class Run:
    """The side-by-side run's records and what the stack said about itself after it."""

    records: list[Record]
    anchored: list
    info: object  # the last GenerateResponse's stats: gamma, exact numerics
    memory: dict | None
    verify_rss: float
    local: bool  # the stack was started here (else --gateway)


def _run(args, config: StackConfig, prompts: list[Prompt], anchor) -> Run:
    """Every prompt off and on with each drafter variant, back to back (and beside the neighbours)."""
    if anchor is not None:
        from specsplit.bench.anchor import AnchorRecord
    with gateway_stub(args.gateway, config, args.auth_token_file) as (stub, stack):
        names = list(args.drafters)
        if not names:  # every drafter the stack hosts and the default request; else the gateway's default
            names = [*_draft_memory(stack.addresses["draft"]), DEFAULT_REQUEST] if stack else [""]
        methods = list(args.methods) if args.temperature > 0 else [""]
        drafters = [Variant(n, m, t) for n in names for m in methods for t in (list(args.tree_budgets) or [0])]
        for d in drafters:
            stub.Generate(request(warmup(prompts), pb.SPECULATION_ON, 16, d), timeout=600)
        records, anchored = [], []
        neighbours = Neighbours(args.neighbour) if args.neighbour else None
        try:
            for i, p in enumerate(prompts, 1):
                also = lambda: None  # noqa: E731
                if anchor is not None:
                    anchored.append(AnchorRecord(p.task_type))
                    also = lambda: anchor.run(anchored[-1], p.prompt, args.max_new_tokens)  # noqa: E731
                fresh = run_prompt(stub, p, args.max_new_tokens, args.repeats, drafters, also)
                if neighbours:
                    with neighbours.running():
                        fresh += [replace(r, drafter=r.drafter + BUSY)
                                  for r in run_prompt(stub, p, args.max_new_tokens, args.repeats, drafters)]
                records += fresh
                for r in fresh:
                    _progress(i, len(prompts), p, r)
        finally:
            if neighbours:
                neighbours.close()
        info = stub.Generate(request(warmup(prompts), pb.SPECULATION_ON, 1, drafters[0]), timeout=600).stats
        return Run(records, anchored, info, _draft_memory(stack.addresses["draft"]) if stack else None,
                   stack.rss_mib("verify") if stack else 0.0, stack is not None)


def _progress(i: int, n: int, p: Prompt, r: Record) -> None:
    print(f"[{i}/{n}] {p.task_type:<10} {r.drafter:<16} off {r.off_tokens / r.off_s:5.1f} "
          f"tok/s  on {r.on_tokens / r.on_s:5.1f} tok/s  "
          f"acc.len {(r.accepted + r.rounds) / max(1, r.rounds):.2f}"
          f"  {'identical' if r.identical else f'DIVERGES at {r.first_divergence}'}",
          file=sys.stderr, flush=True)


def _report(args, config: StackConfig, prompts: list[Prompt], anchors: Anchors, run: Run) -> None:
    rows = summarise(run.records)
    header = _header(args, config, prompts, anchors, run)
    print_table(rows, header, run.memory)
    if anchors.lookups:
        from specsplit.bench import llamacpp

        llamacpp.print_lookup(anchors.lookups, rows)
    if anchors.served:
        from specsplit.bench import llamaserver

        llamaserver.print_table(anchors.served, rows)
    if args.neighbour:
        print_neighbour(rows, args.neighbour)
    if anchors.anchor is not None:
        from specsplit.bench import anchor as anchoring

        anchoring.print_table(anchors.anchor, run.anchored, rows, run.records)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"header": header, "summary": rows,
                                                   "records": [asdict(r) for r in run.records]}, indent=1))


def _header(args, config: StackConfig, prompts: list[Prompt], anchors: Anchors, run: Run) -> str:
    info, profile = run.info, anchors.profile
    exact = "exact numerics" if info.exact else "INEXACT numerics (spec on may differ from off)"
    weights = f"{config.dtype} with {config.quantize} weights" if config.quantize else config.dtype
    where = (f"transport={config.transport}, target {weights}, output store={config.store_tokens} tokens"
             if run.local else f"gateway={args.gateway}")
    sampling = f"temperature={args.temperature}, seed={args.seed}" if args.temperature > 0 else "greedy"
    header = (f"specsplit bench: {len(prompts)} prompts, max_new_tokens={args.max_new_tokens}, "
              f"repeats={args.repeats}, gamma={info.gamma}, {sampling}, {where}, {exact}")
    if profile:
        header += (f"\ntarget forward ({profile['kernels']}): 1-row step {profile['rows1_ms']:.2f} ms, "
                   f"5-row verify {profile['rows5_ms']:.2f} ms ({profile['rows5_ms'] / profile['rows1_ms']:.2f}x), "
                   "128-token context")
    if run.verify_rss:
        header += f"\nverify service RSS after the run: {run.verify_rss:.0f} MiB (weights, KV pool, prefix cache)"
    if anchors.llama:
        ours, llama = 1e3 / profile["rows1_ms"], anchors.llama
        header += (f"\nllama.cpp (llama-bench -t 2 -p 0 -n 96, the same GGUF file, run before the stack): decode "
                   f"{llama:.1f} tok/s; ours {ours:.1f} tok/s from the 1-row step ({ours / llama:.2f}x); "
                   f"end-to-end rows below include prefill")
    return header

"""`specsplit validate`: before turning speculation on for a workload, measure it on the user's own
prompts, through the real services, and decide per task type (design note sections 5-7):
acceptance length against the gate, end-to-end P50/P95 with speculation on and off, output
consistency on/off (greedy and seeded sampling), acceptance by output position, the prefill /
decode split, the draft's memory and compute share, and how speculation combines with 8- and 4-bit
weights. Writes report.md (+ PNG plots) and policy.json, which `up --policy` / `serve gateway
--policy` load (the controller starts from it and keeps learning)."""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from gateway import policy
from gateway.controller import p95
from specsplit.api.common.v1 import common_pb2 as cpb
from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.bench.calibrate import describe
from specsplit.bench.validatereport import write_report
from specsplit.bench.workload import Prompt, load_prompts, request, warmup
from specsplit.launcher import StackConfig, gateway_stub

SAMPLED = {"temperature": 0.8, "seed": 1}  # the seeded-sampling consistency check
FORMATS = ("q8_0", "q4_0")  # the quantization matrix beside the stack's own weights
# Each format's perplexity is measured on this fixed text (specsplit/data): the first paragraph of
# Dickens' A Tale of Two Cities and Lincoln's Gettysburg Address, both public domain.
PERPLEXITY_TEXT = "perplexity.txt"


@dataclass
class Run:
    """One request's answer and wall time."""

    tokens: list[int]
    wall_s: float
    stats: pb.GenerationStats


@dataclass
class PromptRuns:
    prompt: Prompt
    runs: dict[str, Run] = field(default_factory=dict)  # "off", "on", "off sampled", "on sampled"


@dataclass
class TaskVerdict:
    task_type: str
    n: int
    acceptance: float  # mean tokens per drafted round (accepted + 1)
    p50_off: float
    p50_on: float
    p95_off: float
    p95_on: float
    speedup: float  # tokens per second on / off, summed over the task's requests
    greedy_identical: int
    sampled_identical: int
    by_position: list[tuple[int, float, int]]  # (bucket start, acceptance length, drafted rounds)
    prefill_ms: float  # median per request, spec-on
    decode_ms: float
    draft_share: float  # drafting's share of spec-on round time
    gamma: int
    verdict: str = ""  # on | off | adaptive
    reason: str = ""


@dataclass
class FormatRow:
    name: str
    off_tps: float
    on_tps: float
    identical: int  # greedy spec-off outputs equal to the stack's own weights' (quality)
    common_prefix: float  # mean tokens the outputs share with them before diverging
    n: int
    perplexity: float  # on PERPLEXITY_TEXT, from the verifier's prompt log-probabilities


def _timed(stub, req: pb.GenerateRequest) -> Run:
    start = time.perf_counter()
    out = stub.Generate(req, timeout=600)
    return Run(list(out.token_ids), time.perf_counter() - start, out.stats)


def measure(stub, prompts: list[Prompt], max_new_tokens: int, sampled: bool, tick) -> list[PromptRuns]:
    """Every prompt spec-off then spec-on (greedy; and seeded sampling), back to back."""
    out = []
    for p in prompts:
        runs = PromptRuns(p)
        for mode, key in ((pb.SPECULATION_OFF, "off"), (pb.SPECULATION_ON, "on")):
            runs.runs[key] = _timed(stub, request(dataclasses.replace(p, temperature=0.0), mode, max_new_tokens))
            tick()
        if sampled:
            for mode, key in ((pb.SPECULATION_OFF, "off sampled"), (pb.SPECULATION_ON, "on sampled")):
                req = request(dataclasses.replace(p, temperature=SAMPLED["temperature"]), mode, max_new_tokens)
                req.sampling.seed = SAMPLED["seed"]
                runs.runs[key] = _timed(stub, req)
                tick()
        out.append(runs)
    return out


def by_position(records, bucket: int) -> dict[int, list[int]]:
    """Drafted rounds' tokens per round (accepted + 1), by the output position the round starts at."""
    out: dict[int, list[int]] = defaultdict(list)
    position = 1  # the prefill committed the first token
    for r in records:
        if r.drafted:
            out[position // bucket * bucket].append(r.accepted + 1)
        position += r.accepted + 1
    return out


def analyse(measured: list[PromptRuns], gate: float, bucket: int) -> list[TaskVerdict]:
    tasks: dict[str, list[PromptRuns]] = defaultdict(list)
    for m in measured:
        tasks[m.prompt.task_type].append(m)
    verdicts = []
    for task, group in sorted(tasks.items()):
        on = [m.runs["on"] for m in group]
        off = [m.runs["off"] for m in group]
        rounds = [r.accepted + 1 for run in on for r in run.stats.round_records if r.drafted]
        positions: dict[int, list[int]] = defaultdict(list)
        for run in on:
            for start, lengths in by_position(run.stats.round_records, bucket).items():
                positions[start] += lengths
        round_ms = sum(r.round_ms for run in on for r in run.stats.round_records)
        draft_ms = sum(r.draft_ms for run in on for r in run.stats.round_records)
        sampled = [m for m in group if "on sampled" in m.runs]
        v = TaskVerdict(
            task, len(group), statistics.fmean(rounds) if rounds else 1.0,
            statistics.median(r.wall_s for r in off), statistics.median(r.wall_s for r in on),
            p95([r.wall_s for r in off]), p95([r.wall_s for r in on]),
            (sum(len(r.tokens) for r in on) / sum(r.wall_s for r in on))
            / (sum(len(r.tokens) for r in off) / sum(r.wall_s for r in off)),
            sum(m.runs["on"].tokens == m.runs["off"].tokens for m in group),
            sum(m.runs["on sampled"].tokens == m.runs["off sampled"].tokens for m in sampled),
            [(start, statistics.fmean(lengths), len(lengths)) for start, lengths in sorted(positions.items())],
            statistics.median(r.stats.prefill_ms for r in on), statistics.median(r.stats.decode_ms for r in on),
            draft_ms / round_ms if round_ms else 0.0, max((r.stats.gamma for r in on), default=0))
        v.verdict, v.reason = decide(v, gate)
        verdicts.append(v)
    return verdicts


def decide(v: TaskVerdict, gate: float) -> tuple[str, str]:
    """off: below the gate, or P95 worse than off; on: above it, faster, and holding up to the last
    positions measured; adaptive otherwise (the controller measures live)."""
    if v.acceptance < gate:
        return "off", f"acceptance length {v.acceptance:.2f} < gate {gate:.1f}"
    if v.p95_on > v.p95_off:
        return "off", f"P95 on {v.p95_on:.2f} s > off {v.p95_off:.2f} s"
    tail = [length for _, length, rounds in v.by_position if rounds >= 3][-1:]
    if tail and tail[0] < gate:
        return "adaptive", (f"acceptance length {v.acceptance:.2f} >= {gate:.1f}, but {tail[0]:.2f} in the last "
                            "output positions measured (long outputs drift)")
    if v.speedup < 1.05:
        return "adaptive", f"acceptance length {v.acceptance:.2f} >= {gate:.1f}, but on/off only {v.speedup:.2f}x"
    return "on", f"acceptance length {v.acceptance:.2f} >= {gate:.1f}, {v.speedup:.2f}x, P95 {v.p95_on:.2f} s " \
                 f"<= {v.p95_off:.2f} s"


def perplexity_text(tokenizer, max_context: int) -> str:
    """PERPLEXITY_TEXT, cut to the tokens that fit a context of max_context (less a margin for the
    one generated token and for re-tokenizing the cut text)."""
    from importlib import resources

    text = resources.files("specsplit.data").joinpath(PERPLEXITY_TEXT).read_text()
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return text if len(ids) < max_context - 16 else tokenizer.decode(ids[:max_context - 16])


def perplexity(stub, text: str) -> float:
    """exp(mean negative log-likelihood) of the text's tokens after the first, under the target's own
    distribution (the log-softmax of its logits: LogprobsRequest.prompt), as raw text."""
    out = stub.Generate(pb.GenerateRequest(text=text, max_new_tokens=1, speculation=pb.SPECULATION_OFF,
                                           logprobs=cpb.LogprobsRequest(prompt=True)), timeout=600)
    return math.exp(-statistics.fmean(t.logprob for t in out.prompt_logprobs))


def quantization(config: StackConfig, prompts: list[Prompt], max_new_tokens: int, baseline: list[PromptRuns],
                 text: str, own_perplexity: float, tick) -> list[FormatRow]:
    """The stack's own weights and each FORMATS one: tok/s off and on, greedy agreement with the
    own weights' spec-off output, and perplexity on a fixed text (each format's quality cost)."""
    rows = [_format_row(config.quantize or config.dtype, baseline, baseline, own_perplexity)]
    for name in FORMATS:
        if name == config.quantize:
            continue
        run_dir = str(Path(config.run_dir) / name) if config.run_dir else None
        with gateway_stub(None, dataclasses.replace(config, quantize=name, run_dir=run_dir)) as (stub, _):
            stub.Generate(request(warmup(prompts), pb.SPECULATION_ON, 16), timeout=600)
            runs = measure(stub, prompts, max_new_tokens, False, tick)
            rows.append(_format_row(name, runs, baseline, perplexity(stub, text)))
    return rows


def _format_row(name: str, runs: list[PromptRuns], baseline: list[PromptRuns], ppl: float) -> FormatRow:
    def tps(key: str) -> float:
        return sum(len(m.runs[key].tokens) for m in runs) / sum(m.runs[key].wall_s for m in runs)

    prefixes = []
    for m, base in zip(runs, baseline):
        a, b = m.runs["off"].tokens, base.runs["off"].tokens
        prefixes.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    identical = sum(m.runs["off"].tokens == b.runs["off"].tokens for m, b in zip(runs, baseline))
    return FormatRow(name, tps("off"), tps("on"), identical, statistics.fmean(prefixes), len(runs), ppl)


def main(args, config: StackConfig) -> int:
    from tqdm import tqdm

    if not args.gateway:  # a stack started here: its own weights' row of the matrix named as served
        config = config.resolved()
    prompts = load_prompts(args.prompts, args.limit)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    matrix = args.quantization and not args.gateway
    steps = len(prompts) * (4 + 2 * len(FORMATS) * matrix)
    progress = tqdm(total=steps, desc="validate", unit="request", file=sys.stderr)
    with gateway_stub(args.gateway, config, args.auth_token_file) as (stub, stack):
        first = stub.Generate(request(warmup(prompts), pb.SPECULATION_ON, 16), timeout=600).stats
        measured = measure(stub, prompts, args.max_new_tokens, True, lambda: progress.update())
        target, drafters = describe(stack.addresses if stack else None, args)
        if matrix:
            from transformers import AutoTokenizer

            from specsplit.model import catalog

            tokenizer = AutoTokenizer.from_pretrained(catalog.resolve(config.target_model))
            text = perplexity_text(tokenizer, target.max_context)  # the matrix runs on a stack started here
            own_perplexity = perplexity(stub, text)
    verdicts = analyse(measured, args.gate, args.bucket)
    formats = quantization(config, prompts, args.max_new_tokens, measured, text, own_perplexity,
                           progress.update) if matrix else []
    progress.close()
    draft_memory = {name: d.memory_bytes for name, d in drafters.items()}
    written = []
    if target is not None:
        policy.write(out / "policy.json", target, drafters, {v.task_type: {first.drafter: {
            "speculate": v.verdict != "off", "gamma": v.gamma or config.gamma, "verdict": v.verdict,
            "reason": v.reason, "acceptance_length": round(v.acceptance, 3), "measured_speedup": round(v.speedup, 3),
            "tree_budget": first.tree_budget}} for v in verdicts})
        written.append(out / "policy.json")
    written += write_report(out, verdicts, formats, first, args, draft_memory, target)
    if not args.gateway:  # the stack ran here: say which kernel path served it
        from specsplit.model import native

        print(f"kernel path: {native.describe()}")
    for v in verdicts:
        print(f"{v.task_type:<12} {v.verdict:<9} {v.reason}")
    print("wrote " + ", ".join(str(p) for p in written))
    return 0

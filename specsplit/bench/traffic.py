"""`specsplit bench --traffic`: the default request as users send it. The prompts (by default the
built-in general workload, six categories) are shuffled and sent without a task type and with
speculation AUTO, each beside spec-off and forced spec-on with every drafter asked for, back to back
in a rotating order. Forced runs carry their own labels so that they do not teach the controller's
unlabelled state what AUTO must learn on its own."""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.bench.workload import DEFAULT_REQUEST, Prompt, Variant, load_prompts, request, warmup

OFF, AUTO = "off", DEFAULT_REQUEST


def main(args, config) -> int:
    """`bench --traffic`: a stack started here from `config` (or `--gateway`), warmed up, then run()."""
    from specsplit.launcher import gateway_stub

    prompts = load_prompts(args.prompts or "general", args.limit)
    bare = None
    if not args.gateway:  # the target alone in this process, timed beside each spec-off request
        from specsplit.bench import anchor as anchoring
        from specsplit.model import catalog

        resolved = config.resolved()
        bare = anchoring.BareTarget(str(catalog.resolve(resolved.target_model)), resolved.dtype, resolved.quantize)
    served = None
    if args.anchor_llama_cpp:  # llama-server on the same prompts, before the stack starts
        from specsplit.bench import llamaserver
        from specsplit.model import catalog

        print("running llama-server on the same GGUF file and prompts ...", file=sys.stderr, flush=True)
        served = llamaserver.run(args.anchor_llama_cpp, catalog.resolve(config.target_model) / "model.gguf", None,
                                 prompts, args.max_new_tokens)
    with gateway_stub(args.gateway, config, args.auth_token_file) as (stub, _):
        variants = [Variant(n, "", t) for n in (args.drafters or ["ngram", "hybrid"])
                    for t in (args.tree_budgets or [0])]
        for v in variants:
            stub.Generate(request(warmup(prompts), pb.SPECULATION_ON, 16, v), timeout=600)
        stub.Generate(request(warmup(prompts), pb.SPECULATION_OFF, 16), timeout=600)
        rows = run(stub, prompts, args.max_new_tokens, args.repeats, variants, args.seed, bare=bare)
    if served:
        llamaserver.print_table(served, [{"drafter": AUTO, "task_type": key, "tok_s_on": row["tok_s"][AUTO],
                                          "tok_s_off": row["tok_s"][OFF]}
                                         for key, row in rows.items() if "tok_s" in row])
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))
    return 0


def run(stub, prompts: list[Prompt], max_new_tokens: int, repeats: int, variants: list[Variant],
        seed: int = 0, out=None, bare=None) -> dict:
    """`bare` (anchor.BareTarget): its decode of each spec-off output is timed right after the
    request, with the stack idle: the service tax against the target alone, pair by pair."""
    out = out or sys.stdout
    modes = _modes(prompts, seed, max_new_tokens, variants)
    tally = Tally([OFF, AUTO, *(v.label for v in variants)])
    for r in range(repeats):
        for i, (task, reqs) in enumerate(modes, 1):
            turn = (i + r) % len(reqs)
            outputs = {}
            for label, req in reqs[turn:] + reqs[:turn]:  # rotated: drift hits every mode alike
                start = time.perf_counter()
                outputs[label] = stub.Generate(req, timeout=600)
                tally.timed(task, label, outputs[label], time.perf_counter() - start)
            tally.compared(task, outputs)
            off, stats, off_stats = outputs[OFF].token_ids, outputs[AUTO].stats, outputs[OFF].stats
            if len(off) > 1 and off_stats.decode_ms > 0:
                alone = bare.decode_ms(reqs[0][1].chat.messages[0].content, list(off)) if bare is not None else None
                tally.tax.append((off_stats.decode_ms / (len(off) - 1), off_stats.verify_ms / (len(off) - 1), alone))
            print(f"traffic {r + 1}/{repeats} [{i}/{len(modes)}] {task:<10} default: "
                  f"{stats.speculation_reason:<10} {stats.drafter or 'none':<7}"
                  f"{len(outputs[AUTO].token_ids) / max(1e-9, stats.total_ms / 1e3):6.1f} tok/s "
                  f"({off_stats.total_ms / max(1e-9, stats.total_ms):.2f}x off; decode "
                  f"{off_stats.decode_ms / max(1e-9, stats.decode_ms):.2f}x), "
                  f"drafted {sum(1 for rr in stats.round_records if rr.drafted)}/{stats.rounds} rounds",
                  file=sys.stderr, flush=True)
    print(f"specsplit bench --traffic: {len(prompts)} prompts shuffled (seed {seed}), unlabelled, "
          f"max_new_tokens={max_new_tokens}, repeats={repeats}; tok/s = tokens / wall time incl. a cold prefill "
          "(no prefix cache)", file=out)
    rows = tally.table(out)
    if tally.tax:
        rows["service_tax"] = _service_tax(tally.tax, out)
    _legend(tally.labels[2:], out)
    return rows


def _modes(prompts: list[Prompt], seed: int, max_new_tokens: int,
           variants: list[Variant]) -> list[tuple[str, list[tuple[str, pb.GenerateRequest]]]]:
    """The prompts shuffled, each as its requests: spec-off, the default (unlabelled, AUTO), and
    each variant forced on under a label of its own."""
    order = list(prompts)
    random.Random(seed).shuffle(order)
    modes = []
    for p in order:
        reqs = [(OFF, request(Prompt("bench-off", p.prompt, p.temperature), pb.SPECULATION_OFF, max_new_tokens)),
                (AUTO, request(Prompt("", p.prompt, p.temperature), pb.SPECULATION_AUTO, max_new_tokens))]
        reqs += [(v.label, request(Prompt(f"bench-{v.label}", p.prompt, p.temperature), pb.SPECULATION_ON,
                                   max_new_tokens, v)) for v in variants]
        for _, req in reqs:  # a user's document is new to the server: every mode pays its whole prefill
            req.skip_prefix_cache = True
        modes.append((p.task_type, reqs))
    return modes


def _counts() -> list:
    return [0, 0]


class Tally:
    """Per category (and ALL): every mode's time and tokens, and what the default request did."""

    def __init__(self, labels: list[str]):
        self.labels = labels  # off, the default, then the forced variants
        self.seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.tokens: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        # per mode: prefill ms, decode ms, tokens after the first
        self.phases: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0, 0]))
        self.identical: dict[str, Counter] = defaultdict(Counter)
        self.reasons: dict[str, Counter] = defaultdict(Counter)
        self.chosen: dict[str, Counter] = defaultdict(Counter)  # the drafter each default request ran with
        self.drafted_rounds: dict[str, list[int]] = defaultdict(_counts)  # forwards that verified drafts, forwards
        self.looked: dict[str, list[int]] = defaultdict(_counts)  # the verifier's lookups: drafted, accepted
        self.headed: dict[str, list[int]] = defaultdict(_counts)  # the verifier's head drafts: drafted, accepted
        # the default's drafting: ms, tokens drafted; spec-off's verify ms and forwards (a step's price)
        self.price: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0.0, 0])
        self.accepted: dict[str, int] = defaultdict(int)  # the default's drafts accepted
        # spec-off ms per token: decoding through the services, its forwards, the bare target (or None)
        self.tax: list[tuple[float, float, float | None]] = []

    def timed(self, task: str, label: str, answer, took: float) -> None:
        for key in (task, "ALL"):
            self.seconds[key][label] += took
            self.tokens[key][label] += len(answer.token_ids)
            phase = self.phases[key][label]
            phase[0] += answer.stats.prefill_ms
            phase[1] += answer.stats.decode_ms
            phase[2] += max(0, len(answer.token_ids) - 1)

    def compared(self, task: str, outputs: dict) -> None:
        off = list(outputs[OFF].token_ids)
        stats, off_stats = outputs[AUTO].stats, outputs[OFF].stats
        records = stats.round_records
        for key in (task, "ALL"):
            for label, answer in outputs.items():
                self.identical[key][label] += list(answer.token_ids) == off
            self.reasons[key][stats.speculation_reason] += 1
            self.chosen[key][stats.drafter or "none"] += 1
            self.drafted_rounds[key][0] += sum(bool(rr.drafted) + rr.lookup_steps + rr.head_steps for rr in records)
            self.drafted_rounds[key][1] += stats.forwards
            self.accepted[key] += stats.accepted_tokens
            self.looked[key][0] += sum(rr.lookup_drafted for rr in records)
            self.looked[key][1] += sum(rr.lookup_accepted for rr in records)
            self.headed[key][0] += sum(rr.head_drafted for rr in records)
            self.headed[key][1] += sum(rr.head_accepted for rr in records)
            price = self.price[key]
            price[0] += stats.draft_ms
            price[1] += stats.drafted_tokens
            price[2] += off_stats.verify_ms
            price[3] += off_stats.forwards or off_stats.rounds

    def row(self, key: str) -> dict:
        forced = self.labels[2:]
        rate = {lb: self.tokens[key][lb] / self.seconds[key][lb] for lb in self.labels}
        best = max((rate[lb] for lb in forced), default=rate[OFF])
        forwards = self.drafted_rounds[key][1]
        off_phase, auto_phase = self.phases[key][OFF], self.phases[key][AUTO]
        decode_ratio = ((auto_phase[2] / max(1e-9, auto_phase[1])) / (off_phase[2] / max(1e-9, off_phase[1]))
                        if off_phase[2] and auto_phase[2] else 0.0)
        price = self.price[key]
        return {"n": self.reasons[key].total(), "tok_s": rate, "default_vs_off": rate[AUTO] / rate[OFF],
                "default_vs_best": rate[AUTO] / best,
                "off_prefill_share": off_phase[0] / max(1e-9, self.seconds[key][OFF] * 1e3),
                "default_vs_off_decode": decode_ratio,
                "default_acc_len": (self.accepted[key] + forwards) / forwards if forwards else 0.0,
                "drafted_share": self.drafted_rounds[key][0] / max(1, forwards),
                "identical": dict(self.identical[key]), "reasons": dict(self.reasons[key]),
                "drafters": dict(self.chosen[key]),
                "lookup_drafted": self.looked[key][0], "lookup_accepted": self.looked[key][1],
                "head_drafted": self.headed[key][0], "head_accepted": self.headed[key][1],
                "draft_cost": (price[0] / price[1]) / (price[2] / price[3]) if price[1] and price[2] else 0.0}

    def table(self, out) -> dict:
        """Prints a row per category, ALL last; returns them."""
        forced = self.labels[2:]
        head = f"{'category':<11}{'n':>3}{'off':>8}" + "".join(f"{lb[:14]:>15}" for lb in forced)
        head += (f"{'default':>9}{'def/off':>8}{'def/best':>9}{'prefill':>8}{'decode':>7}{'acc.len':>8}"
                 f"{'drafted':>8}{'lookup':>12}{'head':>12}{'cost':>7}{'identical':>10}  default's reasons; drafters")
        print(head, file=out)
        rows = {}
        for key in sorted(self.seconds, key=lambda k: (k == "ALL", k)):
            row = rows[key] = self.row(key)
            rate, looked, headed = row["tok_s"], self.looked[key], self.headed[key]
            same = "/".join(str(self.identical[key][lb]) for lb in [AUTO, *forced])
            print(f"{key:<11}{row['n']:>3}{rate[OFF]:>8.1f}"
                  + "".join(f"{rate[lb]:>8.1f} {rate[lb] / rate[OFF]:>5.2f}x" for lb in forced)
                  + f"{rate[AUTO]:>9.1f}{row['default_vs_off']:>7.2f}x{row['default_vs_best']:>8.2f}x"
                  f"{row['off_prefill_share']:>8.0%}{row['default_vs_off_decode']:>6.2f}x"
                  f"{row['default_acc_len']:>8.2f}{row['drafted_share']:>7.0%}"
                  f"{f'{looked[1]}/{looked[0]}':>12}{f'{headed[1]}/{headed[0]}':>12}"
                  f"{row['draft_cost']:>7.3f}{same:>10}  "
                  + ", ".join(f"{k} {v}" for k, v in sorted(self.reasons[key].items())) + "; "
                  + ", ".join(f"{k} {v}" for k, v in sorted(self.chosen[key].items())), file=out)
        return rows


def _service_tax(tax: list[tuple[float, float, float | None]], out) -> dict:
    through, forward = (statistics.median(t[i] for t in tax) for i in (0, 1))
    line = (f"service tax, spec-off: decode through the services {1e3 / through:.1f} tok/s "
            f"({through:.2f} ms/token) vs its forwards in the verify service {1e3 / forward:.1f} tok/s "
            f"({forward:.2f} ms): "
            f"{forward / through:.2f}x (medians per request)")
    row = {"through_ms": through, "forward_ms": forward}
    paired = [(t[0], t[2]) for t in tax if t[2] is not None]
    if paired:
        row["bare_ms"] = statistics.median(b for _, b in paired)
        row["bare_vs_through"] = statistics.median(b / t for t, b in paired)
        line += (f"; the bare target decoding the same outputs in this process (no services, timed right after "
                 f"each) {1e3 / row['bare_ms']:.1f} tok/s: through the services "
                 f"{row['bare_vs_through']:.2f}x its rate")
    print(line, file=out)
    return row


def _legend(forced: list[str], out) -> None:
    print("prefill = spec-off's share of its wall time spent before the first token (what speculation cannot "
          "shorten); decode = the default request's decode rate (tokens after the first / time after prefill) over "
          "spec-off's", file=out)
    print(f"identical = outputs equal to spec-off ({'/'.join([AUTO, *forced])}); acc.len = tokens per target "
          "forward of the default request; drafted = its forwards that verified a draft (the drafter's or the "
          "verifier's own lookup or head); lookup, head = the verifier's own drafts of each kind, accepted/drafted; "
          "cost = the default's drafting ms per drafted token / spec-off's ms per forward", file=out)

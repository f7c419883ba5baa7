"""The bench's records and tables: one request pair's facts, their summary per drafter and task
type, and the printed table (docs/metrics.md says what each column means)."""

from __future__ import annotations

import statistics
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass

from gateway.controller import p95
from specsplit.bench.workload import DEFAULT_REQUEST


@dataclass
class Record:
    task_type: str
    prompt: str
    drafter: str
    off_s: float  # median client wall time, speculation off
    on_s: float
    off_tokens: int
    on_tokens: int
    rounds: int  # target forwards after the prefill (stats.forwards: a round's, or a decode-ahead's steps)
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
    prefill_ms: float = 0.0  # the spec-off request's prompt processing (stats.prefill_ms: cold, to the first token)
    ran: str = ""  # the drafter the request ran (stats.drafter; the default request's is AUTO's choice), "" none


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
            "prefill_ms_off": statistics.median(r.prefill_ms for r in rs),
            "ran": dict(Counter(r.ran or "none" for r in rs)),
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
        print(f"{drafter} rounds (a verifier's: its steps) by where drafted: " + "; ".join(parts), file=out)
    chosen = [r for r in rows if r["drafter"].split("+")[0] == DEFAULT_REQUEST and r["task_type"] != "ALL"]
    if chosen:  # which drafter AUTO ran, per task type (none: it decided against speculating)
        per_type = [f"{r['task_type']} " + ", ".join(f"{d} {n}" for d, n in sorted(r["ran"].items())) for r in chosen]
        print(f"{chosen[0]['drafter']} request ran: " + "; ".join(per_type), file=out)
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

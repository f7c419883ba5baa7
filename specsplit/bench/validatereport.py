"""`specsplit validate`'s report: report.md with its tables and verdicts, and PNG plots beside it
(acceptance by output position, P50/P95 on vs off, the quantization matrix)."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def write_report(out: Path, verdicts, formats, first, args, draft_memory: dict[str, int], target) -> list[Path]:
    plots = _plots(out, verdicts, formats)
    lines = [
        "# specsplit validate",
        "",
        f"Target {target.model_id if target is not None else '(a running gateway)'}, drafter {first.drafter}, "
        f"gamma {first.gamma or '-'}, token trees {first.tree_budget or 'off'}; prompts `{args.prompts or 'starter'}`, "
        f"{args.max_new_tokens} new tokens each; gate: acceptance length {args.gate:.1f}. Greedy requests unless "
        f"said; the seeded check samples at temperature 0.8. Times are end-to-end (the client's wall time).",
        "",
        "## Verdicts",
        "",
        "| task type | verdict | why |",
        "|---|---|---|",
        *(f"| {v.task_type} | **{v.verdict}** | {v.reason} |" for v in verdicts),
        "",
        "`policy.json` holds them (`on`/`adaptive`: start speculating; `off`: start without); load it with "
        "`specsplit up --policy DIR/policy.json` or `specsplit serve gateway --policy ...`: the controller starts "
        "from it and keeps learning.",
        "",
        "## Per task type",
        "",
        "| task type | n | acc. length | on/off tok/s | P50 off / on s | P95 off / on s | identical greedy | "
        "identical seeded | prefill / decode ms | draft share |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(f"| {v.task_type} | {v.n} | {v.acceptance:.2f} | {v.speedup:.2f}x | {v.p50_off:.2f} / {v.p50_on:.2f} | "
          f"{v.p95_off:.2f} / {v.p95_on:.2f} | {v.greedy_identical}/{v.n} | {v.sampled_identical}/{v.n} | "
          f"{v.prefill_ms:.0f} / {v.decode_ms:.0f} | {v.draft_share:.0%} |" for v in verdicts),
        "",
        "Draft share: the drafter's compute over the spec-on round time. Draft memory: "
        + ", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in sorted(draft_memory.items())) + ".",
        "",
        f"## Acceptance length by output position (buckets of {args.bucket} tokens)",
        "",
        "| task type | " + " | ".join(f"{start}+" for start in _starts(verdicts)) + " |",
        "|---|" + "---|" * len(_starts(verdicts)),
        *(f"| {v.task_type} | " + " | ".join(_at(v, start) for start in _starts(verdicts)) + " |" for v in verdicts),
    ]
    if formats:
        lines += _quantization(formats)
    if plots:
        lines += ["", "## Plots", "", *(f"![{p.stem}]({p.name})" for p in plots)]
    elif not _can_plot():
        lines += ["", "(no plots: matplotlib is not installed; pip install 'specsplit[plot]')"]
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    return [report, *plots]


def _quantization(formats) -> list[str]:
    base = formats[0]
    return [
        "",
        "## Quantization and speculation",
        "",
        f"Each format's greedy spec-off output compared with the {base.name} weights' (its quality cost), and "
        "its perplexity on a fixed text (the first paragraph of A Tale of Two Cities and the Gettysburg "
        "Address: specsplit/data/perplexity.txt).",
        "",
        "| weights | off tok/s | on tok/s | on/off | vs " + base.name + " off | identical outputs | "
        "mean common prefix | perplexity |",
        "|---|---|---|---|---|---|---|---|",
        *(f"| {f.name} | {f.off_tps:.1f} | {f.on_tps:.1f} | {f.on_tps / f.off_tps:.2f}x | "
          f"{f.on_tps / base.off_tps:.2f}x | {f.identical}/{f.n} | {f.common_prefix:.1f} tokens | "
          f"{f.perplexity:.2f} |" for f in formats),
    ]


def _starts(verdicts) -> list[int]:
    return sorted({start for v in verdicts for start, _, _ in v.by_position})


def _at(v, start: int) -> str:
    for s, length, rounds in v.by_position:
        if s == start:
            return f"{length:.2f} ({rounds})"
    return "-"


def _can_plot() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _plots(out: Path, verdicts, formats) -> list[Path]:
    if not _can_plot():
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for v in verdicts:
        ax.plot([s for s, _, _ in v.by_position], [length for _, length, _ in v.by_position], marker="o",
                label=v.task_type)
    ax.set_xlabel("output position (start of bucket)")
    ax.set_ylabel("acceptance length (tokens per round)")
    ax.legend()
    paths.append(out / "acceptance_by_position.png")
    fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)

    paths.append(_bars(plt, out / "latency.png", [v.task_type for v in verdicts], "end-to-end latency (s)",
                       [(label, [getattr(v, key) for v in verdicts]) for label, key in (
                           ("P50 off", "p50_off"), ("P50 on", "p50_on"), ("P95 off", "p95_off"),
                           ("P95 on", "p95_on"))]))
    if formats:
        paths.append(_bars(plt, out / "quantization.png", [f.name for f in formats], "tokens per second",
                           [("speculation off", [f.off_tps for f in formats]),
                            ("speculation on", [f.on_tps for f in formats])]))
    return paths


def _bars(plt, path: Path, names: list[str], ylabel: str, series: list[tuple[str, list[float]]]) -> Path:
    """Grouped bars: one group per name, one bar per series."""
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series):
        ax.bar([x + (i - (len(series) - 1) / 2) * width for x in range(len(names))], values, width=width, label=label)
    ax.set_xticks(list(range(len(names))), names)
    ax.set_ylabel(ylabel)
    ax.legend()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path

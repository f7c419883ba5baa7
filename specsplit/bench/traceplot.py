"""`specsplit trace-report --plot FILE`: a trace you can look at without Jaeger.

Top: one request's timeline from its Generate trace: prefill, then each round as consecutive
segments of its measured draft (when the round waited for it), network, verify and gateway time
(their lengths are measured; their order inside a round is schematic), with pre-drafts, which ran
during the previous round's Verify, on a lane of their own. Bottom: the spec-on time shares per
task type, as trace-report's table prints them."""

from __future__ import annotations

from specsplit.bench.tracereport import GENERATE, Pricing, Span, _ms

COLORS = {"prefill": "#8c8c8c", "draft": "#e6a23c", "network": "#d9534f", "verify": "#337ab7",
          "gateway": "#5cb85c"}


def pick(spans: list[Span], trace_id: str | None = None) -> Span:
    """The Generate span to draw: the one asked for, else the spec-on request with the most rounds."""
    roots = [s for s in spans if s.name == GENERATE and s.kind == "server"]
    if trace_id:
        chosen = [s for s in roots if s.trace_id.startswith(trace_id)]
        if not chosen:
            raise ValueError(f"no Generate trace {trace_id!r} among the {len(roots)} read")
        return chosen[0]
    if not roots:
        raise ValueError("no Generate traces to draw")
    return max(roots, key=lambda s: (s.attributes.get("specsplit.speculation") == "on",
                                     int(s.attributes.get("specsplit.rounds", 0) or 0)))


def segments(spans: list[Span], root: Span) -> list[tuple[str, float, float, int]]:
    """(part, start ms, length ms, lane) from the request's start; lane 0 is the critical path,
    lane 1 the pre-drafts that ran while the previous Verify was in flight."""
    children = sorted((s for s in spans if s.trace_id == root.trace_id and s.parent_id == root.span_id),
                      key=lambda s: s.start_ns)
    out = []
    previous_verify: tuple[float, float] | None = None
    for span in children:
        start = (span.start_ns - root.start_ns) / 1e6
        if span.name == "prefill":
            out.append(("prefill", start, span.ms, 0))
        elif span.name == "round":
            t = start
            predrafted = bool(span.attributes.get("specsplit.predrafted"))
            if predrafted and previous_verify is not None:
                out.append(("draft", previous_verify[0], _ms(span, "draft_ms"), 1))
            for part in (("network", "verify", "gateway") if predrafted else ("draft", "network", "verify",
                                                                                "gateway")):
                length = _ms(span, f"{part}_ms")
                if length > 0:
                    out.append((part, t, length, 0))
                    if part == "verify":
                        previous_verify = (t, length)
                    t += length
    return out


def plot(spans: list[Span], task_rows: list[Pricing], path: str, trace_id: str | None = None) -> Span:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    root = pick(spans, trace_id)
    parts = segments(spans, root)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 5.5), gridspec_kw={"height_ratios": [1.2, 1]})
    for part, start, length, lane in parts:
        top.barh(lane, length, left=start, height=0.6, color=COLORS[part], hatch="//" if lane else None,
                 edgecolor="white" if not lane else "black", linewidth=0.3)
    a = root.attributes
    top.set_yticks([0, 1], ["critical path", "pre-draft"])
    top.set_ylim(-0.6, 1.6)
    top.set_xlim(0, root.ms)
    top.set_xlabel("ms since the Generate call arrived")
    top.set_title(f"trace {root.trace_id[:12]}: {a.get('specsplit.task_type', '?')}, speculation "
                  f"{a.get('specsplit.speculation', '?')}, {a.get('specsplit.generated_tokens', 0)} tokens in "
                  f"{a.get('specsplit.rounds', 0)} rounds, {root.ms:.0f} ms", fontsize=10)
    top.legend(handles=[Patch(color=c, label=p) for p, c in COLORS.items()], ncol=5, fontsize=8, loc="upper right")
    labels = [p.label for p in task_rows]
    left = [0.0] * len(task_rows)
    for part in ("draft", "verify", "network", "gateway"):
        shares = [100 * p.shares[part] for p in task_rows]
        bottom.barh(labels, shares, left=left, color=COLORS[part], label=part)
        left = [x + s for x, s in zip(left, shares)]
    for y, p in enumerate(task_rows):
        bottom.text(101, y, f"{p.speedup:.2f}x (0-net {p.speedup_zero_network:.2f}x)", va="center", fontsize=8)
    bottom.set_xlim(0, 125)
    bottom.set_xlabel("% of spec-on request time, per task type (speedup vs spec-off at the right)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return root

"""`specsplit trace-report`: what the network costs, read from Generate traces.

Reads spans from OTLP-JSON files (specsplit's file exporter, or any OTLP/JSON lines) or from a
Jaeger query endpoint (HTTP API, /api/traces), rebuilds each Generate request and prints, per request
and per task type, where the time went and what the network did to the speedup. The formulas are in
docs/metrics.md ("Pricing the network")."""

from __future__ import annotations

import base64
import json
import sys
import urllib.parse
import urllib.request
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

from specsplit.serving import roundtime

GENERATE = "specsplit.gateway.v1.Gateway/Generate"
KINDS = {1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


@dataclass
class Span:
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root
    name: str
    kind: str  # server | client | internal
    service: str
    start_ns: int
    end_ns: int
    attributes: dict = field(default_factory=dict)

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _hex(value) -> str:
    if isinstance(value, bytes):
        return value.hex()
    if not value:
        return ""
    try:
        int(value, 16)
        if len(value) in (16, 32):
            return value.lower()
    except ValueError:
        pass
    return base64.b64decode(value).hex()  # proto3 JSON renders bytes as base64


def _kind(value) -> str:
    if isinstance(value, str) and not value.isdigit():
        return value.removeprefix("SPAN_KIND_").lower()
    return KINDS.get(int(value or 0), "internal")


def _json_value(value: dict):
    for key in ("stringValue", "boolValue", "doubleValue"):
        if key in value:
            return value[key]
    if "intValue" in value:
        return int(value["intValue"])
    return None


def load_otlp_json(message: dict) -> list[Span]:
    """Spans of one OTLP/JSON ExportTraceServiceRequest (ids hex or base64)."""
    spans = []
    for resource in message.get("resourceSpans", []):
        attrs = {a["key"]: _json_value(a.get("value", {})) for a in resource.get("resource", {}).get("attributes", [])}
        service = attrs.get("service.name", "")
        for scope in resource.get("scopeSpans", []):
            for s in scope.get("spans", []):
                spans.append(Span(_hex(s.get("traceId")), _hex(s.get("spanId")), _hex(s.get("parentSpanId")),
                                  s.get("name", ""), _kind(s.get("kind", 0)), service,
                                  int(s.get("startTimeUnixNano", 0)), int(s.get("endTimeUnixNano", 0)),
                                  {a["key"]: _json_value(a.get("value", {})) for a in s.get("attributes", [])}))
    return spans


def load_otlp_request(request) -> list[Span]:
    """Spans of an ExportTraceServiceRequest protobuf (what an OTLP/gRPC receiver gets)."""
    from google.protobuf.json_format import MessageToDict

    return load_otlp_json(MessageToDict(request))


def load_file(path: str | Path) -> list[Span]:
    """OTLP/JSON lines: one ExportTraceServiceRequest per line."""
    spans = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            spans += load_otlp_json(json.loads(line))
    return spans


def load_jaeger(url: str, service: str = "specsplit-gateway", limit: int = 100, lookback: str = "1h") -> list[Span]:
    """Traces from a Jaeger query service's HTTP API (the one its UI uses, port 16686)."""
    query = urllib.parse.urlencode({"service": service, "limit": limit, "lookback": lookback})
    with urllib.request.urlopen(f"{url.rstrip('/')}/api/traces?{query}", timeout=30) as response:
        return load_jaeger_json(json.load(response))


def load_jaeger_json(document: dict) -> list[Span]:
    spans = []
    for t in document.get("data", []):
        services = {pid: p.get("serviceName", "") for pid, p in t.get("processes", {}).items()}
        for s in t.get("spans", []):
            tags = {tag["key"]: tag.get("value") for tag in s.get("tags", [])}
            parent = next((r["spanID"] for r in s.get("references", []) if r.get("refType") == "CHILD_OF"), "")
            start = int(s["startTime"]) * 1000  # microseconds
            spans.append(Span(s["traceID"].rjust(32, "0"), s["spanID"], parent, s["operationName"],
                              str(tags.pop("span.kind", "internal")), services.get(s.get("processID"), ""),
                              start, start + int(s["duration"]) * 1000, tags))
    return spans


@dataclass
class RequestReport:
    trace_id: str
    task_type: str
    speculation: str  # on | off
    prompt_digest: str
    tokens: int
    rounds: int
    total_ms: float
    draft_ms: float  # drafter compute on the critical path (rounds that waited for their Propose)
    verify_ms: float  # target compute (prefill and verify forwards)
    network_ms: float  # calls beyond their servers' compute (specsplit.serving.roundtime), prefill included
    gateway_ms: float = 0.0  # the rest: the gateway's own work, tokenising, the client hop
    predraft_hits: int = 0  # rounds served by a pre-draft: no Propose on their critical path

    @property
    def ms_per_token(self) -> float:
        return self.total_ms / max(1, self.tokens)


def _ms(span: Span, name: str) -> float:
    return float(span.attributes.get(f"specsplit.{name}", 0.0) or 0.0)



def requests_from(spans: list[Span]) -> list[RequestReport]:
    """One report per Generate trace, from the gateway's prefill and round spans: the times the
    gateway measured and accounted once (specsplit.serving.roundtime), the same figures as the response's
    stats."""
    by_trace: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        by_trace[s.trace_id].append(s)
    reports = []
    for trace_id, members in by_trace.items():
        root = next((s for s in members if s.name == GENERATE and s.kind == "server"), None)
        if root is None:
            continue
        prefill, rounds = None, []
        for span in members:
            if span.parent_id == root.span_id and span.name == "prefill":
                prefill = span
            elif span.parent_id == root.span_id and span.name == "round":
                rounds.append(SimpleNamespace(**{k: _ms(span, k) for k in ("draft_ms", "verify_ms", "network_ms")},
                                              predrafted=bool(span.attributes.get("specsplit.predrafted"))))
        parts = roundtime.request_split(root.ms, _ms(prefill, "verify_ms") if prefill else 0.0,
                                        _ms(prefill, "network_ms") if prefill else 0.0, rounds)
        a = root.attributes
        report = RequestReport(
            trace_id, str(a.get("specsplit.task_type", "unspecified")), str(a.get("specsplit.speculation", "?")),
            str(a.get("specsplit.prompt_digest", "")), int(a.get("specsplit.generated_tokens", 0) or 0),
            int(a.get("specsplit.rounds", 0) or 0), root.ms, parts["draft"], parts["verify"], parts["network"],
            parts["gateway"])
        report.predraft_hits = int(a.get("specsplit.predraft_hits", 0) or 0)
        reports.append(report)
    return sorted(reports, key=lambda r: (r.task_type, r.trace_id))


@dataclass
class Pricing:
    """Spec-on requests against their spec-off baseline (see docs/metrics.md)."""

    label: str
    requests: int
    tokens: int
    shares: dict  # draft / verify / network / gateway share of spec-on time
    off_ms_per_token: float
    on_ms_per_token: float
    speedup: float  # off / on, as measured
    speedup_zero_network: float  # network removed from both
    rounds_per_token: float
    break_even_rtt_ms: float  # RTT added to each Propose at which spec-on time per token equals spec-off


def price(label: str, on: list[RequestReport], off_ms_per_token: float, off_network_per_token: float) -> Pricing:
    tokens = sum(r.tokens for r in on)
    total = sum(r.total_ms for r in on)
    parts = {k: sum(getattr(r, f"{k}_ms") for r in on) for k in ("draft", "verify", "network", "gateway")}
    on_per_token = total / tokens
    # Rounds whose Propose a split drafter's RTT would delay (a pre-draft hit hides it).
    rounds_per_token = sum(r.rounds - r.predraft_hits for r in on) / tokens
    zero_on = (total - parts["network"]) / tokens
    zero_off = off_ms_per_token - off_network_per_token
    # A split drafter: every round's Propose pays the RTT on top of what was measured here (the local
    # serialization and transport costs remain; bench --topology confirms the overhead per round grows
    # by the RTT).
    rtt = (off_ms_per_token - on_per_token) / rounds_per_token if rounds_per_token else 0.0
    return Pricing(label, len(on), tokens, {k: v / total for k, v in parts.items()}, off_ms_per_token, on_per_token,
                   off_ms_per_token / on_per_token, zero_off / zero_on, rounds_per_token, max(0.0, rtt))


def _per_token(reports: list[RequestReport], attr: str = "total_ms") -> float:
    return sum(getattr(r, attr) for r in reports) / max(1, sum(r.tokens for r in reports))


def report(spans: list[Span]) -> tuple[list[RequestReport], list[Pricing], list[Pricing], list[str]]:
    """The requests, pricing per task type and per spec-on request, and notes on what could not be
    priced. A request's baseline is the spec-off runs of the same prompt, else of its task type."""
    requests = requests_from(spans)
    on = [r for r in requests if r.speculation == "on" and r.tokens]
    off = [r for r in requests if r.speculation == "off" and r.tokens]
    notes = []
    off_by_prompt: dict[str, list[RequestReport]] = defaultdict(list)
    off_by_task: dict[str, list[RequestReport]] = defaultdict(list)
    for r in off:
        off_by_prompt[r.prompt_digest].append(r)
        off_by_task[r.task_type].append(r)
    rows: list[Pricing] = []
    groups: dict[str, list[RequestReport]] = defaultdict(list)
    for r in on:
        groups[r.task_type].append(r)
        groups["ALL"].append(r)
    for task, members in sorted(groups.items(), key=lambda kv: (kv[0] == "ALL", kv[0])):
        baseline = off if task == "ALL" else off_by_task.get(task, [])
        if not baseline:
            notes.append(f"{task}: no spec-off traces to compare with")
            continue
        rows.append(price(task, members, _per_token(baseline), _per_token(baseline, "network_ms")))
    per_request = []
    for r in on:
        # Per token, a request compares only with spec-off runs of the same length: the same prompt
        # with as many tokens (a 1-token warm-up on a prompt measured at 128 tokens is all prefill),
        # else its task type's.
        same = [b for b in off_by_prompt.get(r.prompt_digest, []) if b.tokens == r.tokens]
        baseline = same or off_by_task.get(r.task_type)
        if baseline:
            per_request.append(price(r.trace_id[:12], [r], _per_token(baseline), _per_token(baseline, "network_ms")))
    return requests, rows, per_request, notes


def print_report(spans: list[Span], out=sys.stdout, per_request: bool = True) -> dict:
    requests, task_rows, request_rows, notes = report(spans)
    on = sum(r.speculation == "on" for r in requests)
    print(f"trace-report: {len(requests)} Generate traces ({on} spec-on, {len(requests) - on} spec-off), "
          f"{len(spans)} spans", file=out)
    header = (f"{'':<14}{'n':>4}{'tokens':>7}{'draft%':>7}{'verify%':>8}{'net%':>6}{'gw%':>5}{'ms/tok off':>11}"
              f"{'ms/tok on':>10}{'speedup':>8}{'0-net':>7}{'rounds/tok':>11}{'break-even RTT':>16}")
    for title, rows in (("per task type", task_rows), ("per request", request_rows if per_request else [])):
        if not rows:
            continue
        print(f"\n{title}:", file=out)
        print(header, file=out)
        for p in rows:
            s = p.shares
            print(f"{p.label:<14}{p.requests:>4}{p.tokens:>7}{100 * s['draft']:>7.1f}{100 * s['verify']:>8.1f}"
                  f"{100 * s['network']:>6.1f}{100 * s['gateway']:>5.1f}{p.off_ms_per_token:>11.2f}"
                  f"{p.on_ms_per_token:>10.2f}{p.speedup:>7.2f}x{p.speedup_zero_network:>6.2f}x"
                  f"{p.rounds_per_token:>11.3f}{p.break_even_rtt_ms:>13.2f} ms", file=out)
    print("\nspeedup: spec-off ms/token / spec-on ms/token; 0-net: the same with every call's network time "
          "removed; break-even RTT: the round trip a drafter on another machine may add to each Propose "
          "before speculation loses (docs/metrics.md)", file=out)
    for note in notes:
        print(f"note: {note}", file=out)
    return {"requests": [asdict(r) for r in requests], "task_types": [asdict(p) for p in task_rows],
            "per_request": [asdict(p) for p in request_rows], "notes": notes}


def main(args, plot=None) -> int:
    """The trace-report command; `plot(spans, summary, path, trace_id)` draws --plot (traceplot.plot,
    passed in by the CLI: the plot module reads this one, not the other way round)."""
    spans: list[Span] = []
    for path in args.file or []:
        spans += load_file(path)
    if args.jaeger:
        spans += load_jaeger(args.jaeger, args.service, args.limit, args.lookback)
    if not spans:
        print("trace-report: no spans (give --file FILE or --jaeger URL)", file=sys.stderr)
        return 1
    if args.plot:
        from specsplit.extras import require

        require("matplotlib", "plot", "trace-report --plot")
    result = print_report(spans, per_request=not args.no_per_request)
    if args.plot:
        drawn = plot(spans, report(spans)[1], args.plot, args.plot_trace)
        print(f"plot: {args.plot} (trace {drawn.trace_id[:12]} and the shares per task type)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    return 0


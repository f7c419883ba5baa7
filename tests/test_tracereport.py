"""trace-report's arithmetic and readers, on spans built here (the services' traces are covered by
test_tracing.py)."""

from __future__ import annotations

import pytest

from specsplit.bench.tracereport import (
    GENERATE,
    Span,
    load_jaeger_json,
    load_otlp_json,
    report,
    requests_from,
)


def _request(trace: str, speculation: str, rounds: list[tuple[float, float, float, float]], tokens: int,
             digest: str = "p1", predrafted: int = 0, task: str = "code") -> list[Span]:
    """A Generate trace as the gateway writes it: a root, a 1 ms prefill (0.5 of it network) and one
    span per round from (draft compute ms, verify compute ms, network ms, gateway ms); the first
    `predrafted` rounds were served by a pre-draft. The root is 2 ms longer than prefill and rounds."""
    spans = [Span(trace, "root", "", GENERATE, "server", "specsplit-gateway", 0, 0,
                  {"specsplit.task_type": task, "specsplit.speculation": speculation,
                   "specsplit.generated_tokens": tokens, "specsplit.rounds": len(rounds),
                   "specsplit.prompt_digest": digest, "specsplit.predraft_hits": predrafted})]
    spans.append(Span(trace, "pre", "root", "prefill", "internal", "specsplit-gateway", 0, 1_000_000,
                      {"specsplit.verify_ms": 0.5, "specsplit.network_ms": 0.5}))
    t = 1_000_000
    for i, (draft, verify, network, gateway) in enumerate(rounds):
        hidden = i < predrafted
        ms = (0 if hidden else draft) + verify + network + gateway
        spans.append(Span(trace, f"r{i}", "root", "round", "internal", "specsplit-gateway", t, t + int(ms * 1e6),
                          {"specsplit.draft_ms": draft, "specsplit.verify_ms": verify,
                           "specsplit.network_ms": network, "specsplit.gateway_ms": gateway,
                           "specsplit.predrafted": hidden}))
        t += int(ms * 1e6)
    spans[0].end_ns = t + 2_000_000
    return spans


def test_shares_speedup_and_break_even_rtt():
    off = _request("off", "off", [(0, 10, 1, 0)] * 8, tokens=8)  # 11 ms per round, 1 token each
    on = _request("on", "on", [(2, 10, 2, 1)] * 4, tokens=8)  # 4 rounds of 15 ms, 2 tokens each
    (r_off, r_on) = sorted(requests_from(off + on), key=lambda r: r.speculation)
    assert r_on.network_ms == pytest.approx(4 * 2.0 + 0.5) and r_on.draft_ms == pytest.approx(8)
    assert r_on.verify_ms == pytest.approx(40.5)
    assert r_on.total_ms == pytest.approx(63) and r_on.gateway_ms == pytest.approx(63 - 8 - 40.5 - 8.5)
    _, tasks, per_request, notes = report(off + on)
    code = next(p for p in tasks if p.label == "code")
    t_off, t_on = (8 * 11 + 3) / 8, 63 / 8
    assert code.speedup == pytest.approx(t_off / t_on)
    assert code.speedup_zero_network == pytest.approx((t_off - 8.5 / 8) / ((63 - 8.5) / 8))
    # RTT*: T_on + rho * RTT = T_off, rho = 4 rounds / 8 tokens.
    assert code.break_even_rtt_ms == pytest.approx((t_off - t_on) / 0.5)
    assert per_request[0].break_even_rtt_ms == pytest.approx(code.break_even_rtt_ms) and not notes
    # A bench warm-up: the same prompt, one token. Per token it is all prefill; with no spec-off run
    # of its length (nor of its task type) it is priced against nothing.
    warm = _request("warm", "on", [(2, 10, 2, 1)], tokens=1, task="warmup")
    _, tasks, per_request, notes = report(off + on + warm)
    assert [p.label for p in per_request] == ["on"] and "warmup: no spec-off traces to compare with" in notes
    slow = _request("slow", "on", [(2, 10, 30, 0)] * 8, tokens=8, digest="p2")  # loses: RTT* is 0
    _, tasks, _, _ = report(off + slow)
    assert tasks[0].speedup < 1 and tasks[0].break_even_rtt_ms == 0


def test_only_the_critical_path_counts():
    """A pre-drafted round's drafting ran during the previous Verify: it costs the answer nothing;
    spans after the answer (a Release) or outside the gateway's own do not count either."""
    spans = _request("on", "on", [(2, 10, 2, 1)] * 4, tokens=8, predrafted=2)
    end = spans[0].end_ns
    spans += [Span("on", "crel", "root", "specsplit.verify.v1.Verifier/Release", "client", "specsplit-gateway",
                   end - 1_000_000, end + 3_000_000, {"specsplit.network_ms": 9.0})]
    (r,) = requests_from(spans)
    assert r.draft_ms == pytest.approx(2 * 2) and r.network_ms == pytest.approx(4 * 2 + 0.5)
    # Rounds served by a pre-draft hit do not pay a split drafter's RTT: break-even uses the others.
    off = _request("off", "off", [(0, 10, 1, 0)] * 8, tokens=8)
    code = next(p for p in report(off + spans)[1] if p.label == "code")
    assert code.rounds_per_token == pytest.approx(2 / 8)
    t_off, t_on = (8 * 11 + 3) / 8, r.total_ms / 8
    assert code.break_even_rtt_ms == pytest.approx((t_off - t_on) / (2 / 8))


def _to_otlp_json(spans: list[Span]) -> dict:
    def attrs(d):
        return [{"key": k, "value": {"boolValue": v} if isinstance(v, bool) else
                 {"intValue": str(v)} if isinstance(v, int) else
                 {"doubleValue": v} if isinstance(v, float) else {"stringValue": v}} for k, v in d.items()]
    kinds = {"internal": 1, "server": 2, "client": 3}
    by_service: dict[str, list] = {}
    for s in spans:
        by_service.setdefault(s.service, []).append({
            "traceId": s.trace_id, "spanId": s.span_id, "parentSpanId": s.parent_id, "name": s.name,
            "kind": kinds[s.kind], "startTimeUnixNano": str(s.start_ns), "endTimeUnixNano": str(s.end_ns),
            "attributes": attrs(s.attributes)})
    return {"resourceSpans": [{"resource": {"attributes": attrs({"service.name": name})},
                               "scopeSpans": [{"spans": members}]} for name, members in by_service.items()]}


def _to_jaeger(spans: list[Span]) -> dict:
    processes = {f"p{i}": {"serviceName": name} for i, name in enumerate(sorted({s.service for s in spans}))}
    pid = {v["serviceName"]: k for k, v in processes.items()}
    return {"data": [{"traceID": spans[0].trace_id, "processes": processes, "spans": [
        {"traceID": s.trace_id, "spanID": s.span_id, "operationName": s.name, "processID": pid[s.service],
         "references": [{"refType": "CHILD_OF", "spanID": s.parent_id}] if s.parent_id else [],
         "startTime": s.start_ns // 1000, "duration": (s.end_ns - s.start_ns) // 1000,
         "tags": [{"key": "span.kind", "type": "string", "value": s.kind}] +
                 [{"key": k, "value": v} for k, v in s.attributes.items()]} for s in spans]}]}


def test_otlp_json_and_jaeger_readers_rebuild_the_same_requests():
    spans = _request("a" * 32, "on", [(3, 2, 12, 10)] * 3, tokens=6)
    for s in spans:
        s.span_id = s.span_id.encode().hex().ljust(16, "0")[:16]
        s.parent_id = s.parent_id.encode().hex().ljust(16, "0")[:16] if s.parent_id else ""
    expected = requests_from(spans)
    assert requests_from(load_otlp_json(_to_otlp_json(spans))) == expected
    from_jaeger = requests_from(load_jaeger_json(_to_jaeger(spans)))
    assert [(r.rounds, r.tokens, r.speculation) for r in from_jaeger] == [(3, 6, "on")]
    assert from_jaeger[0].network_ms == pytest.approx(expected[0].network_ms, abs=0.01)


def test_plot_lays_out_the_critical_path_and_the_pre_drafts(tmp_path):
    from specsplit.bench.traceplot import pick, plot, segments

    on = _request("on", "on", [(2, 10, 2, 1)] * 3, tokens=6, predrafted=1)
    off = _request("off", "off", [(0, 10, 1, 0)] * 6, tokens=6)
    spans = on + off
    root = pick(spans)
    assert root.trace_id == "on"  # the spec-on request by default
    parts = segments(spans, root)
    critical = [p for p in parts if p[3] == 0]
    # Prefill, then the pre-drafted round without its draft, then two rounds with theirs.
    assert [p[0] for p in critical] == ["prefill", "network", "verify", "gateway"] + \
        ["draft", "network", "verify", "gateway"] * 2
    assert sum(p[2] for p in critical) == pytest.approx((on[0].end_ns - on[0].start_ns) / 1e6 - 2)
    assert all(b[1] == pytest.approx(a[1] + a[2]) for a, b in zip(critical[1:], critical[2:]))  # back to back
    assert not [p for p in parts if p[3] == 1]  # a pre-draft needs a Verify before it to overlap
    # A pre-draft after a round overlaps that round's Verify, on its own lane.
    later = _request("late", "on", [(2, 10, 2, 1)] * 3, tokens=6, predrafted=0)
    later[3].attributes["specsplit.predrafted"] = True
    lanes = segments(later, pick(later, "late"))
    (predraft,) = [p for p in lanes if p[3] == 1]
    verify_of_round_0 = [p for p in lanes if p[0] == "verify"][0]
    assert predraft[1] == verify_of_round_0[1] and predraft[2] == 2
    path = tmp_path / "trace.png"
    rows = report(spans)[1]
    assert plot(spans, rows, str(path)) is root
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    with pytest.raises(ValueError, match="no Generate trace"):
        pick(spans, "nope")

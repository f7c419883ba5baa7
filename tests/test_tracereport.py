"""trace-report's arithmetic and readers, on spans built here (the services' traces are covered by
test_tracing.py)."""

from __future__ import annotations

import pytest

from specsplit.tools.tracereport import (
    GENERATE,
    PROPOSE,
    VERIFY,
    Span,
    load_jaeger_json,
    load_otlp_json,
    report,
    requests_from,
)


def _request(trace: str, speculation: str, rounds: list[tuple[float, float, float, float]], tokens: int,
             digest: str = "p1") -> list[Span]:
    """A Generate trace: rounds of (Propose client ms, draft compute ms, Verify client ms, forward ms);
    every server span is 1 ms shorter than its client span (the network), the root 2 ms longer
    than the rounds (gateway work)."""
    spans = [Span(trace, "root", "", GENERATE, "server", "specsplit-gateway", 0, 0,
                  {"specsplit.task_type": "code", "specsplit.speculation": speculation,
                   "specsplit.generated_tokens": tokens, "specsplit.rounds": len(rounds),
                   "specsplit.prompt_digest": digest})]
    t = 0
    for i, (propose, draft, verify, forward) in enumerate(rounds):
        rid = f"r{i}"
        calls = [(PROPOSE, propose, draft, "specsplit-draft")] if propose else []
        calls.append((VERIFY, verify, forward, "specsplit-verify"))
        start = t
        for name, client_ms, compute, service in calls:
            c, s = f"c{i}{name[-3:]}", f"s{i}{name[-3:]}"
            spans.append(Span(trace, c, rid, name, "client", "specsplit-gateway", t, t + int(client_ms * 1e6)))
            spans.append(Span(trace, s, c, name, "server", service, t + 500_000, t + int((client_ms - 0.5) * 1e6),
                              {"specsplit.compute_ms": compute}))
            t += int(client_ms * 1e6)
        spans.append(Span(trace, rid, "root", "round", "internal", "specsplit-gateway", start, t))
    spans[0].end_ns = t + 2_000_000  # 2 ms of gateway work
    return spans


def test_shares_speedup_and_break_even_rtt():
    off = _request("off", "off", [(0, 0, 11, 10)] * 8, tokens=8)  # 11 ms per token
    on = _request("on", "on", [(3, 2, 12, 10)] * 4, tokens=8)  # 4 rounds of 15 ms, 2 tokens each
    (r_off, r_on) = sorted(requests_from(off + on), key=lambda r: r.speculation)
    assert r_on.network_ms == pytest.approx(4 * 2.0) and r_on.propose_network_ms == pytest.approx(4 * 1.0)
    assert r_on.draft_ms == pytest.approx(8) and r_on.verify_ms == pytest.approx(40)
    assert r_on.total_ms == pytest.approx(62) and r_on.gateway_ms == pytest.approx(62 - 8 - 40 - 8)
    _, tasks, per_request, notes = report(off + on)
    code = next(p for p in tasks if p.label == "code")
    t_off, t_on = (8 * 11 + 2) / 8, 62 / 8
    assert code.speedup == pytest.approx(t_off / t_on)
    assert code.speedup_zero_network == pytest.approx((t_off - 8 / 8) / ((62 - 8) / 8))
    # RTT*: T_on + rho * RTT = T_off, rho = 4 rounds / 8 tokens.
    assert code.break_even_rtt_ms == pytest.approx((t_off - t_on) / 0.5)
    assert per_request[0].break_even_rtt_ms == pytest.approx(code.break_even_rtt_ms) and not notes
    slow = _request("slow", "on", [(30, 2, 12, 10)] * 8, tokens=8, digest="p2")  # loses: RTT* is 0
    _, tasks, _, _ = report(off + slow)
    assert tasks[0].speedup < 1 and tasks[0].break_even_rtt_ms == 0


def test_only_the_critical_path_counts_pre_drafts_and_late_releases():
    """A pre-draft overlapping a Verify costs the answer nothing until that Verify returns, and a
    Release after the answer costs it nothing at all."""
    spans = _request("on", "on", [(3, 2, 12, 10)], tokens=2)
    t0 = 3_000_000  # the Verify runs [3, 15) ms
    # A pre-draft from 4 to 17 ms (2 ms past the Verify), 12 ms of it on the server, 8 ms compute.
    spans += [Span("on", "cpre", "r0", PROPOSE, "client", "specsplit-gateway", t0 + 1_000_000, t0 + 14_000_000),
              Span("on", "spre", "cpre", PROPOSE, "server", "specsplit-draft", t0 + 1_500_000, t0 + 13_500_000,
                   {"specsplit.compute_ms": 8.0})]
    end = spans[0].end_ns
    spans += [Span("on", "crel", "root", "specsplit.verify.v1.Verifier/Release", "client", "specsplit-gateway",
                   end - 1_000_000, end + 3_000_000),
              Span("on", "srel", "crel", "specsplit.verify.v1.Verifier/Release", "server", "specsplit-verify",
                   end, end + 2_000_000, {"specsplit.compute_ms": 0.0})]
    (r,) = requests_from(spans)
    pre = 2 / 13  # of the pre-draft's 13 ms, the 2 after the Verify returned
    assert r.draft_ms == pytest.approx(2 + 8 * pre)
    assert r.propose_network_ms == pytest.approx(1 + 1 * pre)
    assert r.network_ms == pytest.approx(1 + 1 + 1 * pre + 2 * 0.25)  # a quarter of the Release is inside
    # Rounds served by a pre-draft hit do not pay a split drafter's RTT: break-even uses the others.
    off = _request("off", "off", [(0, 0, 11, 10)] * 8, tokens=8)
    on = _request("on", "on", [(3, 2, 12, 10)] * 4, tokens=8)
    on[0].attributes["specsplit.predraft_hits"] = 2
    code = next(p for p in report(off + on)[1] if p.label == "code")
    assert code.rounds_per_token == pytest.approx(2 / 8)
    assert code.break_even_rtt_ms == pytest.approx(((8 * 11 + 2) / 8 - 62 / 8) / (2 / 8))


def _to_otlp_json(spans: list[Span]) -> dict:
    def attrs(d):
        return [{"key": k, "value": {"intValue": str(v)} if isinstance(v, int) else
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


def test_compose_commands_are_valid_cli_invocations():
    """deploy/compose.yaml runs `specsplit serve ...`: its flags must exist (the file is not run here)."""
    from pathlib import Path

    import yaml

    from specsplit.cli import _parser

    compose = yaml.safe_load((Path(__file__).parents[1] / "deploy" / "compose.yaml").read_text())
    roles = set()
    for name, service in compose["services"].items():
        if name == "jaeger":
            assert set(service["ports"]) >= {"16686:16686", "4317:4317"}
            continue
        command = service["command"]
        assert command[0] == "specsplit"
        args = _parser().parse_args(command[1:])
        roles.add(args.role)
        assert service["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
    assert roles == {"verify", "draft", "gateway"}

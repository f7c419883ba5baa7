"""Traces across the three real service processes, received by an in-test OTLP/gRPC collector built
on the published OTLP service definitions (opentelemetry-proto), and the OTLP-JSON file exporter."""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as otlp_metrics
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc as otlp_metrics_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc

from specsplit.gateway.v1 import gateway_pb2 as pb
from specsplit.gateway.v1 import gateway_pb2_grpc as pb_grpc
from specsplit.tools.launcher import Stack, StackConfig
from specsplit.tools.tracereport import Span, load_otlp_request, requests_from

GENERATE = "specsplit.gateway.v1.Gateway/Generate"


class Collector(otlp_grpc.TraceServiceServicer):
    def __init__(self):
        self.spans: list[Span] = []
        self.metrics: dict[str, set[str]] = defaultdict(set)  # service -> metric names
        self._lock = threading.Lock()

    def Export(self, request, context):
        with self._lock:
            self.spans += load_otlp_request(request)
        return otlp.ExportTraceServiceResponse()


class MetricsCollector(otlp_metrics_grpc.MetricsServiceServicer):
    def __init__(self, sink: Collector):
        self.sink = sink

    def Export(self, request, context):
        for resource in request.resource_metrics:
            service = next(a.value.string_value for a in resource.resource.attributes if a.key == "service.name")
            for scope in resource.scope_metrics:
                self.sink.metrics[service] |= {m.name for m in scope.metrics if _has_points(m)}
        return otlp_metrics.ExportMetricsServiceResponse()


def _has_points(metric) -> bool:
    kind = metric.WhichOneof("data")
    return bool(kind and getattr(metric, kind).data_points)


@pytest.fixture
def collector():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    sink = Collector()
    otlp_grpc.add_TraceServiceServicer_to_server(sink, server)
    otlp_metrics_grpc.add_MetricsServiceServicer_to_server(MetricsCollector(sink), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield sink, port
    server.stop(0)


def _generate(stub, prompt: str, speculation=pb.SPECULATION_ON, **kw) -> pb.GenerateResponse:
    # Without pre-drafting: one protocol per run (test_predraft covers pre-drafting).
    kw.setdefault("predraft", pb.PREDRAFT_OFF)
    return stub.Generate(pb.GenerateRequest(text=prompt, max_new_tokens=24, speculation=speculation,
                                            stop=pb.StopConditions(ignore_eos=True), task_type="test", **kw),
                         timeout=120)


def _stack(models, tmp_path, transport: str) -> Stack:
    return Stack(StackConfig(transport=transport, target_model=str(models["target"]),
                             draft_model=str(models["draft"]), dtype="float32", draft_dtype="float32",
                             drafter="ngram", self_head="none", run_dir=str(tmp_path)))


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_one_trace_per_generate_across_three_processes(models, tmp_path, collector, monkeypatch, transport):
    sink, port = collector
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "500")
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    responses = []
    with _stack(models, tmp_path, transport) as stack:
        with grpc.insecure_channel(stack.start()) as channel:
            stub = pb_grpc.GatewayStub(channel)
            for prompt, drafter in (("def add(a, b):", "model"), ("The quick brown fox", "ngram")):
                responses.append(_generate(stub, prompt, drafter=drafter, gamma=3))
            responses.append(_generate(stub, "Once upon a time", pb.SPECULATION_OFF))
    # The stack stopped: every process flushed its spans on SIGTERM.
    by_trace = defaultdict(list)
    for span in sink.spans:
        by_trace[span.trace_id].append(span)
    roots = [s for s in sink.spans if s.name == GENERATE]
    assert len(roots) == len(responses) == len({s.trace_id for s in roots})  # one trace per Generate
    others = [v for t, v in by_trace.items() if t not in {r.trace_id for r in roots}]
    assert all(s.name.endswith("/Info") for v in others for s in v)  # only the gateway's start-up checks
    assert {s.service for s in sink.spans} == {"specsplit-gateway", "specsplit-verify", "specsplit-draft"}
    requests = requests_from(sink.spans)
    for response, root in zip(responses, sorted(roots, key=lambda s: s.start_ns)):
        spans = {s.span_id: s for s in by_trace[root.trace_id]}
        assert root.parent_id == "" and root.attributes["specsplit.transport.draft"] == transport
        rounds = sorted((s for s in spans.values() if s.name == "round"), key=lambda s: s.start_ns)
        assert all(spans[s.parent_id] is root for s in rounds)
        assert len(rounds) == response.stats.rounds
        # The round spans carry the gateway's accounting, the very figures of the response's stats.
        for span, record in zip(rounds, response.stats.round_records):
            for field in ("drafted", "accepted"):
                assert span.attributes[f"specsplit.{field}"] == getattr(record, field)
            for field in ("draft_ms", "verify_ms", "network_ms", "gateway_ms"):
                assert span.attributes[f"specsplit.{field}"] == pytest.approx(getattr(record, field))
            assert (span.end_ns - span.start_ns) / 1e6 == pytest.approx(record.round_ms, abs=0.01)
        assert all(a.end_ns <= b.start_ns + 1000 for a, b in zip(rounds, rounds[1:]))  # one after another
        for server in (s for s in spans.values() if s.kind == "server" and s is not root):
            client = spans[server.parent_id]  # the matching client span, in the gateway's process
            assert client.kind == "client" and client.name == server.name and client.service == "specsplit-gateway"
            assert server.service == ("specsplit-draft" if ".draft." in server.name else "specsplit-verify")
            releasing = server.name.endswith(("/Release", "/EndSession"))
            assert server.name.endswith(("/Release", "/EndSession", "/Prefill", "/StartSession")), server.name
            assert spans[client.parent_id].name == (GENERATE if releasing else "prefill")
            assert client.end_ns - client.start_ns >= server.end_ns - server.start_ns  # network time >= 0
            assert server.attributes["rpc.request.size"] == client.attributes["rpc.request.size"]
            if server.name.endswith("/Prefill"):
                assert 0 < server.attributes["specsplit.compute_ms"] <= (server.end_ns - server.start_ns) / 1e6
        report = next(r for r in requests if r.trace_id == root.trace_id)
        assert report.speculation == ("on" if response.stats.speculation_used else "off")
        assert report.tokens == response.stats.generated_tokens
        assert report.network_ms == pytest.approx(response.stats.network_ms)  # one definition, both places
        assert report.verify_ms == pytest.approx(response.stats.verify_ms + response.stats.prefill_compute_ms)
    # Metrics went over OTLP too (flushed at shutdown).
    assert {"specsplit.acceptance_length", "specsplit.request.duration", "specsplit.round.network",
            "specsplit.round.gateway",
            "specsplit.speculation.enabled"} <= sink.metrics["specsplit-gateway"]
    assert "specsplit.draft.memory" in sink.metrics["specsplit-draft"]


def test_json_file_exporter_writes_otlp_json_lines(models, tmp_path, monkeypatch):
    trace_file = tmp_path / "traces.jsonl"
    monkeypatch.setenv("SPECSPLIT_OTLP_FILE", str(trace_file))
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    with _stack(models, tmp_path, "unix") as stack:
        with grpc.insecure_channel(stack.start()) as channel:
            response = _generate(pb_grpc.GatewayStub(channel), "def add(a, b):", drafter="ngram")
    lines = trace_file.read_text().splitlines()
    assert all("resourceSpans" in json.loads(line) for line in lines)
    from specsplit.tools.tracereport import load_file

    spans = load_file(trace_file)
    assert {s.service for s in spans} == {"specsplit-gateway", "specsplit-verify", "specsplit-draft"}
    (request,) = requests_from(spans)
    assert request.rounds == response.stats.rounds and len(request.trace_id) == 32

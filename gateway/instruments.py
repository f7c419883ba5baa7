"""What a finished request leaves behind: its GenerationStats, its prefill and round spans, the
gateway's metrics and the controller's observation, all made from the facts the round loop recorded
(gateway.state.Round), after the answer is known, so none of it sits on a round's critical path."""

from __future__ import annotations

import contextlib
import hashlib
import time
from array import array

from opentelemetry import trace
from opentelemetry.metrics import Observation

from gateway.controller import Controller, Outcome, RoundFacts
from gateway.state import Request
from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.serving import roundtime
from specsplit.serving.settings import MAX_DRAFT
from specsplit.serving.telemetry import meter, tracer

POSITION_BUCKETS = (32, 128, 512)  # output position of a round's first token: 0-31, 32-127, 128-511, 512+


def position_bucket(position: int) -> str:
    low = 0
    for high in POSITION_BUCKETS:
        if position < high:
            return f"{low}-{high - 1}"
        low = high
    return f"{low}+"


SECONDS = [0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1]
REQUEST_SECONDS = [0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128]


class GatewayMetrics:
    """The gateway's instruments (docs/metrics.md lists each with its unit and attributes). Seconds
    throughout; the spec-decode counters follow vLLM's, so the acceptance rate is a PromQL ratio:
    rate(accepted_tokens) / rate(draft_tokens)."""

    def __init__(self, controller: Controller, replicas=()):
        """replicas: the services' gateway.replicas.Replicas, whose sessions and health are gauged."""
        self._controller, self._replicas = controller, list(replicas)
        m = meter()
        self.acceptance = m.create_histogram(
            "specsplit.acceptance_length", unit="{token}",
            description="tokens committed per verify round (accepted drafts + the target's own token)",
            explicit_bucket_boundaries_advisory=[1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 33])
        self.drafts = m.create_counter("specsplit.spec_decode.drafts", unit="{round}",
                                       description="verify rounds that carried drafts")
        self.draft_tokens = m.create_counter("specsplit.spec_decode.draft_tokens", unit="{token}",
                                             description="draft tokens sent to the verifier (every node of a tree)")
        self.accepted_tokens = m.create_counter("specsplit.spec_decode.accepted_tokens", unit="{token}",
                                                description="draft tokens the target accepted")
        self.drafted_at = m.create_counter(
            "specsplit.spec_decode.drafts_per_position", unit="{round}",
            description="rounds whose draft reached draft_position (a tree: its depth)")
        self.accepted_at = m.create_counter(
            "specsplit.spec_decode.accepted_tokens_per_position", unit="{token}",
            description="rounds whose draft was accepted up to draft_position; divided by drafts_per_position: "
                        "the acceptance at that position")
        def seconds(name: str, description: str, buckets=SECONDS):
            return m.create_histogram(name, unit="s", explicit_bucket_boundaries_advisory=buckets,
                                      description=description)

        self.draft = seconds("specsplit.round.draft_compute", "drafter compute per round (draft service)")
        self.verify = seconds("specsplit.round.verify_compute",
                              "target forward and acceptance per round (verify service)")
        self.network = seconds("specsplit.round.network", "round calls' wall time minus server compute, per round")
        self.gateway = seconds("specsplit.round.gateway", "the gateway's own work per round (round time - calls)")
        self.latency = seconds("specsplit.request.duration", "Generate wall time on the gateway", REQUEST_SECONDS)
        self.ttft = seconds("specsplit.request.time_to_first_token",
                            "from the call's arrival to its first token leaving the gateway", REQUEST_SECONDS)
        self.tpot = seconds("specsplit.request.time_per_output_token",
                            "after the first token: decode wall time / (tokens - 1)", SECONDS[3:] + [2, 5])
        self.requests = m.create_counter("specsplit.requests", unit="{request}",
                                         description="Generate calls ended, by finish reason and gRPC status")
        self.predrafts = m.create_counter(
            "specsplit.predraft", unit="{pre-draft}",
            description="pre-drafts started while a Verify was in flight, by outcome (hit: used by the next round)")
        m.create_observable_gauge("specsplit.speculation.enabled", callbacks=[self._observe_enabled],
                                  description="1 while the controller speculates for the task type and drafter")
        m.create_observable_gauge("specsplit.speculation.gamma", callbacks=[self._observe_gamma],
                                  description="the controller's gamma for the task type and drafter")
        m.create_observable_gauge("specsplit.replica.sessions", unit="{session}", callbacks=[self._observe_sessions],
                                  description="requests pinned to each verify and draft replica")
        m.create_observable_gauge("specsplit.replica.available", callbacks=[self._observe_available],
                                  description="1 while the replica takes new sessions (serving, fits, not stalled)")

    def round(self, record: pb.RoundRecord, task_type: str, drafter: str, position: int) -> None:
        attrs = {"task_type": task_type or "unspecified", "drafter": drafter}
        if record.drafted:
            self.acceptance.record(record.accepted + 1, {**attrs, "position": position_bucket(position)})
            self.draft.record(record.draft_ms / 1e3, attrs)
            self.drafts.add(1, attrs)
            self.draft_tokens.add(record.drafted, attrs)
            self.accepted_tokens.add(record.accepted, attrs)
            for d in range(1, min(record.depth or record.drafted, MAX_DRAFT) + 1):
                at = {**attrs, "draft_position": d}
                self.drafted_at.add(1, at)
                if d <= record.accepted:
                    self.accepted_at.add(1, at)
        if record.lookup_steps or record.head_steps:  # the verifier's own drafts, decoding ahead (no positions)
            self.drafts.add(record.lookup_steps + record.head_steps, attrs)
            self.draft_tokens.add(record.lookup_drafted + record.head_drafted, attrs)
            self.accepted_tokens.add(record.lookup_accepted + record.head_accepted, attrs)
        self.verify.record(record.verify_ms / 1e3, attrs)
        self.network.record(record.network_ms / 1e3, attrs)
        self.gateway.record(record.gateway_ms / 1e3, attrs)

    def request(self, stats: pb.GenerationStats) -> None:
        task = stats.task_type or "unspecified"
        self.latency.record(stats.total_ms / 1e3, {"task_type": task,
                                                   "speculation": "on" if stats.speculation_used else "off"})
        if stats.predraft_attempts:
            self.predrafts.add(stats.predraft_hits, {"task_type": task, "outcome": "hit"})
            self.predrafts.add(stats.predraft_attempts - stats.predraft_hits, {"task_type": task, "outcome": "miss"})

    def ended(self, task_type: str, speculation: bool | None, finish_reason: int, status: str,
              first_token_s: float | None, tokens: int, total_s: float) -> None:
        """A Generate call ended (answered, refused, failed or cancelled): its count, and for calls
        that produced tokens their time to first token and time per output token."""
        task = task_type or "unspecified"
        reason = pb.FinishReason.Name(finish_reason).removeprefix("FINISH_REASON_").lower()
        self.requests.add(1, {"task_type": task, "finish_reason": reason, "status": status})
        if first_token_s is None:
            return
        attrs = {"task_type": task, "speculation": {True: "on", False: "off", None: "unknown"}[speculation]}
        self.ttft.record(first_token_s, attrs)
        if tokens > 1:
            self.tpot.record((total_s - first_token_s) / (tokens - 1), attrs)

    def _observe_enabled(self, _options):
        return [Observation(int(st.enabled), {"task_type": task, "drafter": drafter})
                for (task, drafter), st in self._controller.states().items()]

    def _observe_sessions(self, _options):
        return self._per_replica(lambda r: r.sessions)

    def _observe_available(self, _options):
        return self._per_replica(lambda r: int(r.available))

    def _per_replica(self, value) -> list[Observation]:
        return [Observation(value(r), {"service": rs.service, "replica": r.address})
                for rs in self._replicas for r in list(rs.replicas.values())]

    def _observe_gamma(self, _options):
        return [Observation(st.gamma, {"task_type": task, "drafter": drafter})
                for (task, drafter), st in self._controller.states().items()]


class Instruments:
    def __init__(self, controller: Controller, metrics: GatewayMetrics, target_exact: bool,
                 transport: dict[str, str]):
        self._controller, self._metrics, self._exact = controller, metrics, target_exact
        self._transport = {f"specsplit.transport.{k}": v for k, v in transport.items()}  # "unix" or "tcp"

    def finished(self, request: Request, generated: int) -> pb.GenerationStats:
        """The request's stats; also records its metrics, spans and the controller's observation."""
        plan, drafting = request.plan, request.speculates or bool(request.drafter.lost)
        records = [_record(r) for r in request.measured.rounds]
        stats = _stats(request, records, generated, self._exact)
        common = self._common(request)
        positions = [1]  # output position of each round's first token
        for record in records:
            positions.append(positions[-1] + record.accepted + 1)
        self._spans(request, records, positions, common)
        drafter = plan.drafter if drafting else ""
        for record, position in zip(records, positions):
            self._metrics.round(record, plan.task_type, drafter, position)
        self._metrics.request(stats)
        if not request.drafter.lost:  # a failover mid-request says nothing about what speculation is worth
            self._controller.observe(plan.task_type, plan.drafter, plan.decision, outcome(stats), plan.predraft)
        span = trace.get_current_span()
        _describe(span, stats, {**common, "specsplit.prompt_digest": _digest(plan.prompt_ids)})
        if request.drafter.lost and span.is_recording():
            span.add_event("drafter-lost", {"specsplit.error": request.drafter.lost,
                                            "specsplit.rounds_after": len(records) - request.drafter.lost_at})
        return stats

    @contextlib.contextmanager
    def prefill(self, request: Request):
        """The prefill span, live: the Prefill and StartSession calls are its children."""
        with tracer().start_as_current_span("prefill", attributes={
                **self._common(request), "specsplit.prompt_tokens": len(request.plan.prompt_ids)}) as span:
            yield
            if span.is_recording():
                span.set_attributes({"specsplit.verify_ms": request.measured.prefill_verify_ns / 1e6,
                                     "specsplit.network_ms": _prefill_network_ms(request)})

    def _common(self, request: Request) -> dict:
        return {"specsplit.task_type": request.plan.task_type or "unspecified", **self._transport}

    def _spans(self, request: Request, records: list[pb.RoundRecord], positions: list[int], common: dict) -> None:
        """One span per round, under the current (Generate) span, with the times they really had."""
        if not trace.get_current_span().is_recording():
            return
        offset = time.time_ns() - time.perf_counter_ns()  # perf_counter marks -> wall clock
        start = request.measured.decode_mark + offset
        for i, (r, record, position) in enumerate(zip(request.measured.rounds, records, positions)):
            span = tracer().start_span("round", start_time=start, attributes={
                **common, "specsplit.round": i, "specsplit.position": position,
                "specsplit.gamma": request.plan.gamma if record.drafted else 0,
                "specsplit.drafted": record.drafted, "specsplit.accepted": record.accepted,
                "specsplit.next_token": "none" if not record.drafted else
                ("bonus" if record.accepted == record.drafted else "recovered"),
                "specsplit.draft_source": record.draft_source, "specsplit.draft_ms": record.draft_ms,
                "specsplit.verify_ms": record.verify_ms, "specsplit.network_ms": record.network_ms,
                "specsplit.gateway_ms": record.gateway_ms, "specsplit.feature_bytes": record.feature_bytes,
                "specsplit.proposal_bytes": record.proposal_bytes, "specsplit.predrafted": record.predrafted})
            start += r.round_ns
            span.end(end_time=start)


def outcome(stats: pb.GenerationStats) -> Outcome:
    """A response's stats as the controller reads them."""
    return Outcome([RoundFacts(r.drafted, r.accepted, r.draft_ms, r.verify_ms, r.network_ms, r.depth, r.expected,
                               r.decoded, r.round_ms, r.asked, r.copy_in_sight)
                    for r in stats.round_records], stats.generated_tokens, stats.decode_ms, stats.speculation_used,
                   *_per_forward(stats))


def _per_forward(stats: pb.GenerationStats) -> tuple[float, float]:
    """The verifier's mean compute and rows per forward after prefill ((0, 1): none)."""
    forwards = stats.forwards or stats.rounds
    if not forwards or stats.verify_ms <= 0:
        return 0.0, 1.0
    return stats.verify_ms / forwards, 1 + stats.drafted_tokens / forwards


def _record(r) -> pb.RoundRecord:
    time_ = roundtime.split(r.round_ns, r.draft_ns, r.draft_call_ns, r.verify_ns, r.verify_call_ns, r.head_ns)
    return pb.RoundRecord(drafted=r.drafted, accepted=r.accepted, draft_ms=(r.draft_ns + r.head_ns) / 1e6,
                          verify_ms=r.verify_ns / 1e6, network_ms=time_.network_ms, gateway_ms=time_.gateway_ms,
                          round_ms=r.round_ns / 1e6, draft_source=r.source, feature_bytes=r.feature_bytes,
                          proposal_bytes=r.proposal_bytes, predrafted=r.predrafted, depth=r.depth,
                          expected=r.expected, batch_rows=r.batch_rows, batch_calls=r.batch_calls,
                          decoded=r.decoded, lookup_drafted=r.lookup_drafted, lookup_accepted=r.lookup_accepted,
                          lookup_steps=r.lookup_steps, head_drafted=r.head_drafted, head_accepted=r.head_accepted,
                          head_steps=r.head_steps, forced=r.forced, forced_accepted=r.forced_accepted, asked=r.asked,
                          copy_in_sight=r.copy)


def _prefill_network_ms(request: Request) -> float:
    """The prefill's calls beyond the verifier's compute (the drafter's start runs alongside)."""
    return max(0, request.measured.prefill_ns - request.measured.prefill_verify_ns) / 1e6


def _stats(request: Request, rounds: list[pb.RoundRecord], generated: int, exact: bool) -> pb.GenerationStats:
    plan, drafting = request.plan, request.speculates or bool(request.drafter.lost)
    # A round that decoded ahead drafted in the verifier: its lookups, and the tokens a constraint forced.
    drafted = sum(r.drafted + r.lookup_drafted + r.head_drafted + (0 if r.drafted else r.forced) for r in rounds)
    accepted = sum(r.accepted + r.lookup_accepted + r.head_accepted + (0 if r.drafted else r.forced_accepted)
                   for r in rounds)
    forwards = sum(_forwards(r) for r in rounds)
    bonus = sum(1 for r in rounds if r.drafted and r.accepted == r.depth)
    params = plan.sampling
    sampled = params.temperature > 0
    end = time.perf_counter_ns()
    return pb.GenerationStats(
        prompt_tokens=len(plan.prompt_ids), generated_tokens=generated, prefill_ms=request.measured.prefill_ns / 1e6,
        prefill_compute_ms=request.measured.prefill_verify_ns / 1e6,
        decode_ms=(end - request.measured.decode_mark) / 1e6, total_ms=(end - request.measured.started) / 1e6,
        rounds=len(rounds), drafted_tokens=drafted, accepted_tokens=accepted,
        mean_acceptance_length=(accepted + forwards) / forwards if rounds else 0.0,
        forwards=forwards,
        speculation_used=drafting, drafter=plan.drafter if drafting else "", gamma=plan.gamma if drafting else 0,
        draft_ms=sum(r.draft_ms for r in rounds), verify_ms=sum(r.verify_ms for r in rounds),
        network_ms=sum(r.network_ms for r in rounds) + _prefill_network_ms(request),
        gateway_ms=sum(r.gateway_ms for r in rounds), exact=exact, task_type=plan.task_type,
        round_records=rounds, bonus_tokens=bonus, recovered_tokens=sum(1 for r in rounds if r.drafted) - bonus,
        seed=params.seed if sampled else 0, verify_method=params.verification.value,
        speculation_reason=request.drafter.fallback or plan.decision.reason,
        shared_memory=request.links.shm_verify and request.links.shm_draft and drafting,
        fast_path=request.links.fast_path,
        predraft_attempts=request.measured.predraft_attempts, predraft_hits=request.measured.predraft_hits,
        tree_budget=plan.tree_budget if drafting else 0, prefix_cached_tokens=request.measured.prefix_cached,
        prefill_chunks=request.measured.prefill_chunks, resumes=request.measured.resumes,
        resume_ms=request.measured.resume_ns / 1e6,
        forced_tokens=sum(r.forced_accepted for r in request.measured.rounds),
        constraint_complete=plan.constraint is not None and request.measured.constraint_complete)


def _forwards(r: pb.RoundRecord) -> int:
    """The verifier's forwards in a round: one, or one per step of a decode-ahead (each step commits
    its accepted lookup or forced drafts and its own token)."""
    return 1 if r.drafted else 1 + r.decoded - r.lookup_accepted - r.head_accepted - r.forced_accepted


def _digest(ids: list[int]) -> str:
    """Pairs a spec-on request with spec-off runs of the same prompt in trace-report, without the text."""
    return hashlib.sha256(array("I", ids).tobytes()).hexdigest()[:16]


def _describe(span, stats: pb.GenerationStats, common: dict) -> None:
    """The Generate span's summary of the request (what trace-report groups and compares by)."""
    if span.is_recording():
        span.set_attributes({
            **common, "specsplit.speculation": "on" if stats.speculation_used else "off",
            "specsplit.drafter": stats.drafter, "specsplit.gamma": stats.gamma,
            "specsplit.generated_tokens": stats.generated_tokens, "specsplit.prompt_tokens": stats.prompt_tokens,
            "specsplit.prefix_cached_tokens": stats.prefix_cached_tokens,
            "specsplit.rounds": stats.rounds, "specsplit.drafted": stats.drafted_tokens,
            "specsplit.accepted": stats.accepted_tokens, "specsplit.verify_method": stats.verify_method,
            "specsplit.mean_acceptance_length": stats.mean_acceptance_length,
            "specsplit.speculation_reason": stats.speculation_reason,
            "specsplit.predraft_attempts": stats.predraft_attempts, "specsplit.predraft_hits": stats.predraft_hits,
            "specsplit.shared_memory": stats.shared_memory, "specsplit.fast_path": stats.fast_path})

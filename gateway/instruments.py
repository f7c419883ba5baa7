"""The gateway's metrics (OTel instruments; no-ops unless specsplit.telemetry set up a reader)."""

from __future__ import annotations

from opentelemetry.metrics import Observation

from specsplit.gateway.v1 import gateway_pb2 as pb
from specsplit.telemetry import meter

POSITION_BUCKETS = (32, 128, 512)  # output position of a round's first token: 0-31, 32-127, 128-511, 512+


def position_bucket(position: int) -> str:
    low = 0
    for high in POSITION_BUCKETS:
        if position < high:
            return f"{low}-{high - 1}"
        low = high
    return f"{low}+"


class GatewayMetrics:
    def __init__(self, controller):
        self._controller = controller
        m = meter()
        self.acceptance = m.create_histogram(
            "specsplit.acceptance_length", unit="{token}",
            description="tokens committed per verify round (accepted drafts + the target's own token)",
            explicit_bucket_boundaries_advisory=[1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 33])
        ms = [0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
        self.draft = m.create_histogram("specsplit.round.draft_compute", unit="ms",
                                        explicit_bucket_boundaries_advisory=ms,
                                        description="drafter compute per round (draft service)")
        self.verify = m.create_histogram("specsplit.round.verify_compute", unit="ms",
                                         explicit_bucket_boundaries_advisory=ms,
                                         description="target forward and acceptance per round (verify service)")
        self.network = m.create_histogram("specsplit.round.network", unit="ms", explicit_bucket_boundaries_advisory=ms,
                                          description="round trips minus server time, per round")
        self.latency = m.create_histogram(
            "specsplit.request.duration", unit="s", description="Generate wall time on the gateway",
            explicit_bucket_boundaries_advisory=[0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128])
        self.predrafts = m.create_counter(
            "specsplit.predraft", unit="{pre-draft}",
            description="pre-drafts started while a Verify was in flight, by outcome (hit: used by the next round)")
        m.create_observable_gauge("specsplit.speculation.enabled", callbacks=[self._observe_enabled],
                                  description="1 while the controller speculates for the task type and drafter")
        m.create_observable_gauge("specsplit.speculation.gamma", callbacks=[self._observe_gamma],
                                  description="the controller's gamma for the task type and drafter")

    def round(self, record: pb.RoundRecord, task_type: str, drafter: str, position: int) -> None:
        attrs = {"task_type": task_type or "unspecified", "drafter": drafter}
        if record.drafted:
            self.acceptance.record(record.accepted + 1, {**attrs, "position": position_bucket(position)})
            self.draft.record(record.draft_ms, attrs)
        self.verify.record(record.verify_ms, attrs)
        self.network.record(record.network_ms, attrs)

    def request(self, stats: pb.GenerationStats) -> None:
        task = stats.task_type or "unspecified"
        self.latency.record(stats.total_ms / 1e3, {"task_type": task,
                                                   "speculation": "on" if stats.speculation_used else "off"})
        if stats.predraft_attempts:
            self.predrafts.add(stats.predraft_hits, {"task_type": task, "outcome": "hit"})
            self.predrafts.add(stats.predraft_attempts - stats.predraft_hits, {"task_type": task, "outcome": "miss"})

    def _observe_enabled(self, _options):
        return [Observation(int(st.enabled), {"task_type": task, "drafter": drafter})
                for (task, drafter), st in self._controller.states().items()]

    def _observe_gamma(self, _options):
        return [Observation(st.gamma, {"task_type": task, "drafter": drafter})
                for (task, drafter), st in self._controller.states().items()]

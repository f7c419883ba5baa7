"""Where a round's time goes: the one definition that the gateway's stats, the bench, the topology
bench and trace-report all use (docs/metrics.md#time).

A round's wall time (from the end of the previous round to the end of this one, as the gateway
sees it) splits into

* compute: the verifier's forward and acceptance, plus the drafter's work if the gateway waited for
  it (a pre-drafted round did not: its Propose ran during the previous Verify);
* network: for each call the gateway waited for, its wall time minus the compute its server
  reported: transport, serialization, the services' own handling outside compute, queueing;
* gateway: the rest: the gateway's own work between and around the calls (building requests,
  text, streaming the chunk to the client).

Overhead = network + gateway = round wall time - compute: what a round costs beyond the models."""

from __future__ import annotations

from typing import NamedTuple


class RoundTime(NamedTuple):
    compute_ms: float
    network_ms: float
    gateway_ms: float

    @property
    def overhead_ms(self) -> float:
        return self.network_ms + self.gateway_ms


def split(round_ns: int, draft_ns: int, draft_call_ns: int, verify_ns: int, verify_call_ns: int,
          verify_draft_ns: int = 0) -> RoundTime:
    """draft_call_ns 0: the gateway did not wait for a Propose this round (draft_ns is then not on
    the critical path). verify_draft_ns: the verifier's own drafting inside the Verify call (its
    feature head: VerifyResponse.head_ns), compute on the critical path, not network."""
    draft = draft_ns if draft_call_ns else 0
    network = max(0, draft_call_ns - draft) + max(0, verify_call_ns - verify_ns - verify_draft_ns)
    draft += verify_draft_ns
    gateway = max(0, round_ns - draft_call_ns - verify_call_ns)
    return RoundTime((draft + verify_ns) / 1e6, network / 1e6, gateway / 1e6)



def request_split(total_ms: float, prefill_compute_ms: float, prefill_network_ms: float, rounds) -> dict[str, float]:
    """A request's time (ms) by part, from its rounds (anything with draft_ms, verify_ms, network_ms
    and predrafted: RoundRecords or their spans' attributes): draft (on the critical path), verify
    (prefill included), network (prefill included) and gateway, the rest of total_ms (the gateway's
    own work, tokenising, waiting). The bench and trace-report both report these shares."""
    draft = verify = network = 0.0
    for r in rounds:
        draft += 0.0 if r.predrafted else r.draft_ms
        verify += r.verify_ms
        network += r.network_ms
    verify += prefill_compute_ms
    network += prefill_network_ms
    return {"draft": draft, "verify": verify, "network": network,
            "gateway": max(0.0, total_ms - draft - verify - network)}

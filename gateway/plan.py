"""A request as the gateway decided to serve it (gateway.server.Gateway.plan), read by the round
loop and the drafter side alike."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.controller import Decision
from gateway.gate import Prior
from specsplit.api.common.v1 import common_pb2 as cpb
from specsplit.speculation.params import SamplingParams


@dataclass(frozen=True)
class Plan:
    """A validated request, in token ids."""

    prompt_ids: list[int]
    max_new_tokens: int
    stop_strings: tuple[str, ...]
    eos_ids: frozenset[int]
    speculate: bool
    may_fall_back: bool  # AUTO: run without speculation if the draft service is down
    gamma: int
    drafter: str
    task_type: str
    needs_features: bool = False  # the drafter reads target features: the verifier returns them
    sampling: SamplingParams = SamplingParams()  # temperature 0: greedy
    decision: Decision = Decision(True, 4, "forced")  # the controller's, for this request
    predraft: bool = False  # asynchronous drafting: draft the next block while Verify is in flight
    tree_budget: int = 0  # most draft tokens per round in a token tree; 0: chains of gamma
    score_scale: float = 1.0  # the controller's calibration of the drafter's tree scores
    skip_prefix_cache: bool = False  # a cold prefill (GenerateRequest.skip_prefix_cache)
    logprobs: cpb.LogprobsRequest = field(default_factory=cpb.LogprobsRequest)  # GenerateRequest.logprobs
    prior: Prior | None = None  # the gate's start (gateway.gate); None: ask the drafter every round
    constraint: cpb.Constraint | None = None  # structured output (the verifier masks every choice)
    # The verifier drafts for the request itself, each step of its decode-ahead, and no draft service
    # takes part: copies from the context (n-gram, hybrid) and its feature head (self, hybrid, where
    # the verifier runs the drafter's head: docs/architecture.md#drafted-in-the-verifier).
    in_verifier: bool = False
    lookup_gamma: int = 0  # most tokens the verifier's own lookup drafts a step (VerifyRequest.lookup_gamma)
    head_gamma: int = 0  # most tokens the verifier's own head drafts a step (VerifyRequest.head_gamma)

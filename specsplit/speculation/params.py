"""What a request asks of sampling, with no torch (the gateway checks and carries these without
it): how drafts are verified, the warp and seed, and which log-probabilities come back. The maths
is specsplit.speculation.sampling's."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class Method(enum.Enum):
    """How drafts are verified (docs/protocol.md#sampling)."""

    GREEDY = "greedy"  # temperature 0: the target's argmax
    COUPLED = "coupled"  # the target's Gumbel-max choice under (seed, position) noise: drafter-invariant
    REJECTION = "rejection"  # speculative sampling: min(1, p/q), then the residual norm(max(0, p - q))


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling, the one type from the gateway's edge to the acceptance walks (the wire
    carries it as specsplit.common.v1.Sampling: specsplit.serving.wire)."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0
    method: Method = Method.COUPLED  # how drafts are verified at temperature > 0

    @property
    def verification(self) -> Method:
        """How drafts are verified under these params: GREEDY at temperature 0, else the method."""
        return Method.GREEDY if self.temperature == 0 else self.method

    def check(self) -> None:
        if self.method not in (Method.COUPLED, Method.REJECTION):
            raise ValueError(f"unknown verify method {self.method!r}; use coupled or rejection")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature {self.temperature} must be a finite number >= 0")
        if self.top_k < 0:
            raise ValueError(f"top_k {self.top_k} must be >= 0")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p {self.top_p} is not in (0, 1]")


MAX_TOP_LOGPROBS = 20  # as OpenAI's top_logprobs


@dataclass(frozen=True)
class Logprobs:
    """Which log-probabilities a session returns: each generated token's, the `top` most likely
    alternatives at each position, and each prompt token's (from the second on)."""

    generated: bool = False
    top: int = 0
    prompt: bool = False

    def check(self) -> None:
        if not 0 <= self.top <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top logprobs {self.top} is not in [0, {MAX_TOP_LOGPROBS}]")


TokenLogprob = tuple[int, float, list[int], list[float]]  # token, its logprob, top ids, their logprobs

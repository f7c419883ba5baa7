"""What a wider forward costs now, for the verifier's own lookup depth (decoding.Decoding.draft):
the width curve measured at start (Info.forward_ms_by_rows) holds for the machine as it was then,
and a machine of this kind moved from 1.27x to 2.2x for five rows within an hour (a compute-bound
spell: each int8 row costs its own pass over the weights). So each lone forward of a decode-ahead
updates a session's own one-row step and the service's cost of one more row, and the depth rule
prices rows at those. Not under rejection sampling, whose text for a seed depends on what was
drafted: a depth that followed the machine's moment would make a seed's text follow it too; those
sessions keep the start curve."""

from __future__ import annotations

from specsplit.spec.ewma import Ewma
from specsplit.spec.sampling import Method, SamplingParams

DECAY = 0.9  # per forward
SPIKE = 3.0  # a forward this many times the session's step was preempted, not wide: not a sample


class Widths:
    def __init__(self):
        self.row_ms = Ewma(DECAY)  # what one more row adds to a forward now, ms

    def add(self, step_ms: Ewma, rows: int, ms: float) -> None:
        """A lone forward of `rows` rows for a session whose one-row steps are `step_ms`."""
        one = step_ms.value
        if one is not None and ms > SPIKE * one * rows:
            return
        if rows == 1:
            step_ms.add(ms)
        elif one is not None:
            self.row_ms.add(max(0.0, ms - one) / (rows - 1))

    def curve(self, step_ms: Ewma, start: list[float], sampling: SamplingParams | None = None) -> list[float]:
        """A forward's ms by rows (1 up, as long as `start`) for that session now; `start` until
        both its step and a wider forward have been timed, and for a session sampled under
        rejection sampling (`sampling`)."""
        one, row = step_ms.value, self.row_ms.value
        if one is None or row is None or (sampling is not None and sampling.verification is Method.REJECTION):
            return start
        return [one + row * extra for extra in range(len(start))]

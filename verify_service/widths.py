"""What a wider forward costs now, for the verifier's own lookup depth (decoding.Decoding.draft):
the width curve measured at start (Info.forward_ms_by_rows) holds for the machine as it was then,
and a machine of this kind moved from 1.27x to 2.2x for five rows within an hour (a compute-bound
spell: each int8 row costs its own pass over the weights). So each lone forward of a decode-ahead
updates a session's own one-row step and the service's cost of one more row, and the depth rule
prices rows at those. Not under rejection sampling, whose text for a seed depends on what was
drafted: a depth that followed the machine's moment would make a seed's text follow it too; those
sessions keep the start curve."""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING

from specsplit.speculation.ewma import Ewma
from specsplit.speculation.params import Method, SamplingParams

if TYPE_CHECKING:
    from specsplit.model.modeling import LoadedModel
    from verify_service.engine import Target

WARMUP_ROWS = 17  # Info.forward_ms_by_rows covers every width of 1..17 rows (verifies of 0..16 drafts)
# and up to the last of WIDE_ROWS (a batch of several sessions' rounds). Past a few rows a forward's
# cost is linear in its rows (each row is its own pass of multiply-adds over the weights), so the
# warm-up times the narrow widths a round uses most one by one and places the rest on lines between
# measured points: widths 10..17 and 32 were 57 % of a pass's rows, and the 64-row forward alone a
# third of its time (bf16 on AVX2: 307 of 990 ms), for no figure a line does not give
MEASURED_ROWS = (*range(1, 10), 12, WARMUP_ROWS)  # timed in every pass
WIDE_ROWS = (64,)  # timed in the first WIDE_PASSES passes only (only batches reach them)
MIN_PASSES, MAX_PASSES, STABLE = 3, 8, 0.05  # warm-up passes over every width, until none improves by 5 %
WIDE_PASSES = 2
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


def measure_rows(target: Target, token: int) -> list[float]:
    """Each width's cost in ms (InfoResponse.forward_ms_by_rows), on a 32-token session of `token`:
    the fastest of its forwards over passes that visit every measured width in turn (the rest on
    lines between them), so that a slow spell (a
    co-located service warming up at the same moment: measured, widths 1..6 at 180-200 ms against
    8-15 ms) costs each width one sample, not all of them; passes go on until one improves no width
    by more than STABLE (at most MAX_PASSES). Costs never fall with width (noise aside, a wider
    forward does more of the same work)."""
    session, result = target.prefill([token] * 32)

    def cost(rows: int) -> float:
        length = len(session.tokens)
        ms = target.verify(session, length, [result.next_token] * (rows - 1)).forward_ns / 1e6
        session.kv.truncate(length - 1)
        del session.tokens[length:]
        return ms

    wide = WIDE_ROWS if target.batches else ()
    best = {w: math.inf for w in (*MEASURED_ROWS, *wide)}
    for n in range(MAX_PASSES):
        moved = False
        for w in (*MEASURED_ROWS, *wide) if n < WIDE_PASSES else MEASURED_ROWS:
            ms = cost(w)
            moved |= ms < best[w] * (1 - STABLE)
            best[w] = min(best[w], ms)
        if n + 1 >= MIN_PASSES and not moved:
            break
    costs = [best[1]]
    for rows in sorted(best)[1:]:  # each measured width, and a line from the one before
        last, start = len(costs), costs[-1]
        costs += [start + (best[rows] - start) * (r - last) / (rows - last) for r in range(last + 1, rows + 1)]
    return list(itertools.accumulate(costs, max))


def first_id(lm: LoadedModel) -> int:
    return lm.tokenizer.bos_token_id if lm.tokenizer.bos_token_id is not None else 0

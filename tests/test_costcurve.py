"""The verifier's cost by width (InfoResponse.forward_ms_by_rows), which sizes token trees and the
controller's predictions: measured so that a slow spell at start-up does not stick to some widths."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from verify_service import widths
from verify_service.widths import MEASURED_ROWS, WARMUP_ROWS, WIDE_PASSES, WIDE_ROWS, measure_rows


class ScriptedTarget:
    """A target whose verify of n rows takes `ms(n, call)`; it records every width it was asked."""

    batches = True

    def __init__(self, ms):
        self.ms, self.calls = ms, []

    def prefill(self, ids):
        return SimpleNamespace(tokens=list(ids), kv=SimpleNamespace(truncate=lambda n: None)), \
            SimpleNamespace(next_token=1)

    def verify(self, session, length, drafts):
        rows = len(drafts) + 1
        self.calls.append(rows)
        session.tokens += [1] * rows
        return SimpleNamespace(forward_ns=int(self.ms(rows, len(self.calls)) * 1e6))


def test_a_slow_spell_at_start_up_costs_each_width_one_sample_not_its_figure():
    widths = len(MEASURED_ROWS) + len(WIDE_ROWS)
    # The first 12 forwards run 20x slow (a co-located service warming up meanwhile): in the old
    # measurement, three samples of each width in turn, that was every sample of widths 1..6.
    target = ScriptedTarget(lambda rows, call: (8 + 0.5 * rows) * (20 if call <= 12 else 1))
    costs = measure_rows(target, token=0)
    # the widths between the measured ones on lines, exact for a linear cost
    assert costs == pytest.approx([8 + 0.5 * rows for rows in range(1, WIDE_ROWS[-1] + 1)])
    # three passes (the third improved nothing, so it stopped); the wide ones in the first two only
    assert len(target.calls) == 3 * len(MEASURED_ROWS) + WIDE_PASSES * len(WIDE_ROWS)
    assert target.calls[:widths] == [*MEASURED_ROWS, *WIDE_ROWS]  # every measured width in turn
    assert 1 in MEASURED_ROWS and WARMUP_ROWS in MEASURED_ROWS


def test_costs_never_fall_with_width_and_noise_keeps_passes_going(monkeypatch):
    monkeypatch.setattr(widths, "MAX_PASSES", 5)
    # 9 rows measure faster than 8 (noise, or a kernel's sweet spot): a tree cut must not read
    # "one more row is cheaper". And a width that keeps improving keeps the passes going, to the cap.
    target = ScriptedTarget(lambda rows, call: 10 - (2 if rows == 9 else 0)
                            + (1000 / call if rows == WARMUP_ROWS else 0))
    costs = measure_rows(target, token=0)
    assert costs[7] == costs[8] == 10 and all(a <= b for a, b in zip(costs, costs[1:]))
    assert len(target.calls) == 5 * len(MEASURED_ROWS) + WIDE_PASSES * len(WIDE_ROWS)


def test_a_target_that_does_not_batch_is_measured_to_one_calls_width():
    target = ScriptedTarget(lambda rows, call: 8 + 0.5 * rows)
    target.batches = False
    costs = measure_rows(target, token=0)
    assert len(costs) == WARMUP_ROWS and max(target.calls) == WARMUP_ROWS

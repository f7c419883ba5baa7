"""The gateway's view of the draft service: per-drafter Propose budgets, down on a loss, up again
once a probe answers."""

from __future__ import annotations

import asyncio

from gateway import draftwatch
from gateway.draftwatch import DraftWatch


def test_budgets_follow_each_drafters_own_times():
    watch = DraftWatch(probe=None)
    assert watch.budget("ngram", False) == draftwatch.INITIAL_S  # nothing timed yet
    for _ in range(draftwatch.WARM):
        watch.record("ngram", False, 0.001)
        watch.record("model", False, 0.2)
    assert watch.budget("ngram", False) == draftwatch.FLOOR_S  # 3 x 1 ms is below the floor
    assert abs(watch.budget("model", False) - 3 * 0.2) < 1e-9
    assert watch.budget("model", True) == draftwatch.INITIAL_S  # a session's first call is timed apart


async def test_a_lost_drafter_is_down_until_a_probe_answers(monkeypatch):
    monkeypatch.setattr(draftwatch, "PROBE_FIRST_S", 0.01)
    answers = iter([ConnectionError("still down"), ConnectionError("still down"), None])
    calls = []

    async def probe():
        calls.append(1)
        outcome = next(answers)
        if outcome is not None:
            raise outcome

    watch = DraftWatch(probe)
    watch.lost("draft service: stream removed")
    watch.lost("a second failure while down changes nothing")
    assert not watch.up and watch.losses == 1 and watch.reason == "draft service: stream removed"
    for _ in range(200):
        if watch.up:
            break
        await asyncio.sleep(0.01)
    assert watch.up and watch.reason == "" and len(calls) == 3
    watch.close()

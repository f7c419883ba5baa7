"""The gateway's view of the draft service: per-drafter budgets, a stalled service told from a busy
one, down on a loss, up again once a probe answers."""

from __future__ import annotations

import asyncio

from conftest import until

from gateway import draftwatch
from gateway.draftwatch import DraftWatch


def test_budgets_follow_each_drafters_own_times():
    watch = DraftWatch(probe=None)
    assert watch.budget("ngram", "next") == draftwatch.INITIAL_S  # nothing timed yet
    for _ in range(draftwatch.WARM):
        watch.record("ngram", "next", 0.001)
        watch.record("model", "next", 0.5)
    assert watch.budget("ngram", "next") == draftwatch.FLOOR_S  # 3 x 1 ms is below the floor
    assert abs(watch.budget("model", "next") - 3 * 0.5) < 1e-9
    assert watch.budget("model", "first") == draftwatch.INITIAL_S  # a session's first call is timed apart
    assert watch.budget("model", "start") == draftwatch.INITIAL_S


async def test_a_call_is_given_up_only_when_the_whole_service_stalls(monkeypatch):
    # A budget of 0.5 s: 50 times the gap between the others' answers, so a loaded machine's
    # scheduling hiccups do not make the busy service look stalled.
    monkeypatch.setattr(draftwatch, "FLOOR_S", 0.5)
    watch = DraftWatch(probe=None)
    for _ in range(draftwatch.WARM):
        watch.record("ngram", "next", 0.001)
    assert watch.budget("ngram", "next") == 0.5

    async def answer(after: float) -> str:
        await asyncio.sleep(after)
        return "drafts"

    async def others_finishing(every: float, until: float) -> None:
        for _ in range(round(until / every)):  # each takes at least `every`
            await watch.guard("ngram", "next", answer(every))

    # Busy: one call queues for 1.5 s (3 budgets) while others keep finishing: it gets its answer.
    busy = asyncio.ensure_future(others_finishing(0.01, 1.6))
    assert await watch.guard("ngram", "next", answer(1.5)) == "drafts"
    await busy
    # Stalled: nothing finishes; the call is given up after about one budget and cancelled.
    cancelled = asyncio.Event()

    async def hang() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    try:
        await watch.guard("ngram", "next", hang())
        raise AssertionError("a stalled call was not given up")
    except TimeoutError as e:
        assert "ngram drafter's budget" in str(e)
    await asyncio.sleep(0)
    assert cancelled.is_set()  # given up and cancelled, not left to end its 60 s on its own


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
    await until(lambda: watch.up, "the watch's probe finding the draft service back", 30, every_s=0.01)
    assert watch.up and watch.reason == "" and len(calls) == 3
    watch.close()

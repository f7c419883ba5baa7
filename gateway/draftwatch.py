"""A draft service (one replica of it) as the gateway sees it: how long a call may wait, and
whether the service is up. Speculation is an optimisation, so a drafter that fails or stalls must cost a request its
drafts, never its answer: a call that fails, or waits past its budget while the service finishes
nothing else either, marks the service down (the request goes on target-only, new requests go to
another draft replica or start without speculation) and a probe with backoff brings it back.

Stalled, not busy: under a burst of sessions one call may queue behind many others for longer
than any per-call budget, while the service keeps answering. So a call is given up only when it
has waited its budget *and* no draft call of any session finished for that long; a SIGSTOPped or
hung service finishes nothing and is caught within one budget."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

log = logging.getLogger("specsplit.gateway")

WINDOW = 256  # recent call times a budget is read from
WARM = 16  # timed calls before the budget follows them
SLACK = 3.0  # the budget: SLACK x the P95 of recent calls ...
FLOOR_S = 1.0  # ... but never below this: a loaded host's scheduling pauses are not a dead drafter (0.4 s seen
#               with 48 sessions on one in-process stack)
REREAD = 32  # calls timed between two readings of a budget
INITIAL_S = 5.0  # ... and this until WARM calls of that kind were timed
PROBE_FIRST_S, PROBE_MAX_S = 0.25, 8.0  # re-probing a down service: first delay, doubling to this cap
PROBE_TIMEOUT_S = 1.0


class DraftWatch:
    def __init__(self, probe, clock=time.monotonic, name: str = "draft service"):
        """probe: an awaitable factory that succeeds when the draft service answers (its Info);
        name: what the log calls it (a replica's address when there are several)."""
        self._probe, self._clock, self.name = probe, clock, name
        self._times: dict[tuple[str, str], deque] = {}  # by (drafter, kind of call)
        self._budgets: dict[tuple[str, str], float] = {}  # read from _times, by (drafter, kind of call)
        self._recorded = 0
        self._progress = -float("inf")  # when a draft call last finished
        self.down_since: float | None = None
        self.reason = ""  # the failure that marked it down
        self.losses = 0  # times it was marked down
        self._task: asyncio.Task | None = None

    @property
    def up(self) -> bool:
        return self.down_since is None

    def budget(self, drafter: str, kind: str) -> float:
        """Seconds a call of `drafter` may wait with no progress. kind: "start" (StartSession, which
        may prefill a draft model on the prompt), "first" (a session's first Propose, which may
        carry the prompt's features) or "next". Drafters differ by orders of magnitude (n-gram
        lookup, a head, a model), and so do the kinds, so each pair is timed apart."""
        key = (drafter, kind)
        budget = self._budgets.get(key)
        if budget is None:  # read again every REREAD calls: sorting the window costs ~10 us a round
            times = self._times.get(key, ())
            if len(times) < WARM:
                return INITIAL_S
            p95 = sorted(times)[int(0.95 * (len(times) - 1))]
            budget = self._budgets[key] = max(FLOOR_S, SLACK * p95)
        return budget

    def record(self, drafter: str, kind: str, seconds: float) -> None:
        times = self._times.setdefault((drafter, kind), deque(maxlen=WINDOW))
        times.append(seconds)
        self._recorded += 1
        if self._recorded % REREAD == 0 or len(times) <= WARM:
            self._budgets.pop((drafter, kind), None)
        self._progress = self._clock()

    async def guard(self, drafter: str, kind: str, call):
        """Awaits the coroutine `call` and times it. Raises TimeoutError (the call cancelled) once it
        has waited its budget while the draft service finished nothing else for that long. The
        call runs in the caller's task under a timer, not in a task of its own: a round's Propose
        then starts at once rather than an event-loop turn later (~0.1 ms a round, measured)."""
        budget = self.budget(drafter, kind)
        start = self._clock()
        loop = asyncio.get_running_loop()
        scope = asyncio.timeout(None)

        def check() -> None:  # at the budget's end: given up, unless another call finished since
            nonlocal timer
            quiet = self._clock() - max(start, self._progress)
            if quiet >= budget:
                scope.reschedule(loop.time())
            else:
                timer = loop.call_later(budget - quiet, check)

        timer = loop.call_later(budget, check)
        try:
            async with scope:
                result = await call
        except TimeoutError:
            if scope.expired():
                raise TimeoutError(f"draft service: no answer within the {drafter} drafter's budget of "
                                   f"{budget:.3f} s, and no other call finished meanwhile") from None
            raise
        finally:
            timer.cancel()
        self.record(drafter, kind, self._clock() - start)
        return result

    def lost(self, why: str) -> None:
        """Marks the service down (once) and starts re-probing it."""
        if not self.up:
            return
        self.down_since, self.reason, self.losses = self._clock(), why, self.losses + 1
        log.warning("%s marked down, requests go on without its drafts: %s", self.name, why)
        self._task = asyncio.ensure_future(self._reprobe())

    async def _reprobe(self) -> None:
        delay = PROBE_FIRST_S
        while True:
            await asyncio.sleep(delay)
            try:
                async with asyncio.timeout(PROBE_TIMEOUT_S):
                    await self._probe()
            except Exception as e:  # noqa: BLE001 - any failure: still down
                log.info("%s still down (%s); next probe in %.2f s", self.name, str(e) or type(e).__name__,
                         min(2 * delay, PROBE_MAX_S))
                delay = min(2 * delay, PROBE_MAX_S)
                continue
            log.warning("%s answers again after %.1f s: speculation resumes", self.name,
                        self._clock() - self.down_since)
            self.down_since, self.reason = None, ""
            return

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

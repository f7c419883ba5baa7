"""The draft service as the gateway sees it: how long a Propose may take, and whether the service is
up. Speculation is an optimisation, so a drafter that fails or stalls must cost a request its
drafts, never its answer: a Propose that fails or overruns its budget marks the service down (the
request goes on target-only, new requests start without speculation) and a probe with backoff
brings it back."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

log = logging.getLogger("specsplit.gateway")

WINDOW = 256  # recent Propose times the budget is read from
WARM = 16  # timed calls before the budget follows them
SLACK = 3.0  # the budget: SLACK x the P95 of recent calls ...
FLOOR_S = 0.25  # ... but never below this: a loaded host's scheduling hiccups are not a dead drafter
INITIAL_S = 5.0  # ... and this until WARM calls were timed (or for a session's first Propose, whose
#                 prompt features may be thousands of rows, until WARM first calls were timed)
PROBE_FIRST_S, PROBE_MAX_S = 0.25, 8.0  # re-probing a down service: first delay, doubling to this cap
PROBE_TIMEOUT_S = 1.0


class DraftWatch:
    def __init__(self, probe, clock=time.monotonic):
        """probe: an awaitable factory that succeeds when the draft service answers (its Info)."""
        self._probe, self._clock = probe, clock
        self._times: dict[tuple[str, bool], deque] = {}  # by (drafter, a session's first call)
        self.down_since: float | None = None
        self.reason = ""  # the failure that marked it down
        self.losses = 0  # times it was marked down
        self._task: asyncio.Task | None = None

    @property
    def up(self) -> bool:
        return self.down_since is None

    def budget(self, drafter: str, first: bool) -> float:
        """Seconds a Propose of `drafter` may take (first: a session's first, which may carry the
        prompt's features). Drafters differ by orders of magnitude (n-gram lookup, a head, a model),
        so each is timed apart."""
        times = self._times.get((drafter, first), ())
        if len(times) < WARM:
            return INITIAL_S
        p95 = sorted(times)[int(0.95 * (len(times) - 1))]
        return max(FLOOR_S, SLACK * p95)

    def record(self, drafter: str, first: bool, seconds: float) -> None:
        self._times.setdefault((drafter, first), deque(maxlen=WINDOW)).append(seconds)

    def lost(self, why: str) -> None:
        """Marks the service down (once) and starts re-probing it."""
        if not self.up:
            return
        self.down_since, self.reason, self.losses = self._clock(), why, self.losses + 1
        log.warning("draft service marked down, requests go on without drafts: %s", why)
        self._task = asyncio.ensure_future(self._reprobe())

    async def _reprobe(self) -> None:
        delay = PROBE_FIRST_S
        while True:
            await asyncio.sleep(delay)
            try:
                async with asyncio.timeout(PROBE_TIMEOUT_S):
                    await self._probe()
            except Exception as e:  # noqa: BLE001 - any failure: still down
                log.info("draft service still down (%s); next probe in %.2f s", e, min(2 * delay, PROBE_MAX_S))
                delay = min(2 * delay, PROBE_MAX_S)
                continue
            log.warning("draft service answers again after %.1f s: speculation resumes",
                        self._clock() - self.down_since)
            self.down_since, self.reason = None, ""
            return

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

"""The OpenMP team size of each forward: all the CPUs this process may use, unless the scheduler
does not give them.

A busy neighbour on a shared machine takes a core without telling anyone. A team of two threads
on two cores then waits at every barrier (dozens per token) for the thread the scheduler parked:
measured on 2 cores with one busy process beside it, the default model's 1-row step went from
10.7 ms to 88 ms on 2 threads, while 1 thread took 14.6 ms. The sign is in the team's leader
(the worker thread): its CPU time over the forward's wall time is 1.00 while the team runs (it
spins or computes) and about 0.5 when it sleeps at barriers waiting for a parked thread.

So: after two of three forwards with that share below `low`, the team halves (8, 4, 2, 1); a
smaller team tries one forward at the next size up after `first_probe_s`, and moves up if that
forward's share is at least `high` (the CPUs are back), else waits twice as long (at most
`max_probe_s`) before the next try. A size that halves again within `stable_s` of moving up
doubles the wait too: contention that comes and goes costs one round trip per `max_probe_s`.
Co-located services that compute at once (the drafter and the verifier under many sessions) see
the same sign and split the cores between them.

A reduced team also watches the CPUs it may run on (`idle`, from the kernel's per-CPU idle time)
over windows of `idle_window_s`: when they sat idle for as many CPUs as the next size up adds (a
co-located drafter that computed beside it has stopped), the try is due at once rather than after
its wait, which can outlast a whole request run on half the team.

Only where results do not depend on the team size (the native kernels: tests/test_modeling.py
checks 1, 2 and 3 threads bit for bit) does the size change; elsewhere it stays at `most`. With
OMP_WAIT_POLICY=active the leader spins through every wait and the sign is lost."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger("specsplit")


class ThreadTuner:
    def __init__(self, most: int, set_threads: Callable[[int], None], name: str = "", low: float = 0.75,
                 high: float = 0.9, first_probe_s: float = 1.0, max_probe_s: float = 4.0, stable_s: float = 10.0,
                 min_wall_s: float = 1e-3, clock: Callable[[], float] = time.monotonic,
                 idle: Callable[[], float] | None = None, idle_window_s: float = 0.1, idle_share: float = 0.7):
        self.sizes = sorted({most >> k for k in range(max(1, most).bit_length())} - {0}, reverse=True)
        self.current = self.sizes[0]
        # None: the first forward sets its size (the thread it runs on may have started with another)
        self._set, self._applied, self.name, self._clock = set_threads, None, name, clock
        self.low, self.high, self.min_wall_s = low, high, min_wall_s
        self.first_probe_s, self.max_probe_s, self.stable_s = first_probe_s, max_probe_s, stable_s
        self._wait_s, self._probe_at, self._raised_at = first_probe_s, 0.0, float("-inf")
        self._starved: deque[bool] = deque(maxlen=3)  # the last forwards at the current size: share < low
        self.halvings = self.raises = 0
        self._idle, self.idle_window_s, self.idle_share = idle, idle_window_s, idle_share
        self._window: tuple[float, float] | None = None  # (clock, idle seconds) where the idle window began

    def size(self) -> int:
        """The team size for the next forward (and sets it): the current one, or the next up when a
        try is due."""
        size = self.current
        if size != self.sizes[0] and self._clock() >= self._probe_at:
            size = self.sizes[self.sizes.index(size) - 1]
        if size != self._applied:
            self._set(size)
            self._applied = size
        return size

    def record(self, size: int, wall_s: float, leader_cpu_s: float) -> None:
        """A forward on `size` threads took `wall_s`, of which the leader ran `leader_cpu_s`."""
        if wall_s < self.min_wall_s:
            return  # no model work (a retrieval draft, a release): nothing to learn
        share = leader_cpu_s / wall_s
        if size == self.current != self.sizes[0]:
            self._watch_idle()
        if size != self.current:  # a try at the next size up
            if share >= self.high:
                self._move(size, f"a forward on {size} ran its leader {share:.0%} of the time")
                self._raised_at = self._clock()
            else:
                self._wait_s = min(self.max_probe_s, 2 * self._wait_s)
                self._probe_at = self._clock() + self._wait_s
            return
        self._starved.append(share < self.low)
        if self.current != self.sizes[-1] and sum(self._starved) >= 2:
            smaller = self.sizes[self.sizes.index(self.current) + 1]
            self._move(smaller, f"the team's leader ran {share:.0%} of the forward: waiting for parked threads")
            now = self._clock()
            flapping = now - self._raised_at < self.stable_s
            self._wait_s = min(self.max_probe_s, 2 * self._wait_s) if flapping else self.first_probe_s
            self._probe_at = now + self._wait_s

    def _watch_idle(self) -> None:
        """On a reduced team: a try is due now if, over the last idle window, the CPUs sat idle for
        at least idle_share of what the next size up would use."""
        if self._idle is None:
            return
        now, idle = self._clock(), self._idle()
        if self._window is None:
            self._window = (now, idle)
            return
        began, idle_then = self._window
        if now - began < self.idle_window_s:
            return
        self._window = (now, idle)
        more = self.sizes[self.sizes.index(self.current) - 1] - self.current
        if idle - idle_then >= self.idle_share * more * (now - began):
            self._probe_at = now

    def _move(self, size: int, why: str) -> None:
        log.info("%s: %d -> %d threads per forward (%s)", self.name, self.current, size, why)
        if size < self.current:
            self.halvings += 1
        else:
            self.raises += 1
        self.current = size
        self._starved.clear()
        self._window = None

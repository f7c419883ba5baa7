"""The one owner of a service's per-session state: a bounded table with idle eviction."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from typing import Callable, Generic, TypeVar

T = TypeVar("T")
log = logging.getLogger("specsplit")


class SessionExists(KeyError):
    pass


class SessionNotFound(KeyError):
    pass


class TableFull(RuntimeError):
    pass


class Draining(RuntimeError):
    """The service is shutting down: it finishes the sessions it holds and takes no new one."""


class SessionEnded(KeyError):
    """The session was ended (Release / EndSession) before it started: a caller that gave up on a
    slow start ends it, and the start may still arrive afterwards."""


ENDED_MEMORY = 4096  # ids of sessions ended before they started, remembered so their start is refused


class SessionTable(Generic[T]):
    """Sessions by id. A session idle for longer than `idle_timeout_s` is evicted when room is
    needed or on `evict_idle()`, so a crashed gateway cannot leak caches forever: each evicted
    state goes to the callback its owner gave `when_evicted` (which ends it as a release would:
    its cache budget, its shared-memory segment, its drafter's session)."""

    def __init__(self, max_sessions: int, idle_timeout_s: float, clock=time.monotonic):
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self._clock = clock
        self._items: OrderedDict[str, tuple[T, float]] = OrderedDict()  # least recently used first
        self._ended: OrderedDict[str, None] = OrderedDict()  # ended before they started, oldest first
        self._lock = threading.Lock()
        self.draining = False  # set on shutdown: new sessions are refused (Draining), held ones go on
        self._evicted: Callable[[str, T], None] | None = None

    def when_evicted(self, callback: Callable[[str, T], None]) -> None:
        """callback(session_id, state) for each session evicted from now on, after it left the
        table, on the thread that evicted it (a service hands it to its worker thread)."""
        self._evicted = callback

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._items

    def put(self, session_id: str, state: T) -> None:
        with self._lock:
            evicted = self._put(session_id, state)
        self._end(evicted)

    def _put(self, session_id: str, state: T) -> list[tuple[str, T]]:
        if self.draining:
            raise Draining("draining before it stops: start the session on another replica")
        if session_id in self._ended:
            del self._ended[session_id]
            raise SessionEnded(session_id)
        if session_id in self._items:
            raise SessionExists(session_id)
        evicted = self._evict_idle() if len(self._items) >= self.max_sessions else []
        if len(self._items) >= self.max_sessions:  # (nothing was evicted)
            raise TableFull(f"all {self.max_sessions} sessions are in use")
        self._items[session_id] = (state, self._clock())
        return evicted

    def get(self, session_id: str) -> T:
        with self._lock:
            try:
                state, _ = self._items[session_id]
            except KeyError:
                raise SessionNotFound(session_id) from None
            self._items[session_id] = (state, self._clock())
            self._items.move_to_end(session_id)
            return state

    def ended(self, session_id: str) -> bool:
        """Whether the session was ended before it started (its start, still under way, may stop)."""
        with self._lock:
            return session_id in self._ended

    def pop(self, session_id: str) -> T | None:
        """Ends a session: its state, or None when it is not here; then its id is remembered (the
        last ENDED_MEMORY of them), so a start that arrives after its end is refused (SessionEnded)."""
        with self._lock:
            item = self._items.pop(session_id, None)
            if item is None:
                self._ended[session_id] = None
                if len(self._ended) > ENDED_MEMORY:
                    self._ended.popitem(last=False)
        return None if item is None else item[0]

    def active(self, within_s: float) -> int:
        """Sessions used within the last `within_s` seconds (one whose caller is gone is not)."""
        with self._lock:
            since = self._clock() - within_s
            return sum(1 for _, used in self._items.values() if used >= since)

    def evict_idle(self) -> list[str]:
        with self._lock:
            evicted = self._evict_idle()
        self._end(evicted)
        return [sid for sid, _ in evicted]

    def _evict_idle(self) -> list[tuple[str, T]]:
        deadline = self._clock() - self.idle_timeout_s
        stale = [sid for sid, (_, used) in self._items.items() if used < deadline]
        return [(sid, self._items.pop(sid)[0]) for sid in stale]

    def _end(self, evicted: list[tuple[str, T]]) -> None:
        if self._evicted is not None:
            for sid, state in evicted:
                self._evicted(sid, state)

    async def sweep(self, interval_s: float) -> None:
        """Evicts idle sessions every interval_s until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            for session_id in self.evict_idle():
                log.warning("evicted session %s after %.0f s idle", session_id, self.idle_timeout_s)
